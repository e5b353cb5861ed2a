"""06's soak on the lab (issue 41): a planted engine death mid-soak is named with its node and time and the run fails
at 06. The session's `full_run` serves; 06 runs again on it (seeded from that run, start 06) with a one-point sweep and
a 60 s soak at long context, and once the soak's requests are in flight the vLLM engine core in the head's container
is killed by its PID (read from /proc). Afterwards `sparkbook up` brings the same plan back, run on a copy of the full
run's dir (and the cluster's quality/ beside it) in an outputs root of its own, as test_idempotence runs on copies: the
full run stays the deployment of its own outputs (test_runbook_lab's operator commands and restore read it there)
while its plan serves again for the tests after this one. A soak that holds is what params/spark-duo.yaml runs (20
minutes); its pure rules are unit-tested. Named to sort after test_cluster (which takes the lab down and up, removing a
full run made before it) and test_idempotence (which reads the full run's server as that run left it), and before
test_runbook_lab (whose restore --stop-new ends that server)."""
from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import httpx
import pytest
import yaml
from runcopy import outputs_copy

from sparkbook.core.cluster import topology
from sparkbook.core.values.params import load_params
from sparkbook.core.values.stagelist import BENCH
from sparkbook.runbook import driver, operate
from sparkbook.runbook.driver import RunOptions

pytestmark = pytest.mark.lab
SOAK = {"concurrency": [1], "num_prompts": 2, "warmup_requests": 0, "soak_s": 60, "soak_concurrency": 2,
        "soak_context": 1024, "soak_output_len": 32, "soak_sample_s": 2}
# the engine core's PID by its process title (vLLM's setproctitle), then SIGKILL: an engine dying under load
# (its own sh is skipped: its command line holds this text, and /proc's PIDs come in text order, not number order)
KILL_ENGINE = ('for p in /proc/[0-9]*; do [ "${p#/proc/}" = "$$" ] && continue; '
               'case "$(tr "\\0" " " <$p/cmdline 2>/dev/null)" in *EngineCore*) '
               'kill -KILL "${p#/proc/}" && echo "${p#/proc/}" && exit 0;; esac; done; '
               'ps -eo pid,args 2>/dev/null || ls /proc; exit 1')


def _secrets(planted: str) -> None:
    os.environ["HF_TOKEN"] = os.environ["VLLM_API_KEY"] = planted


def _running(base_url: str) -> float:
    try:
        page = httpx.get(base_url.rstrip("/") + "/metrics", timeout=5).text
    except httpx.HTTPError:
        return 0.0
    return sum(float(line.rsplit(" ", 1)[1]) for line in page.splitlines()
               if line.startswith("vllm:num_requests_running"))


def _kill_mid_soak(outputs: Path, base_url: str, shell, container: str, killed: dict,  # type: ignore[no-untyped-def]
                   done: threading.Event) -> None:
    """Once the sweep's point is saved and both soak streams are in flight, a few samples in: the engine core dies.
    Never once 06 has ended (`done`): a late kill would take down the deployment `up` brought back for later tests."""
    deadline = time.monotonic() + 900
    while not list(outputs.glob(f"*/*/{'bench'}/c0001.json")) and time.monotonic() < deadline and not done.is_set():
        time.sleep(0.5)
    while _running(base_url) < SOAK["soak_concurrency"] and time.monotonic() < deadline and not done.is_set():
        time.sleep(0.3)
    time.sleep(3 * SOAK["soak_sample_s"])
    if done.is_set():
        return
    killed["at"] = time.time()
    killed["result"] = shell.run(["docker", "exec", container, "sh", "-c", KILL_ENGINE], timeout=60, check=False)


@pytest.fixture(scope="module")
def soak_run(full_run, planted, node_shells, tmp_path_factory):
    first_dir, first = full_run
    data = yaml.safe_load(Path(first.params_file).read_text())
    data["benchmark"].update(SOAK)
    params = tmp_path_factory.mktemp("soak-params") / "lab.yaml"
    params.write_text(yaml.safe_dump(data, sort_keys=False))
    base_url = json.loads((first_dir / "state.json").read_text())["endpoint"]["base_url"]
    head = load_params(params).head.name
    container = topology.places(load_params(params), "")[head].name
    outputs, killed, done = tmp_path_factory.mktemp("soak-outputs"), {}, threading.Event()
    killer = threading.Thread(target=_kill_mid_soak, daemon=True,
                              args=(outputs, base_url, node_shells[head], container, killed, done))
    _secrets(planted)
    t0 = time.monotonic()
    try:
        killer.start()
        run_dir, manifest = driver.execute(params, RunOptions(out_root=outputs, seed=first_dir, start=BENCH.id),
                                           say=print)
        done.set()
        killer.join(timeout=60)
        took = time.monotonic() - t0
        up_root = tmp_path_factory.mktemp("soak-up")  # `up` on a copy: the full run stays its outputs' deployment
        outputs_copy(first_dir, up_root)
        t1 = time.monotonic()
        _, back, _ = operate.up(Path(first.params_file), up_root, say=print)
        print(f"soak run {took:.0f} s; up {time.monotonic() - t1:.0f} s")
    finally:
        del os.environ["HF_TOKEN"], os.environ["VLLM_API_KEY"]
    assert all(nb.status == "ok" for nb in back.notebooks if not nb.status.startswith("skipped")), back
    assert operate.deployments(first_dir.parent)[0].run_dir == first_dir, "the full run is still its outputs' deployment"
    return run_dir, manifest, killed, head


def test_a_planted_engine_death_mid_soak_is_named_with_its_node_and_time_and_fails_06(soak_run) -> None:
    run_dir, manifest, killed, head = soak_run
    assert killed.get("result") and killed["result"][0] == 0, f"no engine core to kill: {killed}"
    bench = next(nb for nb in manifest.notebooks if BENCH.owns(nb.name))
    assert manifest.status == "failed" and bench.status == "failed", manifest
    error = f"{bench.exception}"
    assert "soak failed: engine dead on " + head in error, error
    report = json.loads((run_dir / "state.json").read_text())["soak"]
    assert report["failed_rule"] == "engine dead" and report["failed_node"] == head
    found = time.mktime(time.strptime(report["failed_at"][:19], "%Y-%m-%dT%H:%M:%S")) - time.timezone
    assert killed["at"] - 3 <= found <= killed["at"] + 30, (report["failed_at"], killed["at"])
    assert report["ran_s"] < SOAK["soak_s"], "it ended early"
    assert report["lines"] and report["lines"][0].endswith("(last lines):"), report["lines"]
    series = json.loads((run_dir / "bench" / "soak.json").read_text())
    assert series["nodes"] and series["server"] and not series["server"][-1]["answered"]
    assert {s["node"] for s in series["nodes"]} == {"lab-0", "lab-1"}
    assert any("no GPUs listed" in n for s in series["nodes"] for n in s["notes"]), "the lab has no GPU: said so"
    page = (run_dir / "index.html").read_text()
    assert 'href="bench/soak.png"' in page and (run_dir / "bench" / "soak.png").stat().st_size > 10000
