"""benchmark.ab: layout on the lab (issue 42 item 2): the full run's plan as `serve.layout: replicas` (the lab's model
fits one node; `max_num_seqs` 14 so that a copy's KV holds the load), 05 and 06 first with `serve.layout: tp` (the
model split over both nodes), then as replicas behind the router on the same endpoint, both arms over the same points
(c=1 and c=4, 2 repeats of 8 prompts); 06 decides at the highest concurrency and the layout it keeps is what serves
afterwards. Heavy (two arms of 05 and 06 on the CPU, and the full run's plan served again after it): `slow`.
"""
from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml

from sparkbook.core.rundir import AB_BASELINE
from sparkbook.core.sweeppoint import read_points
from sparkbook.runbook import driver
from sparkbook.runbook.manifest import Manifest

pytestmark = [pytest.mark.lab, pytest.mark.slow]


def _secrets(planted: str) -> None:
    os.environ["HF_TOKEN"] = os.environ["VLLM_API_KEY"] = planted


def _driven(planted: str, params: Path, **kwargs: object) -> tuple[Path, Manifest]:
    _secrets(planted)
    try:
        return driver.run(params, say=print, **kwargs)  # type: ignore[arg-type]
    finally:
        del os.environ["HF_TOKEN"], os.environ["VLLM_API_KEY"]


@pytest.fixture(scope="module")
def layout_run(full_run, planted: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, Manifest]]:
    first_dir, first = full_run
    data = yaml.safe_load(Path(first.params_file).read_text())
    data["serve"].update(layout="replicas", max_num_seqs=14)
    data["benchmark"].update(concurrency=[1, 4], num_prompts=8, repeats=2, ab="layout", soak_s=0)
    params = tmp_path_factory.mktemp("ab-layout-params") / "lab.yaml"
    params.write_text(yaml.safe_dump(data, sort_keys=False))
    outputs = tmp_path_factory.mktemp("ab-layout-outputs")
    # the baseline's tp plan differs from the full run's (max_num_seqs): replacing that server needs the confirmation
    yield _driven(planted, params, out_root=outputs, seed=first_dir, start="05", parameters={"confirm_replace": True})
    _, back = _driven(planted, Path(first.params_file), out_root=outputs, seed=first_dir, start="05", upto="05",
                      parameters={"confirm_replace": True})  # the modules after this one expect the full run's plan
    assert back.status == "partial" and any(nb.status == "ok" for nb in back.notebooks), back


def test_both_layouts_ran_in_order_and_the_kept_one_serves_through_one_endpoint(layout_run, planted: str) -> None:
    run_dir, manifest = layout_run
    state = json.loads((run_dir / "state.json").read_text())
    verdict = state["ab"]
    assert verdict["ab"] == "layout" and verdict["kept"] in ("baseline", "replicas"), verdict
    ran = [(nb.name, nb.status) for nb in manifest.notebooks if not nb.status.startswith("skipped")]
    assert ran == [("05-serve.ab-baseline.ipynb", "ok"), ("06-benchmark.ab-baseline.ipynb", "ok"),
                   ("05-serve.ipynb", "ok"), ("06-benchmark.ipynb", "ok")] \
        + ([("05-serve.ab-kept.ipynb", "ok")] if verdict["kept"] == "baseline" else []), ran
    replaced = {d["key"]: d for d in {nb.name: nb for nb in manifest.notebooks}["05-serve.ipynb"].decisions}
    assert "the A/B's arm before this one serves it" in replaced["replace"]["reason"], replaced["replace"]
    argv = state["endpoint"]["commands"]["lab-0"]
    assert ("--nnodes" in argv) == (verdict["kept"] == "baseline"), "tp splits the model over both nodes"
    served = httpx.get(f"{state['endpoint']['base_url']}/v1/models", timeout=30,
                       headers={"Authorization": f"Bearer {planted}"})
    assert served.status_code == 200, served.text  # the one endpoint answers whichever layout serves


def test_the_verdict_is_decided_at_the_highest_concurrency_with_bands_and_the_crossing(layout_run) -> None:
    run_dir, manifest = layout_run
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
