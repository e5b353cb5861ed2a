"""The run lock: one `sparkbook run` per cluster at a time, held as a directory on the head node.

Taking it is one atomic rename on the head (a fresh directory holding `holder.json` becomes the lock
directory, or the rename fails because a lock is there). A lock whose holder is provably gone (its PID is
not running on the host it names) or older than `run_lock.stale_after_s` is reported as stale. One whose holder
ran on this very controller and whose PID is gone is taken over by the next run, which says so (a killed run cannot
release it, and nothing else could hold it); any other stale lock is cleared only on request: `sparkbook unlock
PARAMS` or `sparkbook run PARAMS --break-lock`.
"""
from __future__ import annotations

import getpass
import json
import os
import socket
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path

from tenacity import RetryCallState, Retrying, retry_if_result, stop_after_attempt

from ..core.errors import SparkbookError
from ..core.nodes import Node, shell
from ..core.params import Params

HOLDER = "holder.json"
TIMEOUT_S = 60  # a loaded node's login shell can take most of this before the command starts
_TAKE = ('mkdir -p "$(dirname {path})" || exit 3; t=$(mktemp -d "$(dirname {path})/.lock.XXXXXX") || exit 3; '
         'printf %s {holder} >"$t"/holder.json || exit 3; mv -T "$t" {path} 2>/dev/null || {{ rm -rf "$t"; exit 17; }}')
_READ = 'cat {path}/holder.json 2>/dev/null || {{ test -d {path} && echo "{{}}"; }}'
_REMOVE = 'test -d {path} || exit 1; rm -rf {path}'
EXISTS = 17


@dataclass(frozen=True)
class Holder:
    """Who holds the lock: the run, and the process on the machine that started it."""

    run_id: str
    host: str
    pid: int
    user: str
    started: str
    params_file: str = ""
    pid_started: int | None = None  # the process's start time in clock ticks since boot (tells a reused PID)

    def describe(self) -> str:
        return (f"run {self.run_id} (pid {self.pid} on host {self.host}, user {self.user}, started {self.started}"
                + (f", params {self.params_file}" if self.params_file else "") + ")")

    def age_s(self) -> float:
        try:
            return (datetime.now(UTC) - datetime.fromisoformat(self.started)).total_seconds()
        except ValueError:
            return float("inf")


def me(run_id: str, params_file: str | Path) -> Holder:
    pid = os.getpid()
    return Holder(run_id, socket.gethostname(), pid, getpass.getuser(),
                  datetime.now(UTC).isoformat(timespec="seconds"), str(params_file), _start_ticks(pid))


def _start_ticks(pid: int) -> int | None:
    """When process `pid` started (clock ticks since boot); None when it is gone or a zombie."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return None if fields[0] in ("Z", "X") else int(fields[19])
    except (OSError, IndexError, ValueError):
        return None


def dead_here(holder: Holder, host: str | None = None) -> str | None:
    """Why the holder provably no longer runs (its PID on this controller is gone or now another process); None
    when it may still run or is on another host (its PID cannot be checked from here)."""
    if not holder.started or holder.host != (host or socket.gethostname()):
        return None
    ticks = _start_ticks(holder.pid)
    if ticks is None:
        return f"pid {holder.pid} is not running on {holder.host}"
    if holder.pid_started is not None and ticks != holder.pid_started:
        return f"pid {holder.pid} on {holder.host} is now another process (the holder exited)"
    return None


def staleness(holder: Holder, stale_after_s: float, host: str | None = None) -> str | None:
    """Why the lock is stale (None when its holder may still run): its process is gone, or it is too old."""
    if not holder.started:
        return "the lock directory holds no readable holder.json"
    if dead := dead_here(holder, host):
        return dead
    if holder.age_s() > stale_after_s:
        return f"it is {holder.age_s() / 3600:.1f} h old, more than run_lock.stale_after_s ({stale_after_s:g} s)"
    return None


class LockError(SparkbookError):
    """The run lock could not be taken, read or cleared; the message says what to do."""


class LockHeld(LockError):
    def __init__(self, where: str, holder: Holder, stale: str | None, params_file: str):
        self.holder, self.stale = holder, stale
        clear = f"`sparkbook unlock {params_file}` (or `sparkbook run {params_file} --break-lock`)"
        if stale:
            advice = f"The lock is STALE: {stale}. Clear it deliberately with {clear}, then run again."
        else:
            advice = (f"That run may still be going: wait for it or stop it. If you know it is gone, clear the "
                      f"lock with {clear}.")
        super().__init__(f"the cluster is locked by {holder.describe()}: {where}. {advice}")


@dataclass
class RunLock:
    """A lock this process holds on the head; `release` removes it only while it is still ours."""

    node: Node
    path: str
    holder: Holder
    took_over: str | None = None  # the dead holder whose lock this run took over, and why it is dead

    def took_over_line(self) -> str | None:
        return f"run lock: took over the lock of {self.took_over}" if self.took_over else None

    def release(self) -> bool:
        current = read(self.node, self.path)
        if current != self.holder:
            return False
        return _remove(self.node, self.path)


def _where(node: Node, path: str) -> str:
    return f"lock {path} on {node.name} ({node.spec.host})"


def read(node: Node, path: str) -> Holder | None:
    """The lock's holder, or None when the head holds no lock."""
    out = node.run(shell(_READ, path=path), timeout=TIMEOUT_S)
    if not out.stdout.strip():
        return None
    try:
        data = json.loads(out.stdout)
        return Holder(**data)
    except (ValueError, TypeError):
        return Holder("unknown", "unknown", 0, "unknown", "", "")  # a lock dir nobody could have made: stale by age


def _remove(node: Node, path: str) -> bool:
    return node.run(shell(_REMOVE, path=path), timeout=TIMEOUT_S).ok


def acquire(params: Params, node: Node, holder: Holder, *, params_file: str, break_stale: bool = False,
            same_run: str | None = None) -> RunLock:
    """Take the lock for `holder`; refuse (LockHeld) while another run holds it. A stale lock is taken over
    when `break_stale` is set, when it is `same_run`'s own (a resume after that run was killed), or when its
    holder ran on this controller and its PID is gone (the returned lock names it in `took_over`)."""
    path = params.run_lock.path
    took_over: list[str] = []

    def take() -> RunLock | None:
        """The lock, or None when it is worth one more try (released meanwhile, or a stale one removed)."""
        took = node.run(shell(_TAKE, path=path, holder=json.dumps(asdict(holder))), timeout=TIMEOUT_S)
        if took.ok or (took.exit_code != EXISTS and read(node, path) == holder):  # a late answer: it did take
            return RunLock(node, path, holder, took_over[-1] if took_over else None)
        if took.exit_code != EXISTS:
            what = "no answer in time" if took.timed_out else (took.stderr or took.stdout).strip()[-300:]
            raise LockError(f"cannot take the {_where(node, path)}: {what}")
        current = read(node, path)
        if current is None:
            return None  # released between our attempt and the read: try once more
        stale = staleness(current, params.run_lock.stale_after_s)
        dead = dead_here(current)
        if stale and (break_stale or current.run_id == same_run or dead):
            _remove(node, path)
            if dead:
                took_over.append(f"{current.describe()}: {dead}")
            return None
        raise LockHeld(_where(node, path), current, stale, params_file)

    def changed_hands(state: RetryCallState) -> RunLock:
        raise LockError(f"cannot take the {_where(node, path)}: it changed hands while we tried; run again")

    held = Retrying(stop=stop_after_attempt(2), retry=retry_if_result(lambda held: held is None),
                    retry_error_callback=changed_hands)(take)
    assert held is not None  # a None is retried, and the last one raises in changed_hands
    return held


@dataclass(frozen=True)
class Unlocked:
    holder: Holder | None
    stale: str | None
    removed: bool


def unlock(params: Params, node: Node, *, force: bool = False) -> Unlocked:
    """Clear the lock deliberately; a holder still running on this very host is kept unless `force`."""
    path = params.run_lock.path
    current = read(node, path)
    if current is None:
        return Unlocked(None, None, False)
    stale = staleness(current, params.run_lock.stale_after_s)
    if not stale and current.host == socket.gethostname() and not force:
        raise LockError(f"{_where(node, path)} is held by {current.describe()}, which is still running on this "
                        "host", remediation=f"stop it first (kill {current.pid}), or pass --force")
    return Unlocked(current, stale, _remove(node, path))
