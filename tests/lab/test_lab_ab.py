"""benchmark.ab: speculative on the lab (issue 32): vLLM 0.32.0's CPU build serves with ngram drafts, so the A/B runs
for real on the session's `full_run` cluster. 05 and 06 run without speculation (the full run's own plan, reused),
then with ngram (the server replaced without confirm_replace: the A/B's own doing), both arms over the same points;
06 reads the spec-decode counters, sets the arms side by side and decides; the configuration it keeps is what serves
afterwards. Where speculation is kept, the full run's plan is served again afterwards for the modules after this one.
"""
from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml

from sparkbook.core.values.rundir import AB_BASELINE
from sparkbook.core.values.sweeppoint import read_points
from sparkbook.runbook import driver
from sparkbook.runbook.driver import RunOptions
from sparkbook.runbook.manifest import Manifest

# make test-all: the A/B's arms, the second arm's replacement, the verdict's kept arm and `up` after it run on the lab
# in test_lab_image_ab.py; what is speculation's own (the spec-decode counters, the verdict) is in
# tests/unit/test_speculative.py and test_specmetrics.py: 238 s of setup in CI on 2026-12-07
pytestmark = [pytest.mark.lab, pytest.mark.slow]
NGRAM = {"method": "ngram", "num_speculative_tokens": 3}


def _secrets(planted: str) -> None:
    os.environ["HF_TOKEN"] = os.environ["VLLM_API_KEY"] = planted


@pytest.fixture(scope="module")
def ab_run(full_run, planted: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, Manifest]]:
    first_dir, first = full_run
    data = yaml.safe_load(Path(first.params_file).read_text())
    data["serve"]["speculative"] = NGRAM
    data["benchmark"].update(concurrency=[1, 4], num_prompts=8, repeats=2, ab="speculative")
    params = tmp_path_factory.mktemp("ab-params") / "lab.yaml"
    params.write_text(yaml.safe_dump(data, sort_keys=False))
    outputs = tmp_path_factory.mktemp("ab-outputs")
    _secrets(planted)
    try:
        run_dir, manifest = driver.execute(params, RunOptions(out_root=outputs, seed=first_dir, start="05"), say=print)
    finally:
        del os.environ["HF_TOKEN"], os.environ["VLLM_API_KEY"]
    yield run_dir, manifest
    if json.loads((run_dir / "state.json").read_text()).get("ab", {}).get("kept") == "speculative":
        _secrets(planted)  # the modules after this one expect the full run's plan serving
        try:
            _, back = driver.execute(Path(first.params_file), RunOptions(out_root=outputs, seed=first_dir, start="05",
                                                                         upto="05",
                                                                         parameters={"confirm_replace": True}),
                                     say=print)
        finally:
            del os.environ["HF_TOKEN"], os.environ["VLLM_API_KEY"]
        assert back.status == "partial" and any(nb.status == "ok" for nb in back.notebooks), back


def test_both_arms_ran_in_order_and_the_kept_one_serves_last(ab_run: tuple[Path, Manifest]) -> None:
    run_dir, manifest = ab_run
    state = json.loads((run_dir / "state.json").read_text())
    kept = state["ab"]["kept"]
    ran = [(nb.name, nb.status) for nb in manifest.notebooks if not nb.status.startswith("skipped")]
    assert ran == [("05-serve.ab-baseline.ipynb", "ok"), ("06-benchmark.ab-baseline.ipynb", "ok"),
                   ("05-serve.ipynb", "ok"), ("06-benchmark.ipynb", "ok")] \
        + ([("05-serve.ab-kept.ipynb", "ok")] if kept == "baseline" else []), ran
    by_name = {nb.name: nb for nb in manifest.notebooks}
    reuse = [d["choice"] for d in by_name["05-serve.ab-baseline.ipynb"].decisions
             if d["question"].startswith("Reuse the running server")]
    assert reuse == ["reused: the server already running"], "the full run's server serves the baseline's plan"
    replaced = {d["key"]: d for d in by_name["05-serve.ipynb"].decisions}["replace"]
    assert "the A/B's arm before this one serves it" in replaced["reason"], replaced
    argv = state["endpoint"]["commands"]["lab-0"]
    if kept == "speculative":
        assert json.loads(argv[argv.index("--speculative-config") + 1]) == NGRAM
    else:
        assert "--speculative-config" not in argv, "the kept arm serves without speculation"
    metrics = httpx.get(f"{state['endpoint']['base_url']}/metrics", timeout=30).text
    assert ("vllm:spec_decode_num_drafts_total" in metrics) == (kept == "speculative"), \
        "what serves after the run is the configuration the A/B kept"


def test_the_speculative_arm_drives_every_counter_and_the_baseline_none(ab_run: tuple[Path, Manifest]) -> None:
    run_dir, _ = ab_run
    baseline, speculative = read_points(run_dir / AB_BASELINE), read_points(run_dir)
    assert [p.max_concurrency for p in baseline] == [p.max_concurrency for p in speculative] == [1, 4]
    for b, s in zip(baseline, speculative, strict=True):
        assert b.sparkbook.speculation is None and b.failed == s.failed == 0
        assert (b.completed, b.total_input_tokens) == (s.completed, s.total_input_tokens) == (16, 16 * 64), \
            "2 repeats x 8 prompts of 64 tokens in both arms"
        spec = s.sparkbook.speculation
        assert spec is not None and spec.drafts > 0 and spec.draft_tokens > 0 and spec.accepted > 0, spec
        assert len(spec.accepted_per_position) == 3 and sum(spec.accepted_per_position) == spec.accepted
        checks = (s.sparkbook.model_extra or {})["server_cross_check"]
        assert [c["metric"] for c in checks] == ["vllm:generation_tokens_total", "vllm:prompt_tokens_total"]
        assert all(c["agrees"] for c in checks), "the streamed token ids count what the server generated"


def test_the_decision_names_ratio_noise_and_crossing(ab_run: tuple[Path, Manifest]) -> None:
    run_dir, manifest = ab_run
    verdict = json.loads((run_dir / "state.json").read_text())["ab"]
    assert [r["max_concurrency"] for r in verdict["ratios"]] == [1, 4] and verdict["decided_at"] == 1
    for r in verdict["ratios"]:
        assert r["ratio"] == pytest.approx(r["second_tok_s"] / r["baseline_tok_s"])
        assert r["noise_pct"] is not None, "two repeats per point give each ratio a noise band"
    decision = next(d for nb in manifest.notebooks if nb.name == "06-benchmark.ipynb" for d in nb.decisions
                    if d["key"] == "ab")
    assert decision["evidence"][0].startswith("c=1: ") and "noise band" in decision["reason"]
    page = (run_dir / "index.html").read_text()
    assert "serving after the A/B" in page and verdict["reason"].split(":")[0] in page
    notebook = (run_dir / "06-benchmark.ipynb").read_text()
    assert "decode steps/s" in notebook and "Speculative / baseline output tok/s" in notebook
