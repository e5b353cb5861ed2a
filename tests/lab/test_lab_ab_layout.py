"""benchmark.ab: layout on the lab (issue 42 item 2): the full run's plan as `serve.layout: replicas` (the lab's model
fits one node; `max_num_seqs` 8 so that a copy's KV holds the load), seeded from the full run at 04 under a cluster
name and ports of its own (as test_replicas_lab.py), so the full run's deployment keeps serving beside it. 05 and 06
run first with `serve.layout: tp` (the model split over both nodes), then as replicas behind the router on the same
endpoint, both arms over the same points (c=1 and c=4, 2 repeats of 8 prompts); 06 decides at the highest
concurrency and the layout it keeps is what serves afterwards, `status` saying so (with replicas: the router and
both replicas). Two arms of 05 and 06 on the CPU, about 5 minutes beyond the full run: in `make test`, as the
issue's own check. The module's containers are removed after it.
"""
from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from runcopy import seeded_from_04

from sparkbook import cli
from sparkbook.core.values.params import Params
from sparkbook.core.values.rundir import AB_BASELINE
from sparkbook.core.values.sweeppoint import read_points
from sparkbook.runbook.manifest import Manifest

# make test-all: the A/B's arms and kept arm run on the lab in test_lab_image_ab.py, replicas behind the router in
# test_replicas_lab.py; the layout's verdict in tests/unit/test_ab_layout.py: 294 s of setup in CI on 2026-12-07
pytestmark = [pytest.mark.lab, pytest.mark.slow]
# no API key (the keyed router is test_replicas_lab's); the front, which the full run's params set to none
REPLICAS = {"layout": "replicas", "max_num_seqs": 8, "port": 8200, "replica_port": 8201, "master_port": 29701,
            "api_key_env": None, "front": "auto"}
SWEEP = {"concurrency": [1, 4], "num_prompts": 8, "repeats": 2, "warmup_requests": 1, "depths": [], "soak_s": 0,
         "ab": "layout"}


@pytest.fixture(scope="module")
def layout_run(full_run, node_shells, tmp_path_factory: pytest.TempPathFactory,
               ) -> Iterator[tuple[Params, Path, Manifest]]:
    yield from seeded_from_04(full_run, node_shells, tmp_path_factory, "lab-ab-layout", REPLICAS, SWEEP)


def test_both_layouts_ran_in_order_and_the_kept_one_serves_through_one_endpoint(layout_run) -> None:
    params, run_dir, manifest = layout_run
    state = json.loads((run_dir / "state.json").read_text())
    verdict = state["ab"]
    assert verdict["ab"] == "layout" and verdict["kept"] in ("baseline", "replicas"), verdict
    ran = [(nb.name, nb.status) for nb in manifest.notebooks if nb.status != "skipped"]
    assert ran == [("04-ray-cluster.ipynb", "ok"), ("05-serve.ab-baseline.ipynb", "ok"),
                   ("06-benchmark.ab-baseline.ipynb", "ok"), ("05-serve.ipynb", "ok"), ("06-benchmark.ipynb", "ok")] \
        + ([("05-serve.ab-kept.ipynb", "ok")] if verdict["kept"] == "baseline" else []), ran
    replaced = {d["key"]: d for d in {nb.name: nb for nb in manifest.notebooks}["05-serve.ipynb"].decisions}
    assert "the A/B's arm before this one serves it" in replaced["replace"]["reason"], replaced["replace"]
    endpoint = state["endpoint"]
    assert endpoint["base_url"] == f"http://{params.head.fabric_ip}:8200", "one endpoint, whichever layout serves"
    if verdict["kept"] == "replicas":
        assert set(endpoint["replicas"]) == {"lab-0", "lab-1"} and endpoint["router"], endpoint
    else:  # tp behind the front (serve.front's default): one server split over both nodes, on its own port
        assert endpoint["replicas"] == {"lab-0": f"http://{params.head.fabric_ip}:8201"}, endpoint
        assert "--nnodes" in endpoint["commands"]["lab-0"], "tp splits over both nodes"
    listed = httpx.get(f"{endpoint['base_url']}/v1/models", timeout=10).json()["data"]
    assert [m["id"] for m in listed] == [params.model.served_name], listed


def test_status_shows_the_kept_layout(layout_run, capsys: pytest.CaptureFixture[str]) -> None:
    _, run_dir, manifest = layout_run
    assert cli.main(["status", manifest.params_file, "--outputs", str(run_dir.parent.parent)]) == 0
    text = capsys.readouterr().out
    print(text)
    assert "router on lab-0: running" in text, text  # the replicas' router, or the front before tp's server
    replicas = json.loads((run_dir / "state.json").read_text())["ab"]["kept"] == "replicas"
    assert text.count("/health answers 200") == (3 if replicas else 2), text


def test_the_verdict_is_decided_at_the_highest_concurrency_with_bands_and_the_crossing(layout_run) -> None:
    _, run_dir, manifest = layout_run
    tp, replicas = read_points(run_dir / AB_BASELINE), read_points(run_dir)
    assert [p.max_concurrency for p in tp] == [p.max_concurrency for p in replicas] == [1, 4]
    assert all(p.failed == 0 and p.completed == 16 for p in tp + replicas), "2 repeats x 8 prompts in both arms"
    verdict = json.loads((run_dir / "state.json").read_text())["ab"]
    assert [r["max_concurrency"] for r in verdict["ratios"]] == [1, 4] and verdict["decided_at"] == 4
    for r in verdict["ratios"]:
        assert r["ratio"] == pytest.approx(r["second_tok_s"] / r["baseline_tok_s"]) and r["noise_pct"] is not None
    decision = next(d for nb in manifest.notebooks if nb.name == "06-benchmark.ipynb" for d in nb.decisions
                    if d["key"] == "ab")
    assert decision["evidence"][0].startswith("c=1: replicas / tp ") and "at c=4 replicas" in decision["reason"]
    assert decision["evidence"][-1] == (verdict["crossing"] or "the ratio does not cross 1")
    page = (run_dir / "index.html").read_text()
    kept = "tp" if verdict["kept"] == "baseline" else "replicas"
    assert "serving after the A/B" in page and f"{kept} (kept by the A/B)" in page
    assert "Replicas / tp output tok/s" in (run_dir / "06-benchmark.ipynb").read_text()
    print(f"layout A/B on the lab: kept {kept}; " + "; ".join(
        f"c={r['max_concurrency']}: tp {r['baseline_tok_s']:.1f}, replicas {r['second_tok_s']:.1f} tok/s = "
        f"{r['ratio']:.2f}x ±{r['noise_pct']:.1f} % ({r['verdict']})" for r in verdict["ratios"]))
