"""The run lock on the lab's head: a second `sparkbook run` refuses while a first one runs; a run killed with
SIGKILL leaves a lock whose PID is gone on this controller, which the next run takes over saying so, and which
`sparkbook unlock` clears."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sparkbook.core.cluster.nodestate import DEFAULT_ROOT, LOCK
from sparkbook.core.values.params import load_params

pytestmark = pytest.mark.lab
CLI = [sys.executable, "-m", "sparkbook.cli"]


@pytest.fixture(scope="module")
def params_file(lab) -> Path:
    import sparkbook.lab as sblab
    return sblab.params_file(2)


@pytest.fixture(scope="module")
def head(params_file: Path, node_shells):
    shell = node_shells[load_params(params_file).head.name]
    assert _holder(shell, params_file) is None, "the lab's head holds a run lock from before: sparkbook unlock it"
    return shell


def _holder(head, params_file: Path) -> dict | None:
    head_name = load_params(params_file).head.name  # its state dir: the SSH user's (root's) ~/.sparkbook/NODE
    rc, out, _ = head.run(["cat", f"/root/{DEFAULT_ROOT}/{head_name}/{LOCK}/holder.json"], check=False)
    return json.loads(out) if rc == 0 else None


def _start(params_file: Path, outputs: Path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen([*CLI, "run", str(params_file), "--only", "01", "--outputs", str(outputs), *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _sparkbook(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=300)


def _wait_running(proc: subprocess.Popen, head, params_file: Path, outputs: Path, timeout: float = 120) -> dict:
    """Until the run holds the lock and its manifest says 01 is running; the holder."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        assert proc.poll() is None, proc.communicate()
        holder = _holder(head, params_file)
        manifests = list(outputs.glob("*/*/manifest.json"))
        if holder and manifests and '"running"' in manifests[0].read_text():
            return holder
        time.sleep(0.3)
    raise AssertionError("the first run did not take the lock")


def test_second_run_refuses_while_the_first_holds_the_lock(params_file: Path, head, tmp_path: Path) -> None:
    first = _start(params_file, tmp_path / "first")
    holder = _wait_running(first, head, params_file, tmp_path / "first")
    assert holder["pid"] == first.pid and {"run_id", "host", "user", "started"} <= set(holder)
    os.kill(first.pid, signal.SIGSTOP)  # holds the lock however long the second run takes to start on a loaded machine
    try:
        t0 = time.monotonic()
        second = _sparkbook("run", str(params_file), "--only", "02", "--outputs", str(tmp_path / "second"))
        print(f"second run refused in {time.monotonic() - t0:.1f} s: {second.stderr.strip()}")
    finally:
        os.kill(first.pid, signal.SIGCONT)
    assert second.returncode == 3, second.stdout + second.stderr
    for text in (f"locked by run {holder['run_id']}", f"pid {first.pid}", "sparkbook unlock", "may still be going"):
        assert text in second.stderr
    assert not (tmp_path / "second").exists()
    out, err = first.communicate(timeout=300)
    assert first.returncode == 0, out + err
    assert _holder(head, params_file) is None, "released at the end of the first run"


def test_killed_run_is_taken_over_by_the_next_and_unlock_clears(params_file: Path, head, tmp_path: Path) -> None:
    first = _start(params_file, tmp_path / "out")
    holder = _wait_running(first, head, params_file, tmp_path / "out")
    os.kill(first.pid, signal.SIGKILL)
    first.communicate(timeout=60)
    assert _holder(head, params_file) == holder, "a SIGKILLed run cannot release: the lock stays"

    other = _sparkbook("run", str(params_file), "--only", "01", "--outputs", str(tmp_path / "other"))
    assert other.returncode == 0, other.stdout + other.stderr
    assert f"took over the lock of run {holder['run_id']}" in other.stdout, other.stdout
    assert f"pid {first.pid} is not running" in other.stdout
    assert _holder(head, params_file) is None, "the run that took the dead lock over released it"

    again = _start(params_file, tmp_path / "again")
    _wait_running(again, head, params_file, tmp_path / "again")
    os.kill(again.pid, signal.SIGKILL)
    again.communicate(timeout=60)
    cleared = _sparkbook("unlock", str(params_file))
    assert cleared.returncode == 0 and "removed the lock" in cleared.stdout and "stale" in cleared.stdout, \
        cleared.stdout + cleared.stderr
    assert _holder(head, params_file) is None
