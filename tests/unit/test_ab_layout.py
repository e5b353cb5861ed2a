"""benchmark.ab: layout (issue 42 item 2): the params it needs, the baseline arm's params (serve.layout tp) against the
params' own replicas, the verdict decided by default at the highest concurrency, the crossing in the issue's words
("replicas win above c=N"), the arms' names, and the committed records of the speculative A/B still read."""
from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from sparkbook.core.values import abarm
from sparkbook.core.values.handoff import AbVerdict
from sparkbook.core.values.params import ParamsError, load_params
from sparkbook.core.values.sweeppoint import SweepPoint
from sparkbook.records import archive
from sparkbook.runbook.session import open_run
from sparkbook.stages.bench import ab

EXAMPLES = Path(__file__).resolve().parents[2] / "outputs" / "examples"


def _problems(write_params: Callable[..., Path], base: dict[str, Any]) -> dict[str, str]:
    with pytest.raises(ParamsError) as exc:
        load_params(write_params(base))
    return {p.field: p.message for p in exc.value.problems}


@pytest.fixture
def layout_params(write_params: Callable[..., Path], base: dict[str, Any]) -> Path:
    base["serve"] = {"tensor_parallel_size": 2, "layout": "replicas", "max_num_seqs": 14}
    base["benchmark"] = {"ab": "layout", "concurrency": [1, 4]}
    return write_params(base)


def test_a_layout_ab_needs_replicas_and_a_tp_baseline_that_spans_the_nodes(write_params, base):
    base["benchmark"] = {"ab": "layout"}
    message = _problems(write_params, base)["benchmark.ab"]
    assert "set serve.layout: replicas" in message and "serve.layout tp" in message
    base["serve"] = {"tensor_parallel_size": 1, "layout": "replicas"}  # one GPU per node: tp=1 is one replica
    assert "which one node holds" in _problems(write_params, base)["benchmark.ab"]


def test_the_baseline_arm_serves_tp_and_changes_nothing_else(layout_params):
    params = load_params(layout_params)
    baseline = params.ab_baseline()
    assert (params.serve.layout, baseline.serve.layout) == ("replicas", "tp")
    assert baseline.serve.model_dump(exclude={"layout"}) == params.serve.model_dump(exclude={"layout"})
    assert baseline.benchmark == params.benchmark and baseline.nodes == params.nodes
    assert ab.contest(params).labels == ("tp", "replicas") and ab.contest(params).decide_highest
    no_ab = params.model_copy(update={"benchmark": params.benchmark.model_copy(update={"ab": None})})
    with pytest.raises(ValueError, match="no baseline arm"):
        no_ab.ab_baseline()


def test_each_arm_opens_the_layout_it_serves_under_its_own_name(layout_params, tmp_path):
    run = tmp_path / "run"
    seen = {arm: open_run(layout_params, run, stage="05-serve", ab_arm=arm) for arm in ("baseline", "replicas", "kept")}
    assert {arm: (r.stage, r.params.serve.layout) for arm, r in seen.items()} == {
        "baseline": ("05-serve.ab-baseline", "tp"), "replicas": ("05-serve", "replicas"),
        "kept": ("05-serve.ab-kept", "tp")}
    with pytest.raises(ValueError, match="no arm of benchmark.ab: layout"):
        open_run(layout_params, run, stage="05-serve", ab_arm="speculative")
    assert abarm.note("layout", "replicas") == ("replicas: the params' own plan, serve.layout replicas: a whole copy "
                                                "on each node behind the router")
    assert abarm.note("layout", "kept") == "kept: serve.layout tp: one model split across the nodes"
    assert abarm.note("speculative", "baseline") == "baseline: without serve.speculative"
    assert abarm.note(None, None) == "none (no A/B in this run)"


def _point(c: int, *tput: float) -> SweepPoint:
    return SweepPoint.model_validate({
        "max_concurrency": c, "output_throughput": sorted(tput)[len(tput) // 2], "total_output_tokens": 1000,
        "sparkbook": {"repeats": [{"output_throughput": t} for t in tput] if len(tput) > 1 else []}})


# shaped like the published two-Spark figures: tp ahead single stream, replicas ahead under load
TP = [_point(1, 68, 69, 70), _point(8, 228, 231, 234), _point(32, 465, 472, 478)]
REPLICAS = [_point(1, 57, 58, 58), _point(8, 250, 252, 255), _point(32, 590, 600, 606)]


def test_replicas_that_win_under_load_stay_decided_at_the_highest_concurrency(layout_params):
    c = ab.contest(load_params(layout_params))
    rows = ab.ratios(TP, REPLICAS)
    assert [r.verdict for r in rows] == ["worse", "better", "better"]
    verdict = ab.verdict(rows, None, c)
    assert (verdict.ab, verdict.kept, verdict.decided_at) == ("layout", "replicas", 32)
    assert verdict.crossing == "replicas win above c=1 (replicas / tp 0.84x at c=1, 1.09x at c=8)"
    assert "at c=32 replicas (a copy per node behind the router) gives 600.0 against 472.0" in verdict.reason
    decided = ab.decision(verdict, c)
    assert decided.choice == "serve.layout replicas: a whole copy on each node behind the router"
    assert decided.alternatives[0].option == "serve.layout tp: one model split across the nodes"
    assert decided.evidence[0] == "c=1: replicas / tp 0.84x (worse)"
    assert decided.evidence[-1].startswith("replicas win above c=1")
    assert archive.served_layout("replicas", verdict) == "replicas (kept by the A/B)"
    assert archive.ab_kept(verdict).endswith("; replicas win above c=1 (replicas / tp 0.84x at c=1, 1.09x at c=8)")


def test_tp_stays_where_replicas_do_not_win_beyond_the_noise_at_the_deciding_point(layout_params):
    c = ab.contest(load_params(layout_params))
    at_one = ab.verdict(ab.ratios(TP, REPLICAS), 1, c)  # benchmark.ab_decide_at: 1
    assert at_one.kept == "baseline" and "slower beyond the noise" in at_one.reason
    assert "serves the tp arm again" in at_one.reason and "`sparkbook up` and a rollback do" in at_one.reason \
        and "until the params say serve.layout: tp without benchmark.ab" in at_one.reason
    assert archive.served_layout("replicas", at_one) == "tp (kept by the A/B)"
    assert archive.ab_kept(at_one).startswith("serve.layout tp: one model split across the nodes: at c=1")
    # replicas ahead single stream, tp ahead under load: tp wins above the last crossing, the highest decides
    flipped = ab.ratios([_point(1, 50, 51, 52), _point(4, 150, 155, 160), _point(16, 400, 405, 410)],
                        [_point(1, 60, 61, 62), _point(4, 140, 145, 150), _point(16, 390, 396, 402)])
    verdict = ab.verdict(flipped, None, c)
    assert verdict.crossing == "tp wins above c=1 (replicas / tp 1.20x at c=1, 0.94x at c=4)"
    # 0.98x at c=16 is within the noise: tp stays, and would have without any gain shown by replicas
    assert (verdict.kept, verdict.decided_at, flipped[-1].verdict) == ("baseline", 16, "within noise")
    assert "its gain is within the noise: no measured gain for each node holding the whole model" in verdict.reason
    assert ab.verdict(ab.ratios(TP[1:], REPLICAS[1:]), None, c).crossing is None


def test_the_crossing_names_the_last_change_of_side_for_the_layout():
    rows = ab.ratios([_point(1, 100), _point(2, 100), _point(4, 100)], [_point(1, 110), _point(2, 90), _point(4, 120)])
    layout = ab.Contest("layout", "replicas", ("tp", "replicas"), ("", ""), "", "", "", "", decide_highest=True)
    assert ab.crossing(rows, layout) == "replicas win above c=2 (replicas / tp 0.90x at c=2, 1.20x at c=4)"


@pytest.mark.parametrize("example", ["lab-ab/20261202T202656Z", "h200-one-ab/20261202T201908Z"])
def test_committed_speculative_records_still_read(example):
    """Records written before the layout A/B name the second arm's figure speculative_tok_s and carry no `ab`."""
    data = json.loads((EXAMPLES / example / "state.json").read_text())["ab"]
    verdict = AbVerdict.model_validate(data)
    assert verdict.ab == "speculative" and verdict.kept == data["kept"]
    assert [r.second_tok_s for r in verdict.ratios] == [r["speculative_tok_s"] for r in data["ratios"]]
    assert "speculative_tok_s" not in verdict.model_dump()["ratios"][0]
    assert archive.served_layout("tp", verdict) == "tp", "a speculative A/B leaves the params' layout"
    kept = archive.ab_kept(verdict)
    assert kept is not None and kept.startswith("with" if data["kept"] == "speculative" else "without")
    assert (data["crossing"] is None) or kept.endswith(f"the ratio crosses 1 {data['crossing']}")
    assert archive.ab_verdict({"kept": "nonsense"}) is None and archive.ab_verdict(None) is None
