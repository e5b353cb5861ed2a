"""01-cleanup and 02-diagnosis against the lab: plan only, stop + verify + restore, the old image's registry,
a worker whose sshd is stopped, a worker cut off from the head on the fabric."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

import sparkbook.lab as sblab
from sparkbook import cleanup, cli, diagnose, runbook
from sparkbook.record import open_run

pytestmark = pytest.mark.lab
OLD = {"old-vllm", "old-proxy", "old-embeddings", "old-reranker"}


def running(st) -> set[str]:
    return {c["name"] for n in st.nodes for c in n.containers if c["state"] == "running"}


def events(run_dir: Path, kind: str) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    return [r["data"] for r in rows if r["kind"] == kind]


def run_notebook(tmp_path: Path, only: str, **parameters) -> Path:
    run_dir, manifest = runbook.run(sblab.REPO_PARAMS, out_root=tmp_path, only=only, parameters=parameters)
    nb = next(n for n in manifest.notebooks if n.name.startswith(only))
    assert nb.status == "ok", nb.exception
    return run_dir


def test_01_plan_only_stops_nothing(lab, tmp_path):
    assert OLD <= running(sblab.status())
    run_dir = run_notebook(tmp_path, "01")
    (plan,) = events(run_dir, "cleanup_plan")
    names = [t["name"] for t in plan["targets"]]
    print("plan:", names)
    assert set(names) == OLD and names.index("old-proxy") < names.index("old-vllm")
    assert OLD <= running(sblab.status())


def test_01_stop_verify_then_restore(lab, tmp_path):
    try:
        run_dir = run_notebook(tmp_path, "01", confirm_cleanup=True)
        (check,) = events(run_dir, "cleanup_verification")
        print("verification:", json.dumps(check, indent=1))
        assert all(r["stopped"] for r in check["stopped"]) and not check["untouched_changes"]
        assert sum(m["rise MiB"] for m in check["memory"]) > 0
        assert not OLD & running(sblab.status())
        assert cli.main(["restore", str(run_dir)]) == 0
        assert OLD <= running(sblab.status())
    finally:
        if not OLD <= running(sblab.status()):
            sblab.reset()


def test_02_old_image_lacks_the_lab_model(lab, tmp_path):
    run_dir = run_notebook(tmp_path, "02")
    state = json.loads((run_dir / "state.json").read_text())
    model = state["model"]
    assert model["architectures"] == ["HYV4ForCausalLM"] and model["total_params"] > model["active_params"] > 0
    assert {"model_type", "dir_on_nodes", "bytes_per_param", "weight_bytes"} <= set(model)
    texts = [f["text"] for f in state["diagnosis"]["findings"]]
    print("\n".join(texts))
    assert any("does not register HYV4ForCausalLM" in t for t in texts)


def _sshd_pid(init_pid: int) -> int:
    kids = Path(f"/proc/{init_pid}/task/{init_pid}/children").read_text().split()
    return next(int(p) for p in kids if Path(f"/proc/{p}/comm").read_text().strip() == "sshd")


def test_worker_with_sshd_stopped_is_named_within_30s(lab):
    worker = next(n for n in sblab.status().nodes if n.name == "lab-1")
    pid = _sshd_pid(worker.init_pid)
    run = open_run(sblab.REPO_PARAMS, "/tmp/sparkbook-test-01-02", stage="sshd-stopped")
    os.kill(pid, signal.SIGSTOP)  # stopped, not dead: connections hang instead of being refused
    try:
        t0 = time.monotonic()
        inv = cleanup.inventory_all(run.cluster, run.params.cleanup)
        facts = diagnose.facts_all(run.cluster, run.params)
        took = time.monotonic() - t0
    finally:
        os.kill(pid, signal.SIGCONT)
        run.close()
    reported = [f.text for f in diagnose.unreachable(inv) + diagnose.unreachable(facts)]
    print(f"inventory + facts with lab-1's sshd stopped: {took:.1f} s;", reported,
          [(o.node, round(o.duration_s, 1)) for o in (inv["lab-1"], facts["lab-1"])])
    assert inv["lab-0"].ok and facts["lab-0"].ok
    assert len(reported) == 2 and all(t.startswith("lab-1: ") for t in reported)
    assert inv["lab-1"].duration_s < 30 and facts["lab-1"].duration_s < 30
    assert took < 60


def test_worker_cut_from_head_on_the_fabric_is_reported(lab):
    rule = ["OUTPUT", "-d", "10.77.0.10", "-j", "DROP"]
    ns = ["nsenter", "--net=/var/run/netns/sbk-lab-1", "iptables", "-w", "5"]
    run = open_run(sblab.REPO_PARAMS, "/tmp/sparkbook-test-01-02", stage="fabric-cut")
    subprocess.run([*ns, "-I", *rule], check=True, timeout=30)
    try:
        results = diagnose.links_all(run.cluster, run.params)
    finally:
        subprocess.run([*ns, "-D", *rule], check=True, timeout=30)
        run.close()
    texts = [f.text for f in diagnose.link_findings(results, run.params)]
    print("\n".join(texts))
    assert any(t.startswith("lab-1 -> lab-0 (head)") and "cannot reach lab-0" in t for t in texts)
