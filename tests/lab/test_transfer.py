"""03 moving what serving needs, on the lab (SPARKBOOK_LAB_ID aware: the params are sblab.params_file(2)).

The model: a worker without it (HF-cache layout) gets it from the head over the fabric; a copy killed mid-way
(kill -9 of its rsync, by the PID it wrote) leaves nothing where vLLM loads and resumes without re-sending
finished files; a disk too small is refused before anything is sent. The image: only the layers the worker lacks
are sent (0.28.0 -> the graft, which shares its layers). The policy: keep_installed keeps 0.28.0 where it serves
the model (qwen3-tiny) and is on every node. Benchmarks: model copy vs plain `rsync --whole-file`; image delta vs
whole stream.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

import sparkbook
import sparkbook.lab as sblab
from sparkbook.core.cluster.nodestate import ensure
from sparkbook.core.cluster.runtimes import image_source_for
from sparkbook.lab.models import hf_cache
from sparkbook.stages.diagnose import checks
from sparkbook.stages.images import choice, distribute, modelcopy

pytestmark = pytest.mark.lab
REPO = Path(__file__).resolve().parents[2]
OLD, GRAFT = "sparkbook-lab/vllm-cpu:0.28.0", "sparkbook-lab/vllm-cpu:0.28.0-hyv4-graft"
HF_REPO = "models--sparkbook-lab--hyv4-tiny"
BULK_ID, BULK_REPO = "sparkbook-lab/bulk-test", "models--sparkbook-lab--bulk-test"
REPORT = Path(os.environ.get("SPARKBOOK_TRANSFER_REPORT", "/tmp/sparkbook-transfer-report.json"))


def report(key: str, value: object) -> None:
    data = json.loads(REPORT.read_text()) if REPORT.exists() else {}
    data[key] = value
    REPORT.write_text(json.dumps(data, indent=2))
    print(f"[transfer] {key}: {value}", file=sys.stderr)


def node_dir(name: str) -> Path:
    return next(s.dir for s in sblab.cluster.lab_nodes(2) if s.name == name)


def hub(name: str) -> Path:
    return node_dir(name) / "hf" / "hub"  # /home/lab/.cache/huggingface/hub inside the node


def params_file(tmp: Path, hf_id: str = "sparkbook-lab/hyv4-tiny", **transfer: object) -> Path:
    """This lab's params with lab-hf.yaml's model section (the model by hf_id) and `transfer` settings."""
    data = yaml.safe_load(sblab.params_file(2).read_text())
    data["model"] = {**yaml.safe_load((REPO / "params" / "lab-hf.yaml").read_text())["model"], "hf_id": hf_id,
                     "transfer": transfer}
    path = tmp / "params.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.fixture
def open_run(lab, tmp_path):  # type: ignore[no-untyped-def]
    runs = []

    def make(**kw: object):  # type: ignore[no-untyped-def]
        runs.append(sparkbook.open_run(params_file(tmp_path, **kw), tmp_path / f"run{len(runs)}", stage="03-test"))
        return runs[-1]

    yield make
    for r in runs:
        r.close()


def tree(root: Path) -> dict[str, str]:
    """Every file's sha256 and every symlink's target under root (what the worker must hold like the head)."""
    return {str(p.relative_to(root)): (f"-> {os.readlink(p)}" if p.is_symlink() else
                                       hashlib.sha256(p.read_bytes()).hexdigest())
            for p in sorted(root.rglob("*")) if p.is_symlink() or p.is_file()}


def make_bulk(files: int, size: int) -> str:
    """A model in the head's hub cache (laid out by the lab's own hf_cache), `files` weight blobs of `size`
    random bytes; returns its revision."""
    src = hub("lab-0").parent / ".bulk-src"
    shutil.rmtree(src, ignore_errors=True)
    src.mkdir(parents=True)
    try:
        for i in range(files):
            (src / f"model-{i:05d}.safetensors").write_bytes(os.urandom(size))
        return hf_cache(src, BULK_ID, hub("lab-0")).name
    finally:
        shutil.rmtree(src, ignore_errors=True)


def drop_bulk() -> None:
    for name in ("lab-0", "lab-1"):
        shutil.rmtree(hub(name) / BULK_REPO, ignore_errors=True)
        shutil.rmtree(hub(name) / f".{BULK_REPO}{modelcopy.INCOMING}", ignore_errors=True)


def test_worker_missing_the_model_gets_it_over_the_fabric(open_run) -> None:  # type: ignore[no-untyped-def]
    run = open_run()
    shutil.rmtree(hub("lab-1") / HF_REPO, ignore_errors=True)  # the lab starts without it there
    found = [f for f in checks.model_findings(checks.model_files_all(run.context()))
             if f.text.startswith("lab-1")]
    assert [(f.severity, "03 copies it from lab-0" in f.text) for f in found] == [("warning", True)], found
    copied = modelcopy.copy_model(run.context())
    assert copied.verified and copied.source == "lab-0", copied.message
    (one,) = copied.copies
    assert one.node == "lab-1" and "sha256 of 1 files" in one.verified and one.bytes_sent > 2_500_000
    assert tree(hub("lab-1") / HF_REPO) == tree(hub("lab-0") / HF_REPO)
    assert not (hub("lab-1") / f".{HF_REPO}{modelcopy.INCOMING}").exists(), "the staging dir is gone"
    again = modelcopy.copy_model(run.context())
    assert again.copies == [] and "nothing copied" in again.message
    report("model_copy_hf", one.__dict__)


def test_disk_too_small_is_refused_before_anything_is_sent(open_run) -> None:  # type: ignore[no-untyped-def]
    run = open_run(reserve="100000G")
    shutil.rmtree(hub("lab-1") / HF_REPO, ignore_errors=True)  # the lab starts without it there
    try:
        with pytest.raises(modelcopy.DiskTooSmall) as err:
            modelcopy.copy_model(run.context())
        text = str(err.value)
        assert text.startswith(f"lab-1: /home/lab/.cache/huggingface/hub/{HF_REPO}: the disk has ")
        assert "GB free" in text
        assert "short by" in text and err.value.node == "lab-1"
        assert not (hub("lab-1") / f".{HF_REPO}{modelcopy.INCOMING}").exists(), "nothing was staged"
    finally:
        assert modelcopy.copy_model(open_run().context()).verified  # the worker holds the model again


def test_killed_copy_resumes_without_resending_finished_files(open_run) -> None:  # type: ignore[no-untyped-def]
    size, files = 24_000_000, 6
    make_bulk(files, size)
    stage = hub("lab-1") / f".{BULK_REPO}{modelcopy.INCOMING}"
    try:
        run = open_run(hf_id=BULK_ID, streams=1, bwlimit_mbs=20)
        pid_file = Path(modelcopy.pid_file(ensure(run.cluster.head), "lab-1", 0))  # lab-0's state dir: /root is shared
        pid_file.unlink(missing_ok=True)
        result: list[modelcopy.ModelCopy] = []
        copier = threading.Thread(target=lambda: result.append(modelcopy.copy_model(run.context())), daemon=True)
        copier.start()
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and len(finished(stage, size)) < 2:
            time.sleep(0.2)
        pid = pid_file.read_text().split()[0]  # a PID of the head's own PID namespace: killed there
        head = run.cluster.head
        assert "rsync" in head.run(["cat", f"/proc/{pid}/cmdline"], timeout=30).stdout, "the PID is the stream's rsync"
        head.run(["kill", "-9", pid], timeout=30, check=True)
        copier.join(timeout=120)
        (killed,) = result
        assert not killed.verified and "lab-1" in killed.copies[0].error, killed.message
        assert not (hub("lab-1") / BULK_REPO).exists(), "nothing where vLLM would load the model"
        done = finished(stage, size)
        unfinished = (files - len(done)) * size
        assert 2 <= len(done) < files
        resumed = modelcopy.copy_model(open_run(hf_id=BULK_ID, streams=1).context())
        assert resumed.verified, resumed.message
        (again,) = resumed.copies
        assert again.bytes_sent <= unfinished + 1_000_000, (again.bytes_sent, unfinished)
        assert tree(hub("lab-1") / BULK_REPO) == tree(hub("lab-0") / BULK_REPO)
        report("killed_copy_resumed", {"finished_before_kill": len(done), "unfinished_bytes": unfinished,
                                       "resent_bytes": again.bytes_sent})
    finally:
        drop_bulk()


def finished(stage: Path, size: int) -> list[Path]:
    blobs = stage / "blobs"
    return [p for p in blobs.iterdir() if not p.name.startswith(".") and p.stat().st_size == size] \
        if blobs.is_dir() else []  # rsync's temporary files (dot names) are not finished ones


def worker_holds(run, ref: str) -> bool:  # type: ignore[no-untyped-def]
    return image_source_for(run.params).image(run.cluster.workers[0], ref) is not None


def rmi(run, ref: str) -> None:  # type: ignore[no-untyped-def]
    run.cluster.workers[0].run(["docker", "rmi", ref], timeout=120)


@pytest.mark.slow  # 101 s in CI (most of it the whole old image copied first); make test: test_lab_image_ab.py
def test_image_delta_sends_only_the_layers_the_worker_lacks(open_run) -> None:  # type: ignore[no-untyped-def]
    run = open_run()
    if not worker_holds(run, OLD):
        assert distribute.distribute(run.context(), OLD).verified
    rmi(run, GRAFT)
    try:
        d = distribute.distribute(run.context(), GRAFT)
        assert d.verified, d.message
        (copy,) = d.copies
        assert copy.mode.startswith("delta: 6 of 8 layers") and copy.route.startswith("fabric 10.77.")
        assert copy.bytes < 50_000_000, copy  # the graft's own layers are < 1 MB; the shared 3.3 GB stay home
        report("image_delta_graft", {"bytes": copy.bytes, "seconds": round(copy.seconds, 1), "mode": copy.mode})
    finally:
        rmi(run, GRAFT)


@pytest.mark.slow  # 99 s in CI (every candidate probed again); make test keeps the choice and the probes elsewhere
def test_keep_installed_keeps_the_image_that_serves_the_model(lab, tmp_path) -> None:  # type: ignore[no-untyped-def]
    data = yaml.safe_load(sblab.params_file(2).read_text())
    data["model"] = {"path": "/srv/models/qwen3-tiny", "served_name": "qwen3-tiny", "cache_dir": "/srv/models"}
    (tmp_path / "p.yaml").write_text(yaml.safe_dump(data))
    run = sparkbook.open_run(tmp_path / "p.yaml", tmp_path / "run", stage="03-test")
    ctx = run.context()
    try:
        if not worker_holds(run, OLD):
            assert distribute.distribute(ctx, OLD).verified
        target = choice.model_target(ctx, None)
        machines = choice.node_machines(ctx)
        candidates = [choice.evaluate(ctx, ref, target, {}, machines) for ref in choice.candidate_refs(ctx)]
        policy, installed = choice.image_policy(ctx)
        ids = distribute.image_ids(ctx, installed)
        kept = choice.choose(candidates, [], policy, installed, ids)
        assert (policy, kept.choice) == ("keep_installed", OLD)
        assert kept.reason.startswith("image_policy keep_installed")
        newest = choice.choose(candidates, [], "newest", installed, ids)
        assert newest.choice != OLD and newest.reason.startswith("image_policy newest")
        assert distribute.distribute(ctx, kept.choice).copies == [], "the kept image is on every node: nothing copied"
        report("image_policy_keep", {"kept": kept.choice, "newest would be": newest.choice, "reason": kept.reason})
    finally:
        run.close()


@pytest.mark.benchmark
def test_bench_model_copy_against_plain_rsync(open_run) -> None:  # type: ignore[no-untyped-def]
    """Interleaved: sparkbook's copy (4 streams) and `rsync -a --whole-file` over SSH of the same files."""
    files, size = 8, 64_000_000
    make_bulk(files, size)
    src = f"/home/lab/.cache/huggingface/hub/{BULK_REPO}/"
    ours, plain = [], []
    try:
        for _ in range(2):
            shutil.rmtree(hub("lab-1") / BULK_REPO, ignore_errors=True)
            copied = modelcopy.copy_model(open_run(hf_id=BULK_ID).context())
            assert copied.verified
            ours.append(copied.copies[0].mb_s)
            shutil.rmtree(hub("lab-1") / f".plain-{BULK_REPO}", ignore_errors=True)
            run = open_run(hf_id=BULK_ID)
            dest = f"root@{run.params.node('lab-1').fabric_ip}:/home/lab/.cache/huggingface/hub/.plain-{BULK_REPO}/"
            t0 = time.monotonic()
            r = run.cluster.head.run(["rsync", "-a", "--whole-file", "-e", "ssh -o BatchMode=yes", src, dest],
                                     timeout=600)
            assert r.ok, r.stderr
            plain.append(round(files * size / 1e6 / (time.monotonic() - t0), 1))
        report("bench_model_copy_mb_s", {"sparkbook": ours, "rsync --whole-file": plain,
                                         "ratio": round(sum(ours) / sum(plain), 2)})
    finally:
        shutil.rmtree(hub("lab-1") / f".plain-{BULK_REPO}", ignore_errors=True)
        drop_bulk()


@pytest.mark.benchmark
def test_bench_image_delta_against_whole_stream(open_run) -> None:  # type: ignore[no-untyped-def]
    """The graft to a worker holding 0.28.0, pushed over the fabric: the bare `docker save | ssh docker load` pipe
    on the head, sparkbook's whole stream, then its delta."""
    run = open_run()
    if not worker_holds(run, OLD):
        assert distribute.distribute(run.context(), OLD).verified
    worker = run.cluster.workers[0]
    dest, why = distribute.fabric_dest(run.context(), worker)
    assert dest, why
    size = image_source_for(run.params).image(run.cluster.head, GRAFT)[1]
    out = {}
    try:
        rmi(run, GRAFT)
        t0 = time.monotonic()
        bare = run.cluster.head.run(["bash", "-c", f"set -o pipefail; docker save {GRAFT} | ssh -o BatchMode=yes "
                                     f"{dest} docker load"], timeout=900)
        assert bare.ok, bare.stderr
        out["bare pipe"] = {"bytes": size, "seconds": round(time.monotonic() - t0, 1)}
        for mode in ("whole", "delta"):
            rmi(run, GRAFT)
            skip = distribute.layer_skip(run.context(), GRAFT, worker) if mode == "delta" else None
            copy = distribute.push_image(run.context(), GRAFT, worker, dest, size, skip)
            assert not copy.error and distribute.image_ids(run.context(), GRAFT)[worker.name] == \
                image_source_for(run.params).image(run.cluster.head, GRAFT)[0]
            out[mode] = {"bytes": copy.bytes, "seconds": round(copy.seconds, 1)}
        report("bench_image_graft", out)
        assert out["delta"]["bytes"] * 20 < out["whole"]["bytes"]
        assert out["whole"]["seconds"] <= 1.2 * out["bare pipe"]["seconds"]
    finally:
        rmi(run, GRAFT)
