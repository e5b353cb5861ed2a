"""Fault injection on the lab for tests/lab/test_faults.py: each fault is a context manager that injects on
entry and always undoes on exit; `Watch` says what a step left running on every node (over the lab's SSH);
`bounded` runs a sparkbook call with a hard time limit; `Report` is the fault table (JSON + markdown)."""
from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

# what a sparkbook step may start on a node: its containers, Ray, vLLM, image streams, a port holder, a probe
WATCHED = re.compile(r"vllm|\bray\b|raylet|gcs_server|docker (save|load)|http\.server|config\.json|sleep infinity")
CONTAINER_PREFIX = "sparkbook-"


# --- faults ----------------------------------------------------------------------------------------
def daemon_pid(init_pid: int, comm: str) -> int:
    """The PID of the node init's child `comm` (sshd or dockerd: the lab's node init starts both)."""
    kids = Path(f"/proc/{init_pid}/task/{init_pid}/children").read_text().split()
    return next(int(p) for p in kids if Path(f"/proc/{p}/comm").read_text().strip() == comm)


@contextlib.contextmanager
def stopped(pid: int) -> Iterator[None]:
    """SIGSTOP the process (a daemon that accepts connections and never answers), SIGCONT on exit.
    The node init restarts a daemon that exits, so stopping it is what keeps it down."""
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


@contextlib.contextmanager
def firewall(netns: str, *rules: list[str]) -> Iterator[None]:
    """Insert iptables rules in a node's network namespace; delete them on exit."""
    ipt = ["nsenter", f"--net=/var/run/netns/{netns}", "iptables", "-w", "5"]
    added = []
    try:
        for rule in rules:
            subprocess.run([*ipt, "-I", *rule], check=True, timeout=30)
            added.append(rule)
        yield
    finally:
        for rule in reversed(added):
            subprocess.run([*ipt, "-D", *rule], check=True, timeout=30)


@contextlib.contextmanager
def fifo_instead(path: Path) -> Iterator[None]:
    """Replace a file with a FIFO nobody writes to: reading it never returns (a hung mount). Restored on exit."""
    aside = path.with_name(path.name + ".faults-aside")
    os.rename(path, aside)
    try:
        os.mkfifo(path)
        yield
    finally:
        if path.exists() or path.is_fifo():
            path.unlink()
        os.rename(aside, path)


# --- calls with a hard limit -----------------------------------------------------------------------
@dataclass
class Call:
    """How a call ended: its value or its exception, and when it returned (monotonic)."""

    value: Any = None
    error: BaseException | None = None
    returned_at: float = 0.0


def start(fn: Callable[[], Any]) -> tuple[ThreadPoolExecutor, Any]:
    pool = ThreadPoolExecutor(1, thread_name_prefix="fault-call")
    return pool, pool.submit(_capture, fn)


def _capture(fn: Callable[[], Any]) -> Call:
    try:
        return Call(value=fn(), returned_at=time.monotonic())
    except Exception as exc:  # the failure is the observation
        return Call(error=exc, returned_at=time.monotonic())


def finish(started: tuple[ThreadPoolExecutor, Any], limit_s: float) -> Call:
    """The call's outcome; AssertionError when it has not returned within `limit_s` (it hangs)."""
    pool, future = started
    try:
        return future.result(timeout=limit_s)
    except FutureTimeout:
        raise AssertionError(f"the call did not return within {limit_s:g} s: it hangs") from None
    finally:
        pool.shutdown(wait=False)


def bounded(fn: Callable[[], Any], limit_s: float) -> Call:
    return finish(start(fn), limit_s)


# --- what is running -------------------------------------------------------------------------------
@dataclass(frozen=True)
class Seen:
    """Watched processes (pid -> args) and sparkbook containers (name -> state) per node."""

    processes: dict[str, dict[int, str]]
    containers: dict[str, dict[str, str]]


class Watch:
    """Snapshots of every node over the lab's SSH (connections opened before any fault, so they outlive one)."""

    def __init__(self, shells: dict[str, Any]):
        self.shells = shells

    def seen(self) -> Seen:
        procs, conts = {}, {}
        for name, sh in self.shells.items():
            _, out, _ = sh.run(["ps", "-eo", "pid=,args="], timeout=60)
            rows = (line.strip().split(None, 1) for line in out.splitlines() if line.strip())
            procs[name] = {int(r[0]): r[1] for r in rows if len(r) == 2 and WATCHED.search(r[1])
                           and not r[1].startswith("ps ")}
            _, out, _ = sh.run(["docker", "ps", "-a", "--format", "{{.Names}}\t{{.State}}"], timeout=60)
            conts[name] = dict(line.split("\t", 1) for line in out.splitlines()
                               if line.startswith(CONTAINER_PREFIX))
        return Seen(procs, conts)

    def left(self, before: Seen, settle_s: float = 30) -> list[str]:
        """What runs now that did not before (new watched processes, new or restarted sparkbook containers),
        polled until nothing is left or `settle_s` passed (a killed process group takes seconds to go)."""
        end = time.monotonic() + settle_s
        while True:
            now = self.seen()
            new = [f"{n}: {args[:120]} (pid {pid})" for n, ps in now.processes.items() for pid, args in ps.items()
                   if pid not in before.processes.get(n, {})]
            new += [f"{n}: container {c} ({state})" for n, cs in now.containers.items() for c, state in cs.items()
                    if state == "running" and before.containers.get(n, {}).get(c) != "running"]
            if not new or time.monotonic() > end:
                return new
            time.sleep(3)


# --- the table -------------------------------------------------------------------------------------
@dataclass
class Row:
    fault: str
    node: str
    detected_s: float
    message: str
    left_running: list[str] = field(default_factory=list)
    call: str = ""


class Report:
    """The fault table, written as faults.json and faults.md into `folder` and printed."""

    def __init__(self, folder: Path):
        self.folder, self.rows = folder, []

    def add(self, row: Row) -> None:
        self.rows.append(row)
        self.write()

    def markdown(self) -> str:
        lines = ["| fault | node | time to detection (s) | message shown | left running |", "|---|---|---|---|---|"]
        for r in self.rows:
            msg = r.message.replace("|", "\\|").replace("\n", " ")[:300]
            lines.append(f"| {r.fault} | {r.node} | {r.detected_s:.1f} | {msg} | "
                         f"{'; '.join(r.left_running) or 'nothing'} |")
        return "\n".join(lines)

    def write(self) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        (self.folder / "faults.json").write_text(json.dumps([asdict(r) for r in self.rows], indent=1))
        (self.folder / "faults.md").write_text(self.markdown() + "\n")
