"""Put one image on every node with the same image ID: `docker save` on the head streamed into `docker load`.

    image_ids(run, ref) -> {node: id | None}         what must match on every node (the image ID), per node
    plan(run, ref) -> CopyPlan                       which nodes need the image (the head is the source)
    copy_image(run, ref, node, size_bytes) -> Copy   one streamed copy over SSH, with progress and MB/s
    distribute(run, ref) -> Distribution             plan, copy where needed, verify every ID

No node ever pulls from a registry: the head's image is the only source (the seed's worker had no internet).
"""
from __future__ import annotations

import fcntl
import os
import threading
import time
from dataclasses import dataclass
from typing import IO, Callable

import paramiko

from ..core.nodes import Node, NodeError, Result
from ..core.progress import Progress
from ..core.record import Run
from ..core.runtime import ID_TIMEOUT_S, runtime_for

PIPE_BYTES = 1 << 20
MIN_RATE_BPS = 10e6  # the copy's timeout assumes at least this rate, plus COPY_SLACK_S
COPY_SLACK_S = 120


@dataclass(frozen=True)
class CopyPlan:
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
        copied = ", ".join(f"{c.node} ({c.bytes / 1e9:.2f} GB at {c.mb_s} MB/s)" for c in self.copies)
        state = "all image IDs match" if self.verified else "IMAGE IDS DIFFER"
        return f"copied {self.image} to {copied}; skipped {', '.join(self.skipped) or 'none'}; {state}"

    def rows(self) -> list[dict[str, object]]:
        done = {c.node: c for c in self.copies}
        return [{"node": node, "image id": held, "matches head": held == self.image_id,
                 "action": f"copied {done[node].bytes / 1e9:.2f} GB in {done[node].seconds:.1f} s "
                           f"({done[node].mb_s} MB/s)" + (f": {done[node].error}" if done[node].error else "")
                 if node in done else ("its own environment: nothing to copy" if self.note else "already held: skipped")}
                for node, held in self.ids.items()]


def image_ids(run: Run, ref: str, timeout: float = ID_TIMEOUT_S + 30) -> dict[str, str | None]:
    rt = runtime_for(run.params)
    outcomes = run.cluster.fan_out(lambda n: rt.identity(n, ref), timeout=timeout)
    return {name: o.value if o.ok else None for name, o in outcomes.items()}


def plan(run: Run, ref: str) -> CopyPlan:
    """Which nodes lack `ref` with the head's ID; fails when the head itself does not hold it."""
    head = run.cluster.head
    source = runtime_for(run.params).image(head, ref)
    if source is None:
        raise NodeError(head.name, f"does not hold {ref}: sparkbook copies images from the head and never pulls "
                                   "(load it there first)")
    return CopyPlan(ref, head.name, *source, image_ids(run, ref))


def copy_image(run: Run, ref: str, node: Node, size_bytes: int) -> Copy:
    """Stream `docker save REF` from the head into `docker load` on `node` over SSH, with progress."""
    head, target = run.cluster.head.streaming(), node.streaming()
    try:
        target.connect()  # reach the loading side first: an unread `docker save` runs on for minutes on the head
        return _copy(head, ref, target, size_bytes)
    finally:
        for extra in {head, target} - {run.cluster.head, node}:
            extra.close()


def _copy(head: Node, ref: str, node: Node, size_bytes: int) -> Copy:
    timeout = COPY_SLACK_S + size_bytes / MIN_RATE_BPS
    read_fd, write_fd = os.pipe()
    fcntl.fcntl(write_fd, fcntl.F_SETPIPE_SZ, PIPE_BYTES)
    saved: list[Result] = []
    with open(read_fd, "rb") as reader, Progress(f"copy to {node.name}", total=size_bytes / 1e6, unit=" MB") as bar:
        sender = threading.Thread(target=_save, args=(head, ref, write_fd, timeout, saved), daemon=True)
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


def _load(node: Node, reader: IO[bytes], timeout: float, advance: Callable[[int], None]) -> tuple[Result | None, list[str]]:
    """`docker load` on the node fed from `reader`; (its result, or None and why the stream broke)."""
    try:
        return node.stream(["docker", "load"], source=reader, timeout=timeout, on_bytes=advance), []
    except (OSError, paramiko.SSHException) as exc:
        return None, [f"{node.name}: the `docker load` stream broke: {exc}"]


def _save(head: Node, ref: str, write_fd: int, timeout: float, saved: list[Result]) -> None:
    try:
        with open(write_fd, "wb") as writer:
            saved.append(head.stream(["docker", "save", ref], sink=writer, timeout=timeout))
    except BrokenPipeError:  # the loading side stopped early; its own result carries the error
        pass


def environment_check(run: Run, python: str) -> Distribution:
    """The Python runtime has no image to copy: each node runs its own environment. Check instead that every
    node's interpreter holds the head's vLLM version (the `ids` are those versions: the runtime's identity)."""
    ids = image_ids(run, python, timeout=ID_TIMEOUT_S + 60)
    head = ids.get(run.cluster.head.name) or "no vLLM on the head"
    return Distribution(python, head, [], list(ids), ids,
                        note=f"runtime python: no image to distribute (nothing copied); each node runs {python}")


def distribute(run: Run, ref: str) -> Distribution:
    """Copy `ref` from the head to every node lacking its ID (one at a time), then verify every node's ID.
    For the Python runtime nothing is copied: `environment_check` compares every node's vLLM version."""
    if not runtime_for(run.params).copies_images:
        return environment_check(run, ref)
    p = plan(run, ref)
    copies = [copy_image(run, ref, run.cluster.nodes[name], p.size_bytes) for name in p.to_copy]
    skipped = [name for name in p.held if name not in p.to_copy]
    return Distribution(ref, p.image_id, copies, skipped, image_ids(run, ref))
