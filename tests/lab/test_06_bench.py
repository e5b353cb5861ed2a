"""06-benchmark against a real vLLM (the lab's 0.32 CPU image, hyv4-tiny), checked against `vllm bench serve`.

The test starts its own server container on the builder daemon (removed at the end), puts the endpoint and the
model facts into a run dir's state.json as 05 and 02 would, runs a 2-engine sweep into a sibling "earlier" run,
executes the notebook headless between `vllm bench serve` runs at concurrency 1 and 8 with the same lengths and
sampling in the same image, then alternates sparkbook's sweep and the reference EXTRA_ROUNDS more times, and requires
the medians over those runs to agree within 5% on output tok/s and median TTFT and TPOT, or, where this shared
machine's noise is larger (each client's own runs span 10-40% here), one client's median to lie within the range of
the other's runs. The server runs on one core, both clients on the other; the prompts are 32 per point (the lab's 16
make a c=8 point two waves, too short). On a machine whose speed holds still (tests/gpu/client_agreement.sh, one H200)
the medians agreed within 3.7% on every metric.
"""
from __future__ import annotations

import importlib.util
import json
import os
import statistics
import subprocess
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from sparkbook import open_run
from sparkbook.core.values.handoff import BenchmarkSummary, Endpoint
from sparkbook.core.values.modelinfo import ModelFacts, model_facts
from sparkbook.core.values.sweeppoint import SweepPoint, read_points, write_point
from sparkbook.lab.builder import docker_cmd, ensure_builder
from sparkbook.stages.bench import sweep as bench
from sparkbook.stages.bench.client import CompletionsServer
from sparkbook.stages.bench.tables import client_rows

pytestmark = pytest.mark.lab

IMAGE = "sparkbook-lab/vllm-cpu:0.32.0"
MODELS = Path("/var/lib/sparkbook-lab/models")
MODEL = "hyv4-tiny"
PORT = 18601
SERVER, REFERENCE = "sbk-bench-test", "sbk-bench-test-ref"
REPO = Path(__file__).resolve().parents[2]
AGREE = ("output_throughput", "median_ttft_ms", "median_tpot_ms")
_PAIR = importlib.util.spec_from_file_location("bench_pair", REPO / "tests" / "gpu" / "bench_pair.py")
assert _PAIR and _PAIR.loader
bench_pair = importlib.util.module_from_spec(_PAIR)
_PAIR.loader.exec_module(bench_pair)  # its vllm_bench_argv: the one reference command for the lab and the GPU


@dataclass(frozen=True)
class Agreement:
    """Our median next to `vllm bench serve`'s for one metric at one concurrency."""

    max_concurrency: int
    metric: str
    ours: float
    reference: float
    diff_pct: float
    within: bool


def agreement(ours: SweepPoint, reference: SweepPoint, metrics: tuple[str, ...],
              tolerance_pct: float = 5.0) -> list[Agreement]:
    rows = []
    for metric in metrics:
        a, b = ours.figure(metric), reference.figure(metric)
        assert a is not None and b is not None, f"{metric} is missing from {'ours' if a is None else 'the reference'}"
        diff = 100.0 * (a - b) / b
        rows.append(Agreement(ours.max_concurrency, metric, a, b, diff, abs(diff) <= tolerance_pct))
    return rows
# Server and clients on separate cores: on a 2-core machine a client's own CPU otherwise comes out of the server's
# (measured: `vllm bench serve`'s client slowed single-stream decode 12-40 % against sparkbook's, unpinned).
SERVER_CPU, CLIENT_CPU = "0", "1"
NUM_PROMPTS = 32
EXTRA_ROUNDS = 2


def docker(*args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess[str]:
    ensure_builder()
    return subprocess.run(docker_cmd(*args), capture_output=True, text=True, timeout=timeout, check=check)


def healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=3) as resp:
            return resp.status == 200
    except OSError:
        return False


@pytest.fixture(scope="module")
def server():
    if docker("images", "-q", IMAGE, check=False).stdout.strip() == "" or not (MODELS / MODEL).is_dir():
        pytest.skip(f"needs {IMAGE} and {MODELS / MODEL} (sparkbook.lab images/models)")
    url = f"http://127.0.0.1:{PORT}"
    docker("rm", "-f", SERVER, check=False)
    try:
        docker("run", "-d", "--name", SERVER, "--network", "host", "--shm-size", "1g", "-v", f"{MODELS}:/models:ro",
               "-e", "HF_HUB_OFFLINE=1", "-e", "VLLM_NO_USAGE_STATS=1", "-e", "VLLM_CPU_NUM_OF_RESERVED_CPU=0",
               "--cpuset-cpus", SERVER_CPU, "-e", f"VLLM_CPU_OMP_THREADS_BIND={SERVER_CPU}",
               IMAGE, "vllm", "serve", f"/models/{MODEL}", "--served-model-name", MODEL, "--host", "127.0.0.1",
               "--port", str(PORT), "--dtype", "float32", "--enforce-eager", "--max-model-len", "2048",
               "--kv-cache-memory-bytes", "128M", "--max-num-seqs", "16", "--model-impl", "vllm",
               "--attention-backend", "CPU_MLA")
        deadline = time.monotonic() + 600
        while not healthy(url):
            running = docker("inspect", "-f", "{{.State.Running}}", SERVER, check=False).stdout.strip()
            assert running == "true" and time.monotonic() < deadline, docker("logs", "--tail", "40", SERVER).stderr
            time.sleep(5)
        yield CompletionsServer(url, MODEL)
    finally:
        docker("rm", "-f", SERVER, check=False)


@pytest.fixture
def client_core():
    """This process, and what it starts (the notebook's kernel, the engines), on the client core; restored after."""
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {int(CLIENT_CPU)})
    yield
    os.sched_setaffinity(0, before)


def model_state() -> ModelFacts:
    """What 02 records, from the real config.json and weight file sizes."""
    folder = MODELS / MODEL
    config = json.loads((folder / "config.json").read_text())
    sizes = [p.stat().st_size for p in folder.glob("*.safetensors")]
    return model_facts(config, None, sizes, f"/models/{MODEL}")


def vllm_bench(target: CompletionsServer, plan, concurrency: int, out: Path, tag: str = "") -> dict:
    name = f"vllm-c{concurrency}{tag}.json"
    argv = bench_pair.vllm_bench_argv(target, plan, concurrency, f"/models/{MODEL}", "/results", name)
    try:
        docker("run", "--rm", "--name", REFERENCE, "--network", "host", "-v", f"{MODELS}:/models:ro",
               "-v", f"{out}:/results", "-e", "HF_HUB_OFFLINE=1", "--cpuset-cpus", CLIENT_CPU, IMAGE, *argv,
               timeout=600)
    finally:
        docker("rm", "-f", REFERENCE, check=False)
    return json.loads((out / name).read_text())


def median_of(runs: list[dict]) -> dict:
    """Several runs' results at one concurrency as one: the median of each compared metric."""
    return {**runs[0], **{k: statistics.median(r[k] for r in runs) for k in AGREE}}


@pytest.mark.benchmark
def test_notebook_agrees_with_vllm_bench_serve(server: CompletionsServer, client_core: None, tmp_path: Path):
    import papermill

    outputs = tmp_path / "outputs" / "lab"
    run_dir, earlier_dir = outputs / "20261130T120000Z", outputs / "20261130T110000Z"
    params = tmp_path / "lab-bench.yaml"
    data = yaml.safe_load((REPO / "params" / "lab.yaml").read_text())
    data["benchmark"]["num_prompts"] = NUM_PROMPTS
    params.write_text(yaml.safe_dump(data))
    run = open_run(params, run_dir, stage="test")
    run.remember(Endpoint(base_url=server.base_url, model=server.model, executor="uni", commands={}, env={}, logs={},
                          ready_s=0.0, attempts=0, reused=False))  # the test's own server, not one 05 started
    run.remember(model_state())

    # two load generators (ipyparallel engines) at concurrency 8: the "earlier run" the notebook compares with
    plan2 = run.params.benchmark.model_copy(update={"clients": 2, "concurrency": [8]})
    two = bench.run_sweep(server, plan2)
    for point in bench.saved_points(two, server, plan2, 2):  # as the session keeps them (run.keep_sweep)
        write_point(earlier_dir, point)
    assert two[0].result.completed == plan2.num_prompts and len(two[0].clients) == 2
    assert all(c.agrees for c in two[0].cross_checks), two[0].cross_checks

    # `vllm bench serve` at 1 and 8 before the notebook and after it, then more interleaved pairs of sparkbook's
    # sweep (the functions the notebook calls) and the reference: on this shared machine the same client, run
    # back to back, varies by +-15% within a minute, so medians over interleaved runs are what can agree
    plan = run.params.benchmark
    refs: dict[int, list[dict]] = {1: [], 8: []}
    ours: dict[int, list[dict]] = {1: [], 8: []}

    def reference_round(tag: str) -> None:
        for c in (1, 8):
            refs[c].append(vllm_bench(server, plan, c, tmp_path, f"-{tag}"))

    reference_round("before")
    os.environ["SPARKBOOK_HEADLESS"] = "1"
    papermill.execute_notebook(str(REPO / "notebooks" / "06-benchmark.ipynb"), str(run_dir / "06-benchmark.ipynb"),
                               parameters={"params_file": str(params), "run_dir": str(run_dir)},
                               cwd=str(REPO / "notebooks"), kernel_name="python3", progress_bar=False,
                               execution_timeout=900)
    reference_round("after")
    for i in range(EXTRA_ROUNDS):
        for point in bench.run_sweep(server, plan.model_copy(update={"concurrency": [1, 8]})):
            ours[point.result.max_concurrency].append(point.result.to_json())
        reference_round(f"round{i}")

    points = read_points(run_dir)
    results = [p.to_json() for p in points]
    assert [r["max_concurrency"] for r in results] == run.params.benchmark.concurrency
    for r in results:
        assert r["completed"] == run.params.benchmark.num_prompts and r["failed"] == 0
        assert set(r["input_lens"]) == {run.params.benchmark.input_len}
        assert set(r["output_lens"]) == {run.params.benchmark.output_len}
        assert all(c["agrees"] for c in r["sparkbook"]["server_cross_check"]), r["sparkbook"]["server_cross_check"]
    assert (run_dir / "bench" / "throughput.png").stat().st_size > 10_000
    assert (run_dir / "bench" / "latency.png").stat().st_size > 10_000
    summary = run.recall(BenchmarkSummary)
    assert summary.compared_with == str(earlier_dir) and summary.roofline_ceiling_tok_s > 0

    for c in (1, 8):
        ours[c].insert(0, bench.at_concurrency(points, c).to_json())
    rows = [row for c in (1, 8) for row in agreement(SweepPoint.model_validate(median_of(ours[c])),
                                                     SweepPoint.model_validate(median_of(refs[c])), AGREE)]
    report = [r.__dict__ | {"sparkbook_runs": [x[r.metric] for x in ours[r.max_concurrency]],
                            "vllm_bench_runs": [x[r.metric] for x in refs[r.max_concurrency]]} for r in rows]
    for r in report:
        r["within_noise"] = (min(r["vllm_bench_runs"]) <= r["ours"] <= max(r["vllm_bench_runs"])
                             or min(r["sparkbook_runs"]) <= r["reference"] <= max(r["sparkbook_runs"]))
    (tmp_path / "agreement.json").write_text(json.dumps(report, indent=1))
    one_engine = json.loads((run_dir / "bench" / "c0008.json").read_text())["sparkbook"]["client_load"]
    print(json.dumps({"summary": summary, "two_engines": client_rows(two), "one_engine": one_engine},
                     indent=1, default=str))
    print("| C | metric | sparkbook median | vllm bench median | diff % | within 5% | sparkbook runs "
          "| vllm bench runs |\n|---|---|---|---|---|---|---|---|")
    for r in report:
        runs = [", ".join(f"{x:.1f}" for x in r[key]) for key in ("sparkbook_runs", "vllm_bench_runs")]
        print(f"| {r['max_concurrency']} | {r['metric']} | {r['ours']:.2f} | {r['reference']:.2f} "
              f"| {r['diff_pct']:+.1f} | {'yes' if r['within'] else 'no'} | {runs[0]} | {runs[1]} |")
    # each client disagrees with itself here by more than 5% from run to run (the runs are printed): a median outside
    # 5% still agrees when one client's median lies within the range of the other's runs (indistinguishable here)
    assert all(r["within"] or r["within_noise"] for r in report), report
