"""The run lock, on a real (local-transport) head: atomic take, refusal naming the holder, stale detection,
deliberate clearing, release on every way out, resume of the same run."""
from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from sparkbook.core.nodes import Cluster
from sparkbook.core.params import Params, load_params
from sparkbook.runbook import driver, lock


@pytest.fixture
def params(base: dict[str, Any], write_params: Callable[..., Path], tmp_path: Path) -> Params:
    for node in base["nodes"]:
        node["transport"] = "local"
    base["run_lock"] = {"path": str(tmp_path / "locks" / "run.lock"), "stale_after_s": 3600}
    return load_params(write_params(base))


@pytest.fixture
def head(params: Params):
    cluster = Cluster(params)
    yield cluster.head
    cluster.close()


@pytest.fixture
def live_pid():
    proc = subprocess.Popen(["sleep", "300"])
    yield proc.pid
    proc.kill()
    proc.wait()


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def _holder(run_id: str, pid: int, **changes: Any) -> lock.Holder:
    return dataclasses.replace(lock.me(run_id, "cluster.yaml"), pid=pid, pid_started=lock._start_ticks(pid),
                               **changes)


def test_take_writes_the_holder_and_release_removes_it(params: Params, head) -> None:
    held = lock.acquire(params, head, lock.me("run-a", "cluster.yaml"), params_file="cluster.yaml")
    written = json.loads((Path(params.run_lock.path) / "holder.json").read_text())
    assert written["run_id"] == "run-a" and set(written) >= {"host", "pid", "user", "started"}
    assert lock.read(head, params.run_lock.path) == held.holder
    assert held.release()
    assert not Path(params.run_lock.path).exists()
    assert not list(Path(params.run_lock.path).parent.iterdir()), "no temporary directory is left behind"


def test_second_run_is_refused_naming_the_holder(params: Params, head, live_pid: int) -> None:
    lock.acquire(params, head, _holder("run-a", live_pid), params_file="cluster.yaml")
    with pytest.raises(lock.LockHeld) as refused:
        lock.acquire(params, head, lock.me("run-b", "cluster.yaml"), params_file="cluster.yaml", break_stale=True)
    text = str(refused.value)
    assert "run-a" in text and f"pid {live_pid}" in text and params.run_lock.path in text and head.name in text
    assert "sparkbook unlock cluster.yaml" in text and not refused.value.stale
    assert lock.read(head, params.run_lock.path).run_id == "run-a", "a refused run leaves the lock alone"


def test_lock_of_a_dead_process_here_is_taken_over_saying_so(params: Params, head) -> None:
    dead = _dead_pid()
    lock.acquire(params, head, _holder("run-a", dead), params_file="cluster.yaml")
    held = lock.acquire(params, head, lock.me("run-b", "cluster.yaml"), params_file="cluster.yaml")
    assert lock.read(head, params.run_lock.path).run_id == "run-b"
    line = held.took_over_line()
    assert line and "took over the lock of run run-a" in line and f"pid {dead} is not running" in line, line
    held.release()
    fresh = lock.acquire(params, head, lock.me("run-c", "cluster.yaml"), params_file="cluster.yaml")
    assert fresh.took_over_line() is None, "a free lock is taken, not taken over"
    fresh.release()


def test_lock_of_a_dead_pid_on_another_host_still_refuses(params: Params, head) -> None:
    lock.acquire(params, head, _holder("run-a", _dead_pid(), host="elsewhere"), params_file="cluster.yaml")
    with pytest.raises(lock.LockHeld) as refused:
        lock.acquire(params, head, lock.me("run-b", "cluster.yaml"), params_file="cluster.yaml")
    assert "may still be going" in str(refused.value), "its PID cannot be checked from here"
    assert lock.read(head, params.run_lock.path).run_id == "run-a"


def test_lock_older_than_the_limit_is_stale_even_from_another_host(params: Params, head, live_pid: int) -> None:
    old = (datetime.now(UTC) - timedelta(hours=2)).isoformat(timespec="seconds")
    lock.acquire(params, head, _holder("run-a", live_pid, host="elsewhere", started=old), params_file="x")
    assert "more than run_lock.stale_after_s" in lock.staleness(lock.read(head, params.run_lock.path), 3600)
    recent = _holder("run-a", live_pid, host="elsewhere")
    assert lock.staleness(recent, 3600) is None, "another host's recent lock may be live: never assumed stale"


def test_a_reused_pid_does_not_keep_a_lock_alive(live_pid: int) -> None:
    holder = _holder("run-a", live_pid)
    assert lock.staleness(holder, 3600) is None
    assert "now another process" in lock.staleness(dataclasses.replace(holder, pid_started=1), 3600)


def test_resume_takes_over_its_own_stale_lock_but_not_a_live_one(params: Params, head, live_pid: int) -> None:
    lock.acquire(params, head, _holder("run-a", _dead_pid()), params_file="x")
    lock.acquire(params, head, lock.me("run-a", "x"), params_file="x", same_run="run-a").release()
    lock.acquire(params, head, _holder("run-a", live_pid), params_file="x")
    with pytest.raises(lock.LockHeld):
        lock.acquire(params, head, lock.me("run-a", "x"), params_file="x", same_run="run-a")


def test_release_leaves_a_lock_that_is_no_longer_ours(params: Params, head, live_pid: int) -> None:
    held = lock.acquire(params, head, lock.me("run-a", "x"), params_file="x")
    lock.unlock(params, head, force=True)
    lock.acquire(params, head, _holder("run-b", live_pid), params_file="x")
    assert not held.release()
    assert lock.read(head, params.run_lock.path).run_id == "run-b"


def test_unlock_keeps_a_live_local_holder_unless_forced(params: Params, head, live_pid: int) -> None:
    assert lock.unlock(params, head).holder is None
    lock.acquire(params, head, _holder("run-a", live_pid), params_file="x")
    with pytest.raises(lock.LockError, match=f"kill {live_pid}"):
        lock.unlock(params, head)
    done = lock.unlock(params, head, force=True)
    assert done.removed and done.holder.run_id == "run-a"


def test_cli_run_refuses_and_unlock_clears(params: Params, head, live_pid: int, tmp_path: Path) -> None:
    params_file = next(tmp_path.glob("*.yaml"))
    lock.acquire(params, head, _holder("run-a", live_pid), params_file=str(params_file))
    cli = [sys.executable, "-m", "sparkbook.cli"]
    refused = subprocess.run([*cli, "run", str(params_file), "--outputs", str(tmp_path / "out"), "--break-lock"],
                             capture_output=True, text=True, timeout=120)
    assert refused.returncode == lock_exit() and "locked by run run-a" in refused.stderr, refused.stderr
    assert "Traceback" not in refused.stderr and not (tmp_path / "out").exists(), "refused before any run dir"
    kept = subprocess.run([*cli, "unlock", str(params_file)], capture_output=True, text=True, timeout=60)
    assert kept.returncode == lock_exit() and "still running on this host" in kept.stderr
    subprocess.run(["kill", str(live_pid)], check=True)
    cleared = subprocess.run([*cli, "unlock", str(params_file)], capture_output=True, text=True, timeout=60)
    assert cleared.returncode == 0 and "removed the lock of run run-a" in cleared.stdout, cleared.stdout
    assert lock.read(head, params.run_lock.path) is None


def lock_exit() -> int:
    from sparkbook.cli import EXIT_LOCKED
    return EXIT_LOCKED


def test_interrupted_run_releases_the_lock(params: Params, tmp_path: Path) -> None:
    """Ctrl-C while a notebook runs (here: in the runner's progress callback) still removes the lock."""
    params_file = next(tmp_path.glob("*.yaml"))
    seen: list[bool] = []

    def interrupt(line: str) -> None:
        if line.startswith("[1/"):
            seen.append(Path(params.run_lock.path).is_dir())
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        driver.run(params_file, out_root=tmp_path / "out", say=interrupt)
    assert seen == [True], "the lock is held while notebooks run"
    assert not Path(params.run_lock.path).exists()
