"""The run lock, on a real (local-transport) head: atomic take, refusal naming the holder, stale detection,
deliberate clearing, release on every way out, resume of the same run; a path that is no lock sparkbook made is
never removed, and the schema keeps the path below a directory of sparkbook's own."""
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

from sparkbook.core.cluster.nodes import Cluster
from sparkbook.core.values.params import Params, ParamsError, load_params
from sparkbook.runbook import driver, lock
from sparkbook.runbook.driver import RunOptions


@pytest.fixture
def params(base: dict[str, Any], write_params: Callable[..., Path], tmp_path: Path) -> Params:
    for node in base["nodes"]:
        node.update(transport="local", state_dir=str(tmp_path / "state" / node["name"]))
    base["run_lock"] = {"stale_after_s": 3600}
    return load_params(write_params(base))


def _path(params: Params) -> str:
    """The lock, in the head's state dir."""
    return f"{params.head.state_dir}/run.lock"


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


def _other_boot() -> str:
    """This controller's host identity with another boot id: another machine that shares its hostname."""
    boot, ns = lock._host_id().split(" ")
    return f"{'0' * len(boot)} {ns}"


def test_take_writes_the_holder_and_release_removes_it(params: Params, head) -> None:
    held = lock.acquire(params, head, lock.me("run-a", "cluster.yaml"), params_file="cluster.yaml")
    written = json.loads((Path(_path(params)) / "holder.json").read_text())
    assert written["run_id"] == "run-a" and written["sparkbook_lock"] == 1
    assert set(written) >= {"host", "host_id", "pid", "pid_started", "user", "started"}
    assert written["host_id"] == lock._host_id() and lock._host_id().count(" ") == 1, "boot id and PID namespace"
    assert lock.read(head, _path(params)) == held.holder
    assert held.release()
    assert not Path(_path(params)).exists()
    assert not list(Path(_path(params)).parent.iterdir()), "no temporary directory is left behind"


def test_second_run_is_refused_naming_the_holder(params: Params, head, live_pid: int) -> None:
    lock.acquire(params, head, _holder("run-a", live_pid), params_file="cluster.yaml")
    with pytest.raises(lock.LockHeld) as refused:
        lock.acquire(params, head, lock.me("run-b", "cluster.yaml"), params_file="cluster.yaml", break_stale=True)
    text = str(refused.value)
    assert "run-a" in text and f"pid {live_pid}" in text and _path(params) in text and head.name in text
    assert "sparkbook unlock cluster.yaml" in text and not refused.value.stale
    assert lock.read(head, _path(params)).run_id == "run-a", "a refused run leaves the lock alone"


def test_lock_of_a_dead_process_here_is_taken_over_saying_so(params: Params, head) -> None:
    dead = _dead_pid()
    lock.acquire(params, head, _holder("run-a", dead), params_file="cluster.yaml")
    held = lock.acquire(params, head, lock.me("run-b", "cluster.yaml"), params_file="cluster.yaml")
    assert lock.read(head, _path(params)).run_id == "run-b"
    line = held.took_over_line()
    assert line and "took over the lock of run run-a" in line and f"pid {dead} is not running" in line, line
    held.release()
    fresh = lock.acquire(params, head, lock.me("run-c", "cluster.yaml"), params_file="cluster.yaml")
    assert fresh.took_over_line() is None, "a free lock is taken, not taken over"
    fresh.release()


@pytest.mark.parametrize("elsewhere", ["another boot, same hostname", "another PID namespace, same boot"])
def test_lock_of_a_dead_pid_on_another_host_still_refuses(params: Params, head, elsewhere: str) -> None:
    """A hostname does not tell where a PID can be checked: two machines, or containers, can share one."""
    here = lock._host_id()
    other = _other_boot() if elsewhere.startswith("another boot") else here.split(" ")[0] + " pid:[1]"
    planted = _holder("run-a", _dead_pid(), host_id=other)
    assert planted.host == lock.me("run-b", "x").host and lock.dead_here(planted) is None
    lock.acquire(params, head, planted, params_file="cluster.yaml")
    with pytest.raises(lock.LockHeld) as refused:
        lock.acquire(params, head, lock.me("run-b", "cluster.yaml"), params_file="cluster.yaml")
    assert "may still be going" in str(refused.value), "its PID cannot be checked from here"
    assert lock.read(head, _path(params)).run_id == "run-a"


def test_lock_older_than_the_limit_is_stale_even_from_another_host(params: Params, head, live_pid: int) -> None:
    old = (datetime.now(UTC) - timedelta(hours=2)).isoformat(timespec="seconds")
    lock.acquire(params, head, _holder("run-a", live_pid, host_id=_other_boot(), started=old), params_file="x")
    assert "more than run_lock.stale_after_s" in lock.staleness(lock.read(head, _path(params)), 3600)
    recent = _holder("run-a", live_pid, host_id=_other_boot())
    assert lock.staleness(recent, 3600) is None, "another host's recent lock may be live: never assumed stale"


def test_a_reused_pid_does_not_keep_a_lock_alive(params: Params, head, live_pid: int) -> None:
    """Same boot and PID namespace, the PID running but started at another time: the holder is gone."""
    holder = _holder("run-a", live_pid)
    assert lock.staleness(holder, 3600) is None
    reused = dataclasses.replace(holder, pid_started=1)
    assert "now another process" in lock.staleness(reused, 3600)
    lock.acquire(params, head, reused, params_file="x")
    held = lock.acquire(params, head, lock.me("run-b", "x"), params_file="x")
    assert f"pid {live_pid} on {holder.host} is now another process" in held.took_over_line()
    held.release()


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
    assert lock.read(head, _path(params)).run_id == "run-b"


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
    assert lock.read(head, _path(params)) is None
    assert not list(Path(_path(params)).parent.iterdir()), "the lock removed, and nothing left of it"


def lock_exit() -> int:
    from sparkbook.cli.exits import EXIT_LOCKED
    return EXIT_LOCKED


def test_interrupted_run_releases_the_lock(params: Params, tmp_path: Path) -> None:
    """Ctrl-C while a notebook runs (here: in the runner's progress callback) still removes the lock."""
    params_file = next(tmp_path.glob("*.yaml"))
    seen: list[bool] = []

    def interrupt(line: str) -> None:
        if line.startswith("[1/"):
            seen.append(Path(_path(params)).is_dir())
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        driver.execute(params_file, RunOptions(out_root=tmp_path / "out"), say=interrupt)
    assert seen == [True], "the lock is held while notebooks run"
    assert not Path(_path(params)).exists()


def _plant(path: Path, what: str) -> None:
    """Something at the lock path that sparkbook did not make (or no longer wholly made)."""
    marked = json.dumps({"sparkbook_lock": 1, **dataclasses.asdict(_holder("run-a", _dead_pid()))})
    if what == "a file":
        path.parent.mkdir(parents=True)
        path.write_text("data\n")
        return
    if what == "a link to a lock":
        (path.parent.parent / "elsewhere").mkdir(parents=True)
        (path.parent.parent / "elsewhere" / "holder.json").write_text(marked)
        path.parent.mkdir(parents=True)
        path.symlink_to(path.parent.parent / "elsewhere")
        return
    path.mkdir(parents=True)
    if what == "data, no holder.json":
        (path / "results.db").write_text("a week of results\n")
        (path / "sub").mkdir()
        (path / "sub" / "notes.txt").write_text("notes\n")
    elif what == "a holder.json without the marker":
        (path / "holder.json").write_text(json.dumps(dataclasses.asdict(_holder("run-a", _dead_pid()))))
    elif what == "a holder.json that is no JSON":
        (path / "holder.json").write_text("{not json")
    elif what == "a sparkbook holder.json and data":
        (path / "holder.json").write_text(marked)
        (path / "results.db").write_text("a week of results\n")
    elif what == "a holder.json linking elsewhere":
        (path.parent / "target.json").write_text(marked)
        (path / "holder.json").symlink_to(path.parent / "target.json")


def _tree(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): p.read_text() if p.is_file() else "" for p in sorted(root.rglob("*"))}


PLANTED = ["data, no holder.json", "a holder.json without the marker", "a holder.json that is no JSON",
           "a sparkbook holder.json and data", "a holder.json linking elsewhere", "an empty directory", "a file",
           "a link to a lock"]


@pytest.mark.parametrize("what", PLANTED)
def test_what_sparkbook_did_not_make_is_refused_and_never_removed(what: str, params: Params, head,
                                                                  tmp_path: Path) -> None:
    """The issue's case: run_lock.path naming a directory that holds data; unlock, break-lock and a run's take-over
    all refuse it, naming the path, and leave every file as it was."""
    path = Path(_path(params))
    _plant(path, what)
    before = _tree(tmp_path)
    attempts: list[Callable[[], object]] = [
        lambda: lock.unlock(params, head, force=True),
        lambda: lock.acquire(params, head, lock.me("run-b", "x"), params_file="x", break_stale=True),
        lambda: lock.acquire(params, head, lock.me("run-a", "x"), params_file="x", same_run="run-a"),
        lambda: lock.read(head, str(path)),
    ]
    for attempt in attempts:
        with pytest.raises(lock.LockError) as refused:
            attempt()
        text = str(refused.value)
        assert not isinstance(refused.value, lock.LockHeld), text
        assert f"{path} on {head.name}" in text and "is not a run lock sparkbook made" in text, text
        assert "remove it by hand" in text and "\n" not in text, text
    assert _tree(tmp_path) == before, "nothing was removed or changed"


def test_cli_unlock_refuses_a_directory_of_data(params: Params, tmp_path: Path) -> None:
    path = Path(_path(params))
    _plant(path, "data, no holder.json")
    params_file = next(tmp_path.glob("*.yaml"))
    done = subprocess.run([sys.executable, "-m", "sparkbook.cli", "unlock", str(params_file)], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == lock_exit() and done.stderr.count("\n") == 1, done.stdout + done.stderr
    assert f"{path} on a" in done.stderr and "it holds results.db, sub, not holder.json alone" in done.stderr
    assert "remove it by hand" in done.stderr and "removed the lock" not in done.stdout
    assert (path / "results.db").read_text() == "a week of results\n" and (path / "sub" / "notes.txt").is_file()


def test_a_lock_that_changed_since_it_was_read_is_not_removed(params: Params, head, live_pid: int) -> None:
    lock.acquire(params, head, _holder("run-a", live_pid), params_file="x")
    assert not lock._remove(head, _path(params), json.dumps({"sparkbook_lock": 1, "run_id": "run-old"}))
    assert lock.read(head, _path(params)).run_id == "run-a"


@pytest.mark.parametrize("root", ["/", "/tmp", "/tmp/", "//tmp", "/run", "/run/lock", "/var", "/var/tmp", "/home",
                                  "/root", "/etc", "/usr", "/usr/local", "/dev/shm", "/srv/x/..", "srv/sparkbook"])
def test_schema_refuses_a_system_directory_as_a_state_dir(root: str, base: dict[str, Any],
                                                          write_params: Callable[..., Path]) -> None:
    base["nodes"][0]["state_dir"] = root
    with pytest.raises(ParamsError) as refused:
        load_params(write_params(base))
    problems = [p for p in refused.value.problems if p.field.startswith("nodes")]
    assert [p.field for p in problems] == ["nodes[0].state_dir"], problems
    assert problems[0].line is not None, "the line of state_dir is named"


def test_schema_refuses_the_old_lock_paths(base: dict[str, Any], write_params: Callable[..., Path]) -> None:
    """The lock lives in the head's state dir alone: a params file still naming run_lock.path is refused, not read."""
    base["run_lock"] = {"path": "/tmp/sparkbook/run.lock"}
    with pytest.raises(ParamsError) as refused:
        load_params(write_params(base))
    assert [p.field for p in refused.value.problems] == ["run_lock.path"]


def test_the_lock_lies_in_the_heads_state_dir(params: Params, head) -> None:  # type: ignore[no-untyped-def]
    with lock.held(params, head, lock.me("run-a", "cluster.yaml"), params_file="cluster.yaml", say=print):
        assert (Path(_path(params)) / "holder.json").is_file()
        assert oct(Path(_path(params)).parent.stat().st_mode & 0o777) == "0o700", "the state dir is made 0700"
