"""Send only the image layers a node lacks: a `docker save` stream with the layers it holds left out.

Docker's (legacy, `manifest.json`) loader skips reading a layer's `layer.tar` when the daemon already holds that
layer's chain ID, so a save stream without those files loads to the same image ID. The stream names each layer by
its v1 ID (`<v1id>/layer.tar`), which Docker derives from the layer's chain ID and its parent's v1 ID
(image/v1.CreateID); the layer's own `<v1id>/json` comes first in the stream, so each v1 ID is matched to a chain ID
before its layer passes. A layer that cannot be matched is sent (the stream stays loadable).

Pure helpers (`chain_ids`, `layers_to_skip`, `v1_id`) are used by the controller; `filter_stream` runs on the head
(`python3 -c` of this file's source: stdlib only) between `docker save` and the network.
"""
from __future__ import annotations

import hashlib
import json
import sys
import tarfile
from typing import IO


def chain_ids(diff_ids: list[str]) -> list[str]:
    """The chain ID of each layer prefix: chain(1) = diff(1), chain(n) = sha256(chain(n-1) + " " + diff(n))."""
    out: list[str] = []
    for diff in diff_ids:
        out.append(diff if not out else "sha256:" + hashlib.sha256(f"{out[-1]} {diff}".encode()).hexdigest())
    return out


def layers_to_skip(image_diff_ids: list[str], held_images: list[list[str]]) -> list[str]:
    """The chain IDs of `image_diff_ids`' layers that the node already holds (it holds a layer when one of its
    images' layer lists starts with the same prefix)."""
    held = {c for layers in held_images for c in chain_ids(layers)}
    return [c for c in chain_ids(image_diff_ids) if c in held]


def _go_json(value: object) -> str:
    """json.Marshal's text of a value (sorted keys as Go marshals a map, HTML characters escaped)."""
    text = json.dumps(value, separators=(",", ":"), ensure_ascii=False)
    for ch, esc in (("<", "\\u003c"), (">", "\\u003e"), ("&", "\\u0026"), ("\u2028", "\\u2028"),
                    ("\u2029", "\\u2029")):
        text = text.replace(ch, esc)
    return text


def v1_id(v1_json: dict[str, object], chain_id: str, parent: str, drop: tuple[str, ...] = ()) -> str:
    """image/v1.CreateID: sha256 of the layer's v1 config without its id (and `drop`), with layer_id and parent."""
    config = {k: v for k, v in v1_json.items() if k not in ("id", "parent", *drop)}
    config["layer_id"] = chain_id
    if parent:
        config["parent"] = parent
    body = "{" + ",".join(f"{_go_json(k)}:{_go_json(config[k])}" for k in sorted(config)) + "}"
    return hashlib.sha256(body.encode()).hexdigest()


def match_chain(v1: str, v1_json: dict[str, object], chains: list[str]) -> str | None:
    """Which of the image's chain IDs the v1 ID `v1` stands for (None when none reproduces it). Docker adds the
    image's `os` after computing the ID of every layer but the top one, so both forms are tried."""
    parent = f"sha256:{v1_json['parent']}" if v1_json.get("parent") else ""
    for chain in chains:
        for drop in ((), ("os",)):
            if v1_id(v1_json, chain, parent, drop) == v1:
                return chain
    return None


def filter_stream(source: IO[bytes], sink: IO[bytes], image_diff_ids: list[str], skip: set[str]) -> tuple[int, int]:
    """Copy the tar stream `source` to `sink`, leaving out each `<v1id>/layer.tar` whose chain ID is in `skip`.
    Returns (layers left out, their bytes)."""
    chains = chain_ids(image_diff_ids)
    matched: dict[str, str | None] = {}
    left_out = left_bytes = 0
    with tarfile.open(fileobj=source, mode="r|") as tin, tarfile.open(fileobj=sink, mode="w|",
                                                                       format=tarfile.GNU_FORMAT) as tout:
        for member in tin:
            data = tin.extractfile(member) if member.isfile() else None
            v1, _, leaf = member.name.partition("/")
            if leaf == "json" and data is not None:
                raw = data.read()
                try:
                    matched[v1] = match_chain(v1, json.loads(raw), chains)
                except (ValueError, TypeError):
                    matched[v1] = None
                tout.addfile(member, _Bytes(raw))
                continue
            if leaf == "layer.tar" and matched.get(v1) in skip:
                left_out, left_bytes = left_out + 1, left_bytes + member.size
                continue
            tout.addfile(member, data)
    return left_out, left_bytes


class _Bytes:
    """A read() over bytes already read (tarfile.addfile reads its data from a file object)."""

    def __init__(self, data: bytes):
        self.data, self.pos = data, 0

    def read(self, n: int = -1) -> bytes:
        end = len(self.data) if n < 0 else self.pos + n
        out, self.pos = self.data[self.pos:end], min(end, len(self.data))
        return out


def main(argv: list[str]) -> int:
    """`python3 -c SOURCE DIFF_IDS SKIP_CHAINS` (comma-separated): stdin's save stream to stdout, filtered."""
    diff_ids, skip = argv[0].split(","), set(filter(None, argv[1].split(",")))
    left_out, left_bytes = filter_stream(sys.stdin.buffer, sys.stdout.buffer, diff_ids, skip)
    sys.stdout.buffer.flush()
    print(f"layerdelta: left out {left_out} of {len(skip)} held layers ({left_bytes} bytes)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
