"""01-cleanup and 02-diagnosis against the lab: plan only, stop + verify + restore, the old image's registry.
A worker whose sshd is stopped and a worker cut off from the head on the fabric: tests/lab/test_faults.py."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

import sparkbook.lab as sblab
from sparkbook import cli
from sparkbook.runbook import driver
from sparkbook.runbook.driver import RunOptions

pytestmark = pytest.mark.lab
OLD = {"old-vllm", "old-proxy", "old-embeddings", "old-reranker"}


def running(st) -> set[str]:
    return {c["name"] for n in st.nodes for c in n.containers if c["state"] == "running"}


def events(run_dir: Path, kind: str) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    return [r["data"] for r in rows if r["kind"] == kind]


def run_notebook(tmp_path: Path, only: str, **parameters) -> Path:
    run_dir, manifest = driver.execute(sblab.params_file(2), RunOptions(out_root=tmp_path, only=only,
                                                                        parameters=parameters))
    nb = next(n for n in manifest.notebooks if n.name.startswith(only))
    assert nb.status == "ok", nb.exception
    return run_dir


def test_01_plan_only_stops_nothing(lab, tmp_path):
    assert OLD <= running(sblab.status())
    run_dir = run_notebook(tmp_path, "01")
    (plan,) = events(run_dir, "cleanup_plan")
    names = [t["name"] for t in plan["targets"]]
    print("plan:", names)
    owned = {t["name"] for t in plan["targets"] if t["owner"]}
    assert set(names) - OLD - owned == {t["name"] for t in plan["targets"] if t["kind"] == "process"}
    assert owned == {"vllm_node"} and names.index("old-proxy") < names.index("old-vllm")
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
    # the lab's tiny MoE: a whole copy on each node, each held to 16 x 2048 tokens, which the lab's fixed 128M of
    # KV cache per rank (an MLA latent, whole on every rank: the same tokens in every layout) does not hold
    ((tp, replicas, ep),) = events(run_dir, "layout_fit")
    print("\n".join(f"{f['layout']}: {[(r['weights_gib'], r['why']) for r in f['rows']]}" for f in (tp, replicas)))
    assert (tp["layout"], replicas["layout"], ep["layout"]) == ("tp", "replicas", "expert parallel")
    assert [r["node"] for r in replicas["rows"]] == ["lab-0", "lab-1"] and replicas["needed_tokens"] == 16 * 2048
    for split, copy in zip(tp["rows"], replicas["rows"], strict=True):
        assert copy["weights_gib"] == pytest.approx(2 * split["weights_gib"], abs=0.002) and copy["kv_gib"] > 0
        assert copy["kv_tokens"] == split["kv_tokens"] < 16 * 2048 and "32768 are needed" in copy["why"]
