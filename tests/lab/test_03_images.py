"""03-image-selection against the lab: the registry probe per candidate, and the streamed copy's throughput next to
a plain `ssh head docker save | ssh worker docker load`. The notebook itself is asserted on the session's full run
(test_idempotence: what it chose and copied, then that the second run copies nothing)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

import sparkbook
import sparkbook.lab as sblab
from sparkbook.core.cluster.imageprobes import probe_registry
from sparkbook.core.cluster.runtimes import image_source_for
from sparkbook.lab.imagebuild import NO_RAY
from sparkbook.stages.images import choice, distribute

pytestmark = pytest.mark.lab
OLD, GRAFT, NEW = ("sparkbook-lab/vllm-cpu:0.28.0", "sparkbook-lab/vllm-cpu:0.28.0-hyv4-graft",
                   "sparkbook-lab/vllm-cpu:0.32.0")
REPORT = Path(os.environ.get("SPARKBOOK_03_REPORT", "/tmp/sparkbook-03-report.json"))


def report(key: str, value: object) -> None:
    """Measurements for the hand-over (each probe's time, MB/s of both copies), printed and kept in a file."""
    data = json.loads(REPORT.read_text()) if REPORT.exists() else {}
    data[key] = value
    REPORT.write_text(json.dumps(data, indent=2))
    print(f"[03] {key}: {value}", file=sys.stderr)


@pytest.fixture
def run(lab, tmp_path):  # type: ignore[no-untyped-def]
    r = sparkbook.open_run(sblab.params_file(2), tmp_path / "run", stage="03-test")
    yield r
    r.close()


def test_registry_probe_tells_the_three_images_apart(run) -> None:  # type: ignore[no-untyped-def]
    arch = choice.model_target(run.context(), None).architecture
    probes = {ref: probe_registry(run.context(), ref, arch) for ref in (OLD, GRAFT, NEW)}
    report("registry_probe_s", {ref: p.duration_s for ref, p in probes.items()})
    assert not probes[OLD].registered and probes[OLD].n_architectures > 300
    assert probes[GRAFT].registered and probes[GRAFT].module == "vllm.models.hy_v4"
    assert probes[NEW].registered and probes[NEW].vllm_version.startswith("0.32.0")
    assert all(not p.error for p in probes.values())


def plain_pipe(ref: str, head: str, worker: str) -> float:
    """MB/s of `ssh head docker save REF | ssh worker docker load` (the measurement to match, not the product)."""
    ssh = ["ssh", "-F", str(sblab.cluster.ssh_config_file())]
    t0 = time.monotonic()
    save = subprocess.Popen([*ssh, head, "docker", "save", ref], stdout=subprocess.PIPE)
    load = subprocess.run([*ssh, worker, "docker", "load"], stdin=save.stdout, capture_output=True, timeout=900)
    save.stdout.close()  # type: ignore[union-attr]
    assert save.wait(timeout=60) == 0 and load.returncode == 0, load.stderr
    return time.monotonic() - t0


def rmi(worker: str, ref: str) -> None:
    subprocess.run(["ssh", "-F", str(sblab.cluster.ssh_config_file()), worker, "docker", "rmi", ref],
                   capture_output=True, timeout=120, check=True)


@pytest.mark.benchmark
def test_streamed_copy_matches_a_plain_pipe_on_an_image_the_worker_lacks(run) -> None:  # type: ignore[no-untyped-def]
    """The same image both ways, back to back (the grafted one: nothing else on the worker uses it)."""
    worker, image_info = run.cluster.workers[0], image_source_for(run.params).image
    assert image_info(worker, GRAFT) is None
    size = image_info(run.cluster.head, GRAFT)[1]
    try:
        seconds = plain_pipe(GRAFT, run.cluster.head.spec.host, worker.spec.host)
        rmi(worker.spec.host, GRAFT)
        copy = distribute.copy_image(run.context(), GRAFT, worker, size)
        assert not copy.error and image_info(worker, GRAFT)[0] == image_info(run.cluster.head, GRAFT)[0]
        plain_mb_s = copy.bytes / 1e6 / seconds
        report("copy_mb_s_graft", {"streamed": copy.mb_s, "plain ssh pipe": round(plain_mb_s, 1),
                                   "ratio": round(copy.mb_s / plain_mb_s, 2)})
        assert copy.mb_s >= 0.9 * plain_mb_s
    finally:
        subprocess.run(["ssh", "-F", str(sblab.cluster.ssh_config_file()), worker.spec.host, "docker", "rmi", GRAFT],
                       capture_output=True, timeout=120)


def test_lab_params_with_the_rayless_image_choose_the_one_with_ray(run) -> None:  # type: ignore[no-untyped-def]
    """Issue 45: params/lab.yaml (executor left out, 04 forms Ray) with the stock-shaped image among its candidates:
    both load the model with one vLLM, and 03 keeps the one with Ray, saying why the other lost; with
    serve.executor: ray the image without Ray is rejected before any copy, naming the remedy. The real probes of both
    images on the head, once; the verdicts under the two executors from the same probes."""
    ctx = run.context()
    target = choice.model_target(ctx, None)
    caps, machines = choice.compute_capabilities(ctx), choice.node_machines(ctx)
    t0 = time.monotonic()
    cands = [choice.evaluate(ctx, ref, target, caps, machines) for ref in (NO_RAY, NEW)]
    report("rayless_tie_probe_s", round(time.monotonic() - t0, 1))
    stock = cands[0]
    assert stock.facts.ray is None and stock.facts.native_multinode is True and stock.verdict.usable, stock.verdict
    picked = choice.choose(cands, [])
    assert picked.choice == NEW and "Ray" in picked.reason, picked
    lost = next(a for a in picked.alternatives if a.option == NO_RAY)
    assert "has no Ray" in lost.rejected_because, lost
    refused = choice.classify(stock.facts, stock.registry, stock.inspection, executor="ray", capabilities=caps,
                              machines=machines, multinode=True)
    assert not refused.usable and "serve.executor: mp" in refused.blocking[0], refused
