"""The run lock: one `sparkbook run` per cluster at a time, held as a directory on the head node.

Taking it is one atomic rename on the head (a fresh directory holding `holder.json` becomes the lock
directory, or the rename fails because a lock is there). The lock is a directory sparkbook made: it holds
`holder.json` alone, marked `"sparkbook_lock": 1`, in the head's state dir (core.cluster.nodestate: the runbook's own,
so no one else can rename it away or plant one); anything else at its path is refused and left alone, and
clearing a lock removes that one file and the then empty directory, nothing more. A lock whose holder is provably gone
(it ran in this controller's boot and PID namespace, and its PID is gone or now another process) or older than
`run_lock.stale_after_s` is reported as stale. One whose holder is provably gone is taken over by the next run, which
says so (a killed run cannot release it, and nothing else could hold it); any other stale lock is cleared only on
request: `sparkbook unlock PARAMS` or `sparkbook run PARAMS --break-lock`.
"""
from __future__ import annotations

import getpass
import json
import os
import socket
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path

from pydantic import TypeAdapter
from tenacity import RetryCallState, Retrying, retry_if_result, stop_after_attempt

from ..core.cluster.nodes import Node, NodeError, shell
from ..core.cluster.nodestate import lock_path
from ..core.values.errors import SparkbookError
from ..core.values.params import Params

HOLDER = "holder.json"
MARK = "sparkbook_lock"  # in every holder.json sparkbook writes, and nowhere else: what makes a directory a lock
TIMEOUT_S = 60  # a loaded node's login shell can take most of this before the command starts
# the rename would replace an empty directory: one that is there already is left to _READ to refuse
_TAKE = ('test -e {path} || test -L {path} && exit 17; mkdir -p "$(dirname {path})" || exit 3; '
         't=$(mktemp -d "$(dirname {path})/.lock.XXXXXX") || exit 3; printf %s {holder} >"$t"/holder.json || exit 3; '
         'mv -T "$t" {path} 2>/dev/null || {{ rm -f "$t"/holder.json; rmdir "$t"; exit 17; }}')
_READ = ('test -e {path} || test -L {path} || exit 0; test -d {path} && test ! -L {path} || exit 4; '
         'test "$(ls -A {path})" = holder.json && test -f {path}/holder.json && test ! -L {path}/holder.json '
         '|| {{ ls -A {path}; exit 5; }}; cat {path}/holder.json')
# only the holder.json read before, then the directory it leaves empty: a lock changed meanwhile is not ours to clear
_REMOVE = ('test ! -L {path} && cd {path} && test "$(ls -A)" = holder.json && test ! -L holder.json '
           '&& test "$(cat holder.json)" = {raw} && rm -f holder.json && cd / && rmdir {path}')
EXISTS, NOT_A_DIR, NOT_ALONE = 17, 4, 5


@dataclass(frozen=True)
class Holder:
    """Who holds the lock: the run, and the process on the machine that started it."""

    run_id: str
    host: str
    host_id: str  # the controller's boot and PID namespace (_host_id): where `pid` names this process
    pid: int
    pid_started: int | None  # the process's start time in clock ticks since boot (tells a reused PID)
    user: str
    started: str
    params_file: str

    def describe(self) -> str:
        return (f"run {self.run_id} (pid {self.pid} on host {self.host}, user {self.user}, started {self.started}"
                + (f", params {self.params_file}" if self.params_file else "") + ")")

    def age_s(self) -> float:
        try:
            return (datetime.now(UTC) - datetime.fromisoformat(self.started)).total_seconds()
        except ValueError:
            return float("inf")


_HOLDER_JSON = TypeAdapter(Holder)


def me(run_id: str, params_file: str | Path) -> Holder:
    pid = os.getpid()
    return Holder(run_id, socket.gethostname(), _host_id(), pid, _start_ticks(pid), getpass.getuser(),
                  datetime.now(UTC).isoformat(timespec="seconds"), str(params_file))


def _host_id() -> str:
    """This controller's kernel boot and PID namespace ("" where unreadable): a PID names one process only within
    both, and a hostname tells neither (two machines, or containers of one, can share a hostname)."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        return f"{boot} {os.readlink('/proc/self/ns/pid')}"
    except OSError:
        return ""


def _start_ticks(pid: int) -> int | None:
    """When process `pid` started (clock ticks since boot); None when it is gone or a zombie."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return None if fields[0] in ("Z", "X") else int(fields[19])
    except (OSError, IndexError, ValueError):
        return None


def dead_here(holder: Holder) -> str | None:
    """Why the holder provably no longer runs (it ran in this controller's boot and PID namespace, and its PID is
    gone or now another process); None when it may still run or ran elsewhere (its PID cannot be checked here)."""
    if not _ran_here(holder):
        return None
    ticks = _start_ticks(holder.pid)
    if ticks is None:
        return f"pid {holder.pid} is not running on {holder.host}"
    if holder.pid_started is not None and ticks != holder.pid_started:
        return f"pid {holder.pid} on {holder.host} is now another process (the holder exited)"
    return None


def _ran_here(holder: Holder) -> bool:
    """The holder ran in this controller's boot and PID namespace, so its PID can be checked here."""
    return bool(holder.host_id) and holder.host_id == _host_id()


def staleness(holder: Holder, stale_after_s: float) -> str | None:
    """Why the lock is stale (None when its holder may still run): its process is gone, or it is too old."""
    if dead := dead_here(holder):
        return dead
    if holder.age_s() > stale_after_s:
        return f"it is {holder.age_s() / 3600:.1f} h old, more than run_lock.stale_after_s ({stale_after_s:g} s)"
    return None


class LockError(SparkbookError):
    """The run lock could not be taken, read or cleared; the message says what to do."""

    exit_kind = "locked"
    label = "refused"


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
        current = _read(self.node, self.path)
        if current is None or current[0] != self.holder:
            return False
        return _remove(self.node, self.path, current[1])


def _where(node: Node, path: str) -> str:
    return f"lock {path} on {node.name} ({node.spec.host})"


def read(node: Node, path: str) -> Holder | None:
    """The lock's holder, or None when the head holds no lock; LockError when `path` is not a lock sparkbook made."""
    held = _read(node, path)
    return held[0] if held else None


def _read(node: Node, path: str) -> tuple[Holder, str] | None:
    """The holder and holder.json's text (what _remove checks is still there), or None when there is no lock."""
    out = node.run(shell(_READ, path=path), timeout=TIMEOUT_S)
    if out.exit_code == NOT_A_DIR:
        raise _not_a_lock(node, path, "it is a file or a symbolic link, not a directory")
    if out.exit_code == NOT_ALONE:
        raise _not_a_lock(node, path, _contents(out.stdout.split()))
    if not out.ok:
        what = "no answer in time" if out.timed_out else (out.stderr or out.stdout).strip()[-300:]
        raise LockError(f"cannot read the {_where(node, path)}: {what}")
    if not out.stdout:
        return None
    try:
        data = json.loads(out.stdout)
        holder = _HOLDER_JSON.validate_python(data) if isinstance(data, dict) and data.pop(MARK, None) == 1 else None
    except ValueError:  # not JSON, or a field missing or of the wrong type (pydantic's ValidationError)
        holder = None
    if holder is None:
        raise _not_a_lock(node, path, f'its {HOLDER} is not one sparkbook wrote (those have "{MARK}": 1 and the run, '
                          'host and pid holding the lock)')
    return holder, out.stdout


def _contents(names: list[str]) -> str:
    """Why a directory holding `names` is no lock: a lock holds holder.json alone, as a plain file."""
    if not names:
        return "it is empty"
    if names == [HOLDER]:
        return f"its {HOLDER} is not a plain file"
    return f"it holds {', '.join(names[:5])}{' ...' if names[5:] else ''}, not {HOLDER} alone"


def _not_a_lock(node: Node, path: str, why: str) -> LockError:
    return LockError(f"{path} on {node.name} ({node.spec.host}) is not a run lock sparkbook made: {why}; it is "
                     "left as it is", remediation=f"if it really is a lock, remove it by hand on {node.name}")


def _remove(node: Node, path: str, raw: str) -> bool:
    return node.run(shell(_REMOVE, path=path, raw=raw), timeout=TIMEOUT_S).ok


def acquire(params: Params, node: Node, holder: Holder, *, params_file: str, break_stale: bool = False,
            same_run: str | None = None) -> RunLock:
    """Take the lock for `holder`; refuse (LockHeld) while another run holds it. A stale lock is taken over
    when `break_stale` is set, when it is `same_run`'s own (a resume after that run was killed), or when its
    holder ran on this controller and its PID is gone (the returned lock names it in `took_over`)."""
    path = lock_path(node)
    took_over: list[str] = []

    def take() -> RunLock | None:
        """The lock, or None when it is worth one more try (released meanwhile, or a stale one removed)."""
        took = node.run(shell(_TAKE, path=path, holder=json.dumps({MARK: 1, **asdict(holder)})), timeout=TIMEOUT_S)
        if took.ok or (took.exit_code != EXISTS and read(node, path) == holder):  # a late answer: it did take
            return RunLock(node, path, holder, took_over[-1] if took_over else None)
        if took.exit_code != EXISTS:
            what = "no answer in time" if took.timed_out else (took.stderr or took.stdout).strip()[-300:]
            raise LockError(f"cannot take the {_where(node, path)}: {what}")
        held = _read(node, path)
        if held is None:
            return None  # released between our attempt and the read: try once more
        current, raw = held
        stale = staleness(current, params.run_lock.stale_after_s)
        dead = dead_here(current)
        if stale and (break_stale or current.run_id == same_run or dead):
            _remove(node, path, raw)
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


@contextmanager
def held(params: Params, node: Node, holder: Holder, *, params_file: str, say: Callable[[str], None],
         break_stale: bool = False, same_run: str | None = None) -> Iterator[RunLock]:
    """Hold the lock while the body runs (a run, a restore, a stop: each would race the others) and release it
    however the body ends, Ctrl-C too; LockHeld, naming the holder, while another holds it."""
    try:
        taken = acquire(params, node, holder, params_file=params_file, break_stale=break_stale, same_run=same_run)
    except NodeError as exc:
        raise LockError(f"cannot take the run lock on the head: {exc}") from None
    if line := taken.took_over_line():
        say(line)
    try:
        yield taken
    finally:
        try:
            if not taken.release():
                say(f"run lock: {taken.path} on {node.name} is no longer ours; left as it is")
        except NodeError as exc:
            say(f"run lock NOT released ({exc}): clear it with `sparkbook unlock {params_file}`")


@dataclass(frozen=True)
class Unlocked:
    holder: Holder | None
    stale: str | None
    removed: bool


def unlock(params: Params, node: Node, *, force: bool = False) -> Unlocked:
    """Clear the lock deliberately; a holder still running on this very host is kept unless `force`."""
    path = lock_path(node)
    held = _read(node, path)
    if held is None:
        return Unlocked(None, None, False)
    current, raw = held
    stale = staleness(current, params.run_lock.stale_after_s)
    if not stale and _ran_here(current) and not force:
        raise LockError(f"{_where(node, path)} is held by {current.describe()}, which is still running on this "
                        "host", remediation=f"stop it first (kill {current.pid}), or pass --force")
    return Unlocked(current, stale, _remove(node, path, raw))
