"""Synthetic run dirs for the archive tests: a manifest, state, events and bench points as the runbook driver and the
notebooks write them (the manifest and state sealed with the test session's key, core.values.seal)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from sparkbook.core.values import seal
from sparkbook.core.values.rundir import SEALED

NAMES = ["01-cleanup.ipynb", "02-diagnosis.ipynb", "03-image-selection.ipynb", "04-ray-cluster.ipynb",
         "05-serve.ipynb", "06-benchmark.ipynb"]


def point(c: int, tok_s: float, ttft_ms: float = 50.0) -> dict[str, Any]:
    """A sweep point with the fields core.analysis.benchstats.compare reads (100 completed requests)."""
    return {"max_concurrency": c, "completed": 100, "failed": 0, "output_throughput": tok_s,
            "median_ttft_ms": ttft_ms, "std_ttft_ms": ttft_ms / 10, "p99_ttft_ms": 2 * ttft_ms,
            "median_tpot_ms": 1000.0 * c / tok_s, "std_tpot_ms": 0.1, "p99_tpot_ms": 1100.0 * c / tok_s,
            "median_itl_per_token_ms": 1000.0 * c / tok_s, "std_itl_per_token_ms": 0.1,
            "median_e2el_ms": 900.0, "std_e2el_ms": 9.0}


def make_run(cluster_dir: Path, run_id: str, *, statuses: list[str] | None = None, image: str = "img:1",
             image_id: str = "sha256:1", exception: dict[str, Any] | None = None,
             events: list[dict[str, Any]] | None = None, points: list[dict[str, Any]] | None = None,
             params_yaml: str | None = "cluster: lab\nserve:\n  max_num_seqs: 16\n",
             decisions: dict[str, list[dict[str, Any]]] | None = None,
             findings: list[dict[str, str]] | None = None, write_notebooks: bool = True) -> Path:
    """A run dir as `sparkbook run` leaves it; statuses per notebook (default: all ok)."""
    run_dir = cluster_dir / run_id
    (run_dir / "bench").mkdir(parents=True)
    statuses = statuses or ["ok"] * len(NAMES)
    notebooks = []
    for name, status in zip(NAMES, statuses, strict=False):
        notebooks.append({"name": name, "status": status, "started": "t", "duration_s": 1.0,
                          "exception": exception if status == "failed" else None,
                          "decisions": (decisions or {}).get(name[:2], []), "cell_limit_s": 1800,
                          "cell_limit_reason": "the default 1800 s"})
        if write_notebooks and status != "pending":
            cells = [{"cell_type": "code", "source": f"cell {i} of {name}", "metadata": {}, "outputs": []}
                     for i in range(4)]
            (run_dir / name).write_text(json.dumps({"cells": cells}))
    failed = "failed" in statuses
    seal.write(run_dir / "manifest.json", json.dumps({
        "cluster": cluster_dir.name, "run_id": run_id, "params_file": "/p/lab.yaml", "parameters": {},
        "started": "2026-12-01T10:00:00+00:00", "finished": "2026-12-01T10:10:00+00:00",
        "status": "failed" if failed else "ok", "notebooks": notebooks}))
    state: dict[str, Any] = {"schema_version": 2}
    if statuses[2] == "ok":
        state["image"] = {"ref": image, "id": image_id, "vllm_version": "0.32.0", "ray_version": "2.60.0",
                          "nodes": {}}
    if statuses[1] == "ok":
        state["diagnosis"] = {"findings": findings or [], "question_for_03": "q", "installed_image": None}
    if statuses[4] == "ok":
        state["endpoint"] = {"executor": "mp", "ready_s": 70.0,
                             "addresses": {"management": "http://10.1.230.180:8000", "fabric": "http://192.168.200.12:8000"}}
    seal.write(run_dir / "state.json", json.dumps(state))  # sealed, as the runbook writes it
    (run_dir / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events or []))
    for p in points or []:
        (run_dir / "bench" / f"c{p['max_concurrency']:04d}.json").write_text(json.dumps(p))
    if params_yaml is not None:
        (run_dir / "params.yaml").write_text(params_yaml)
    return run_dir


def reseal(path: Path) -> Path:
    """Seal `path` as it now stands, as the runbook does when it writes it (a test's edit made by the runbook)."""
    seal.write(path, path.read_bytes())
    return path


def sealed_copy(tree: Path, into: Path) -> Path:
    """A copy of `tree` (committed records, written on another machine) whose manifests, states and restore plans are
    sealed with this test session's key: records this controller's runbook wrote, for the commands that act on them."""
    shutil.copytree(tree, into)
    for name in SEALED:
        for path in into.rglob(name):
            reseal(path)
    return into
