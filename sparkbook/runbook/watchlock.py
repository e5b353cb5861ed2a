"""One watch per cluster: a second `sparkbook watch` of the same cluster would restart the same deployment twice
over and spend the restart budget twice as fast.

The watch holds an exclusive flock on outputs/<cluster>/watch.lock while it runs and writes its pid, host and start
time in it. The kernel drops the lock when its holder's process ends, however it ends, so a dead watch's lock is
taken over by the next one without a judgment of its own (the file then says whose it was); a live holder's is
refused with one line naming it. The file is opened without following a link."""
from __future__ import annotations

import fcntl
import json
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path

from pydantic import TypeAdapter

from ..core.values.errors import SparkbookError
from ..core.values.rundir import WATCH_LOCK
from . import lock

_HOLDER = TypeAdapter(lock.Holder)


class WatchRunning(SparkbookError):
    """Another watch of this cluster runs (or the lock file is not one a watch wrote)."""

    exit_kind = "invalid"
    label = "refused"


def path(cluster_dir: Path) -> Path:
    return cluster_dir / WATCH_LOCK


def _holder(text: str) -> lock.Holder | None:
    try:
        return _HOLDER.validate_python(json.loads(text))
    except ValueError:
        return None


@contextmanager
def held(cluster_dir: Path, params_file: Path, say: Callable[[str], None]) -> Iterator[lock.Holder]:
    """Hold the cluster's watch lock while the body runs; WatchRunning where a live watch holds it."""
    file = path(cluster_dir)
    cluster_dir.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(file, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        raise WatchRunning(f"cannot open the watch lock {file}: {exc.strerror or exc}",
                           remediation="it must be a plain file of your own; remove what is there") from None
    try:
        before = os.read(fd, 65536).decode(errors="replace")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(before)
            who = (f"pid {holder.pid} on host {holder.host} (user {holder.user}, since {holder.started})" if holder
                   else "another process")
            raise WatchRunning(f"cluster {cluster_dir.name} is watched already by {who}: {file} is locked",
                               remediation="one watch per cluster; stop that one first (`systemctl stop` its unit, "
                               "or end its process)") from None
        if gone := _holder(before):
            say(f"watch lock: the last watch of cluster {cluster_dir.name} (pid {gone.pid} on host {gone.host}, "
                f"since {gone.started}) has ended; taken over")
        me = lock.me("watch", params_file)
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(asdict(me)).encode(), 0)
        try:
            yield me
        finally:
            os.ftruncate(fd, 0)  # released: the file says nobody watches
    finally:
        os.close(fd)
