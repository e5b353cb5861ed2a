"""`sparkbook watch` against the lab (issue 41, item 4): the vLLM engine of the session's full run killed inside the
head's container while the watch runs (by PID, found in the container's /proc); the watch names the cause from the
server's log in 05's classifier's words, brings the deployment back through `up` (04 and 05 under the run lock), and
records every event in the cluster's watch.jsonl. The watch runs on a copy of the full run's dir (and the cluster's
quality/ beside it) in an outputs root of its own, as test_idempotence runs on copies: its `up` makes a new run that
root's deployment, while the full run stays the deployment of its own outputs (test_runbook_lab's operator commands
and restore read it there). It adds the one restart to the session (1-3 min) and leaves the full run's plan serving
for the tests after it, so this file sorts before test_runbook_lab."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from runcopy import outputs_copy

from sparkbook.core.cluster.topology import container_name
from sparkbook.core.values.params import load_params
from sparkbook.records import watchlog
from sparkbook.runbook import operate, watch
from sparkbook.runbook.manifest import Manifest

pytestmark = pytest.mark.lab
BACK_S = 900  # the kill to an answer again: two checks, the cause, `up`'s 04 and 05 (2-4 min; 8 on a 2-core machine
# shared with other labs)
# every process of the container: PID, comm and command line (the engine core is a child of `vllm serve`)
PROCESSES = r'for p in /proc/[0-9]*; do printf "%s\t%s\t%s\n" "${p#/proc/}" "$(cat $p/comm)" "$(tr "\0" " " <$p/cmdline)"; ' \
            r'done 2>/dev/null'


def _engine_pid(shell, container: str) -> tuple[int, str]:  # type: ignore[no-untyped-def]
    """The vLLM engine core's PID in the container, found by its process title in /proc (never killed by name)."""
    _, out, _ = shell.run(["docker", "exec", container, "sh", "-c", PROCESSES], timeout=60)
    rows = [line.split("\t") for line in out.splitlines() if line.count("\t") == 2]
    engines = [(int(pid), f"{comm} {cmd}".strip()) for pid, comm, cmd in rows if "EngineCore" in comm + cmd]
    assert engines, f"no EngineCore process in {container}:\n{out}"
    return engines[0]


def _events(record_dir: Path, since: int) -> list[watchlog.WatchEvent]:
    return watchlog.read(record_dir)[since:]


def test_watch_brings_a_killed_engine_back_and_records_the_cause(full_run: tuple[Path, Manifest], node_shells,  # type: ignore[no-untyped-def]
                                                                 planted: str, tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_API_KEY", planted)  # as the full run had them: the checks send the key, `up`'s 05 too
    monkeypatch.setenv("HF_TOKEN", planted)
    run_dir, manifest = full_run
    outputs = tmp_path / "outputs"  # a copy: the watch's `up` leaves the full run its own outputs' deployment
    outputs_copy(run_dir, outputs)
    data = yaml.safe_load(Path(manifest.params_file).read_text())
    data["watch"] = {"interval_s": 3, "check_timeout_s": 30, "failures_to_restart": 2, "max_restarts": 2,
                     "backoff_s": 5, "backoff_max_s": 5}
    params_file = tmp_path / "lab-hf-watch.yaml"
    params_file.write_text(yaml.safe_dump(data, sort_keys=False))
    params = load_params(params_file)
    before = operate.last_good(params, outputs)
    assert watch.check(before, 30) is None, "the full run's deployment serves before the watch starts"
    cluster_dir = outputs / params.cluster
    seen = len(watchlog.read(cluster_dir))

    log = (tmp_path / "watch.out").open("w")
    proc = subprocess.Popen([str(Path(sys.executable).parent / "sparkbook"), "watch", str(params_file), "--outputs",
                             str(outputs), "--for", "1200"], stdout=log, stderr=subprocess.STDOUT, env=os.environ.copy())
    try:
        end = time.monotonic() + 60
        while not _events(cluster_dir, seen) and proc.poll() is None and time.monotonic() < end:
            time.sleep(0.5)
        time.sleep(2 * 3)  # two checks answered: the watch knows the deployment served
        pid, what = _engine_pid(node_shells["lab-0"], container_name(params, "lab-0"))
        node_shells["lab-0"].run(["docker", "exec", container_name(params, "lab-0"), "sh", "-c", 'kill -KILL "$0"',
                                  str(pid)])
        killed = time.monotonic()
        print(f"killed pid {pid} in lab-0's container: {what[:200]}")
        while not any(e.kind in ("back", "gave_up") for e in _events(cluster_dir, seen)):
            assert proc.poll() is None, f"the watch exited {proc.returncode}: {(tmp_path / 'watch.out').read_text()}"
            assert time.monotonic() - killed < BACK_S, f"not back in {BACK_S} s: {_events(cluster_dir, seen)}"
            time.sleep(2)
        back_s = time.monotonic() - killed
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(120)
        log.close()
    out = (tmp_path / "watch.out").read_text()
    print(out[-6000:], file=sys.stderr)
    print(f"the kill to an answer again: {back_s:.0f} s")
    assert code == 0 and "Traceback" not in out, out[-3000:]

    events = _events(cluster_dir, seen)
    kinds = [e.kind for e in events]
    assert kinds == ["started", "check_failed", "cause", "restart", "back", "ended"], kinds
    cause, restart, back = events[2], events[3], events[4]
    assert cause.run == before.run_id and cause.node == "lab-0", cause
    assert cause.cause == "worker died" and cause.remediation, cause
    assert "engine core exited unexpectedly" in (cause.evidence or ""), "the line vLLM logs as its engine dies"
    assert restart.restart == 1 and restart.wait_s == 0, "the first restart follows the confirmed failure at once"
    assert back.up_run and back.run == back.up_run and back.seconds_without_service, back
    assert 0 < back.seconds_without_service < back_s + 10
    assert "SIGTERM" in events[5].text

    up_run = outputs / params.cluster / back.up_run
    statuses = {nb.name[:2]: nb.status for nb in Manifest.read(up_run).notebooks}
    assert statuses["04"] == statuses["05"] == "ok" and statuses["01"] == "skipped", statuses
    after = operate.last_good(params, outputs)
    assert after.run_id == back.up_run and after.plan_hash == before.plan_hash
    assert watch.check(after, 30) is None, "left serving for the tests after this one"
    record = watchlog.path(cluster_dir).read_text()
    assert planted not in record and planted not in out
    assert "worker died" in (cluster_dir / "index.html").read_text(), "the cluster's page shows the watch"
    assert operate.deployments(run_dir.parent)[0].run_dir == run_dir, "the full run is still its outputs' deployment"
