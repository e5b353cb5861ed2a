"""Put one image on every node with the same image ID: `docker save` on the head streamed into `docker load`.

    image_ids(ctx, ref) -> {node: id | None}         what must match on every node (the image ID), per node
    plan(ctx, ref) -> ImageCopyPlan                  which nodes need the image (the head is the source)
    layer_skip(ctx, ref, node) -> (diff IDs, held)   the image's layers and those the node holds (not sent again)
    push_image(ctx, ref, node, dest, size, skip) -> Copy   the head pushes to the node's fabric IP (ssh on the head)
    copy_image(ctx, ref, node, size_bytes, skip) -> Copy   relayed through this machine to the node's host
    distribute(ctx, ref) -> Distribution             plan, copy where needed (fabric first), verify every ID

No node ever pulls from a registry: the head's image is the only source (the seed's worker had no internet).
The head sends over the fabric (the nodes' direct link) where it reaches the node's fabric IP by SSH; else the
stream is relayed through this machine to `host`, and the copy says why. Layers the node already holds (a shared
base, the previous version) are left out of the stream (layerdelta); where that load fails the whole image is
sent, and the copy says so.
"""
from __future__ import annotations

import fcntl
import os
import re
import shlex
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import IO

import paramiko

from ...core.cluster.context import Context
from ...core.cluster.nodes import Node, NodeError, Result
from ...core.cluster.progress import Progress
from ...core.cluster.runtime import ID_TIMEOUT_S
from ...core.values.errors import SparkbookError
from ...core.values.handoff import pinned
from ...core.values.stagelist import IMAGES
from . import layerdelta

PIPE_BYTES = 1 << 20
MIN_RATE_BPS = 10e6  # the copy's timeout assumes at least this rate, plus COPY_SLACK_S
COPY_SLACK_S = 120
LAYERS = ["docker", "image", "inspect", "--format", "{{join .RootFS.Layers \",\"}}"]
# on the head: save, leave out the held layers, count bytes (dd's progress on stdout), load on the node by SSH
PUSH = ("set -o pipefail; {{ docker save {ref} | {filter} | dd bs=1M status=progress 2>&3 | "
        "ssh -p {port} -o BatchMode=yes -o ConnectTimeout={connect} {dest} docker load >&2; }} 3>&1")
LAYER_FILTER = Path(layerdelta.__file__).read_text()  # run on the head with python3 -c (stdlib only)
REACH_TIMEOUT_S = 30
DD_BYTES = re.compile(rb"(\d+) bytes")


class NotDistributed(SparkbookError):
    """After the copies, a node does not hold the chosen image under the head's ID (its message is the
    Distribution's)."""

    stage = IMAGES.name


@dataclass(frozen=True)
class ImageCopyPlan:
    """The source image on the head and, per node, whether it already holds the same ID."""

    image: str
    source: str
    image_id: str
    size_bytes: int
    held: dict[str, str | None]

    @property
    def to_copy(self) -> list[str]:
        return [node for node, held in self.held.items() if held != self.image_id]


@dataclass(frozen=True)
class Copy:
    """One node's copy: bytes streamed, time, rate and what `docker load` said."""

    node: str
    bytes: int
    seconds: float
    loaded: str
    error: str = ""
    route: str = ""  # "fabric <ip> from <head>" | "host <addr> through this machine (why)"
    mode: str = ""  # "whole image" | "delta: ..." and, after a failed delta, why the whole image was sent

    @property
    def mb_s(self) -> float:
        return round(self.bytes / 1e6 / self.seconds, 1) if self.seconds else 0.0


@dataclass(frozen=True)
class Distribution:
    """The outcome: what was copied, what was skipped, and every node's image ID afterwards."""

    image: str
    image_id: str
    copies: list[Copy]
    skipped: list[str]
    ids: dict[str, str | None]
    note: str = ""  # set where nothing is an image (the Python runtime): what was checked instead

    @property
    def verified(self) -> bool:
        return all(i == self.image_id for i in self.ids.values()) and not any(c.error for c in self.copies)

    @property
    def message(self) -> str:
        if self.note:
            state = "the same on every node" if self.verified else "NOT THE SAME ON EVERY NODE"
            return f"{self.note}; {self.image_id} {state}"
        if not self.copies:
            return f"every node already holds {self.image} as {self.image_id}: nothing copied"
        copied = ", ".join(f"{c.node} ({c.bytes / 1e9:.2f} GB at {c.mb_s} MB/s"
                           + "".join(f"; {x}" for x in (c.route, c.mode) if x) + ")" for c in self.copies)
        state = "all image IDs match" if self.verified else "IMAGE IDS DIFFER"
        return f"copied {self.image} to {copied}; skipped {', '.join(self.skipped) or 'none'}; {state}"

    def rows(self) -> list[dict[str, object]]:
        done = {c.node: c for c in self.copies}
        return [{"node": node, "image id": held, "matches head": held == self.image_id,
                 "action": f"copied {done[node].bytes / 1e9:.2f} GB in {done[node].seconds:.1f} s "
                           f"({done[node].mb_s} MB/s)"
                           + "".join(f"; {x}" for x in (done[node].route, done[node].mode) if x)
                           + (f": {done[node].error}" if done[node].error else "")
                 if node in done else
                 ("its own environment: nothing to copy" if self.note else "already held: skipped")}
                for node, held in self.ids.items()]


def image_ids(ctx: Context, ref: str, timeout: float = ID_TIMEOUT_S + 30) -> dict[str, str | None]:
    source = ctx.images
    outcomes = ctx.cluster.fan_out(lambda n: source.identity(n, ref), timeout=timeout)
    return {name: o.value if o.ok else None for name, o in outcomes.items()}


def plan(ctx: Context, ref: str) -> ImageCopyPlan:
    """Which nodes lack `ref` with the head's ID; fails when the head itself does not hold it."""
    head = ctx.head
    source = ctx.images.image(head, ref)
    if source is None:
        raise NodeError(head.name, f"does not hold {ref}: sparkbook copies images from the head and never pulls "
                                   "(load it there first)")
    return ImageCopyPlan(ref, head.name, *source, image_ids(ctx, held_as(ref, source[0])))


def held_as(ref: str, image_id: str) -> str:
    """What a node that got `ref` holds it under: its ID for a digest pin (`docker load` brings no repo digest: the
    pin names nothing there, measured), else `ref` (the tag comes with the image)."""
    return image_id if pinned(ref) else ref


def copy_image(ctx: Context, ref: str, node: Node, size_bytes: int,
               skip: tuple[list[str], list[str]] | None = None) -> Copy:
    """Stream `docker save REF` from the head into `docker load` on `node` over SSH, with progress; with `skip`
    (the image's diff IDs, the chain IDs the node holds) the head leaves those layers out of the stream."""
    head, target = ctx.head.streaming(), node.streaming()
    try:
        target.connect()  # reach the loading side first: an unread `docker save` runs on for minutes on the head
        return _copy(head, ref, target, size_bytes, save_argv(ref, skip))
    finally:
        for extra in {head, target} - {ctx.head, node}:
            extra.close()


def save_argv(ref: str, skip: tuple[list[str], list[str]] | None) -> list[str]:
    """`docker save REF`, piped through the layer filter (python3 on the head) where layers are left out."""
    if not skip or not skip[1]:
        return ["docker", "save", ref]
    return ["bash", "--norc", "--noprofile", "-c",
            f"set -o pipefail; docker save {shlex.quote(ref)} | {filter_command(*skip)}"]


def filter_command(diff_ids: list[str], held: list[str]) -> str:
    """The head's shell command that leaves the held layers out of a save stream (`cat` when none are held)."""
    if not held:
        return "cat"
    return shlex.join(["python3", "-c", LAYER_FILTER, ",".join(diff_ids), ",".join(held)])


def _copy(head: Node, ref: str, node: Node, size_bytes: int, save: list[str] | None = None) -> Copy:
    timeout = COPY_SLACK_S + size_bytes / MIN_RATE_BPS
    read_fd, write_fd = os.pipe()
    fcntl.fcntl(write_fd, fcntl.F_SETPIPE_SZ, PIPE_BYTES)
    saved: list[Result] = []
    with open(read_fd, "rb") as reader, Progress(f"copy to {node.name}", total=size_bytes / 1e6, unit=" MB") as bar:
        sender = threading.Thread(target=_save, args=(head, save or ["docker", "save", ref], write_fd, timeout,
                                                      saved), daemon=True)
        t0 = time.monotonic()
        sender.start()
        sent = [0]

        def advance(n: int) -> None:
            sent[0] += n
            bar.advance(n / 1e6)

        loaded, broke = _load(node, reader, timeout, advance)
        seconds = time.monotonic() - t0
    sender.join(timeout=30)
    errors = [f"{r.node}: `{r.command}` exited {r.exit_code}: {r.stderr.strip()[-300:]}"
              for r in (*saved, *filter(None, [loaded])) if not r.ok]
    return Copy(node.name, sent[0], seconds, loaded.stdout.strip() if loaded else "", "; ".join([*errors, *broke]))


def _load(node: Node, reader: IO[bytes], timeout: float,
          advance: Callable[[int], None]) -> tuple[Result | None, list[str]]:
    """`docker load` on the node fed from `reader`; (its result, or None and why the stream broke)."""
    try:
        return node.stream(["docker", "load"], source=reader, timeout=timeout, on_bytes=advance), []
    except (OSError, paramiko.SSHException) as exc:
        return None, [f"{node.name}: the `docker load` stream broke: {exc}"]


def _save(head: Node, argv: list[str], write_fd: int, timeout: float, saved: list[Result]) -> None:
    try:
        with open(write_fd, "wb") as writer:
            saved.append(head.stream(argv, sink=writer, timeout=timeout))
    except BrokenPipeError:  # the loading side stopped early; its own result carries the error
        pass


def environment_check(ctx: Context, python: str) -> Distribution:
    """The Python runtime has no image to copy: each node runs its own environment. Check instead that every
    node's interpreter holds the head's vLLM version (the `ids` are those versions: the runtime's identity)."""
    ids = image_ids(ctx, python, timeout=ID_TIMEOUT_S + 60)
    head = ids.get(ctx.head.name) or "no vLLM on the head"
    return Distribution(python, head, [], list(ids), ids,
                        note=f"runtime python: no image to distribute (nothing copied); each node runs {python}")


def layer_skip(ctx: Context, ref: str, node: Node) -> tuple[list[str], list[str]]:
    """(the image's diff IDs on the head, the chain IDs of those layers `node` already holds)."""
    head = ctx.head
    diff_ids = head.run([*LAYERS, ref], timeout=ID_TIMEOUT_S, check=True).stdout.strip().split(",")
    held = node.run(["sh", "-c", 'ids=$(docker images -aq); [ -z "$ids" ] || exec "$@" $ids', "layers", *LAYERS],
                    timeout=ID_TIMEOUT_S, check=True).stdout.split()
    return diff_ids, layerdelta.layers_to_skip(diff_ids, [line.split(",") for line in held])


def fabric_dest(ctx: Context, node: Node) -> tuple[str | None, str | None]:
    """(user@fabric_ip, None) where the head reaches `node`'s fabric IP by SSH with docker there, else (None, why)."""
    spec, ssh = node.spec, ctx.params.ssh
    dest = f"{spec.ssh_user or ssh.user}@{spec.fabric_ip}"
    r = ctx.head.run(["ssh", "-p", str(spec.ssh_port or ssh.port), "-o", "BatchMode=yes", "-o",
                      f"ConnectTimeout={ssh.connect_timeout_s:g}", dest, "docker", "version", "--format",
                      "{{.Server.Version}}"], timeout=REACH_TIMEOUT_S)
    if r.ok:
        return dest, None
    return None, (f"{ctx.head.name} cannot run docker on {node.name}'s fabric IP {spec.fabric_ip} over SSH "
                f"(exit {r.exit_code}: {(r.stderr.strip() or r.stdout.strip())[-200:]})")


def push_image(ctx: Context, ref: str, node: Node, dest: str, size_bytes: int,
               skip: tuple[list[str], list[str]] | None = None) -> Copy:
    """The head streams `docker save` (held layers left out) into `docker load` on `dest` (the node's fabric IP)."""
    spec, head = node.spec, ctx.head
    argv = ["bash", "--norc", "--noprofile", "-c", PUSH.format(
        ref=shlex.quote(ref), filter=filter_command(*skip) if skip else "cat",
        port=spec.ssh_port or ctx.params.ssh.port, connect=f"{ctx.params.ssh.connect_timeout_s:g}",
        dest=shlex.quote(dest))]
    timeout = COPY_SLACK_S + size_bytes / MIN_RATE_BPS
    counter = _DDProgress()
    t0 = time.monotonic()
    with Progress(f"copy to {node.name} over the fabric", total=size_bytes / 1e6, unit=" MB") as bar:
        counter.bar = bar
        r = head.stream(argv, sink=counter, timeout=timeout)
    loaded = "\n".join(line for line in r.stderr.splitlines() if line.startswith("Loaded image"))
    ended = "timed out" if r.timed_out else f"exited {r.exit_code}"
    error = "" if r.ok else f"{head.name} -> {dest}: the pushed stream {ended}: {r.stderr.strip()[-300:]}"
    return Copy(node.name, counter.bytes, time.monotonic() - t0, loaded, error,
                f"fabric {spec.fabric_ip} from {head.name}")


class _DDProgress:
    """A sink for dd's progress lines: the bytes it has passed on, shown on the bar."""

    def __init__(self) -> None:
        self.bytes = 0
        self.bar: Progress | None = None

    def write(self, chunk: bytes) -> None:
        found = DD_BYTES.findall(chunk)
        if found:
            self.bytes = max(self.bytes, int(found[-1]))
            if self.bar is not None:
                self.bar.update(self.bytes / 1e6)


def send(ctx: Context, ref: str, node: Node, size_bytes: int) -> Copy:
    """One node: over the fabric where the head reaches it (else relayed to its host, saying why), held layers
    left out; where the delta load fails, the whole image again, saying so."""
    skip = layer_skip(ctx, ref, node)
    dest, why_not = fabric_dest(ctx, node)

    def one(s: tuple[list[str], list[str]] | None) -> Copy:
        if dest:
            return push_image(ctx, ref, node, dest, size_bytes, s)
        c = copy_image(ctx, ref, node, size_bytes, s)
        return replace(c, route=f"host {node.spec.host} through this machine: {why_not}")

    mode = (f"delta: {len(skip[1])} of {len(skip[0])} layers already on {node.name}, left out" if skip[1]
            else "whole image (no layer of it on the node)")
    copy = replace(one(skip if skip[1] else None), mode=mode)
    if copy.error and skip[1]:
        whole = one(None)
        return replace(whole, mode=f"whole image: the delta load failed ({copy.error[-200:]})")
    return copy


def distribute(ctx: Context, ref: str) -> Distribution:
    """Copy `ref` from the head to every node lacking its ID (one at a time), then verify every node's ID.
    For the Python runtime nothing is copied: `environment_check` compares every node's vLLM version."""
    if not ctx.images.copies_images:
        return environment_check(ctx, ref)
    p = plan(ctx, ref)
    copies = [send(ctx, ref, ctx.cluster.nodes[name], p.size_bytes) for name in p.to_copy]
    skipped = [name for name in p.held if name not in p.to_copy]
    return Distribution(ref, p.image_id, copies, skipped, image_ids(ctx, held_as(ref, p.image_id)))
