"""benchmark.ab: speculative (issue 32 item 3): the params it needs, the ratio at each concurrency against the noise of
both arms, where the two cross, which configuration stays serving, and the driver running 05 and 06 as two arms (a
third 05 where the baseline is kept) through papermill, with each arm's notebook seeing its own plan."""
from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from stubnotebooks import write_notebook

from sparkbook.core.analysis.benchstats import decode_steps_per_s
from sparkbook.core.values.handoff import AbVerdict
from sparkbook.core.values.params import ParamsError, Speculative, load_params
from sparkbook.core.values.rundir import AB_BASELINE
from sparkbook.core.values.sweeppoint import SweepPoint
from sparkbook.runbook import arms, driver
from sparkbook.runbook.driver import RunOptions
from sparkbook.runbook.session import open_run
from sparkbook.stages.bench import ab

NGRAM = {"method": "ngram", "num_speculative_tokens": 3}
SPEC = Speculative.model_validate(NGRAM)
SPECULATIVE = ab.Contest("speculative", "speculative", ("baseline", "speculative"),
                         ("without serve.speculative", "with serve.speculative (ngram, 3 tokens)"),
                         "speculation (ngram, 3 tokens)",
                         "no measured gain for the memory it takes and its failure modes",
                         "until the params drop serve.speculative and benchmark.ab",
                         "Which configuration stays serving after the A/B of speculative decoding?",
                         decide_highest=False)


def _problems(write_params: Callable[..., Path], base: dict[str, Any]) -> dict[str, str]:
    with pytest.raises(ParamsError) as exc:
        load_params(write_params(base))
    return {p.field: p.message for p in exc.value.problems}


def test_an_ab_needs_speculation_and_decides_at_a_measured_concurrency(write_params, base):
    base["benchmark"] = {"ab": "speculative"}
    assert "set serve.speculative" in _problems(write_params, base)["benchmark.ab"]
    base["serve"]["speculative"] = NGRAM
    base["benchmark"] = {"ab": "speculative", "concurrency": [1, 4], "ab_decide_at": 8}
    assert "not one of benchmark.concurrency [1, 4]" in _problems(write_params, base)["benchmark.ab_decide_at"]
    base["benchmark"] = {"ab_decide_at": 1, "concurrency": [1, 4]}
    assert "without benchmark.ab" in _problems(write_params, base)["benchmark.ab_decide_at"]
    base["benchmark"] = {"ab": "speculative", "concurrency": [1, 4], "ab_decide_at": 4}
    params = load_params(write_params(base))
    assert ab.contest(params) == SPECULATIVE
    assert params.serve.speculative == SPEC and params.ab_baseline().serve.speculative is None
    assert params.ab_baseline().serve.tensor_parallel_size == params.serve.tensor_parallel_size


def test_an_arm_opens_the_run_without_speculation_under_its_own_stage(write_params, base, tmp_path):
    base["serve"]["speculative"] = NGRAM
    base["benchmark"] = {"ab": "speculative"}
    path = write_params(base)
    own = open_run(path, tmp_path / "run", stage="06-benchmark")
    arm = open_run(path, tmp_path / "run", stage="06-benchmark", ab_arm="baseline")
    assert (own.stage, own.params.serve.speculative, own.bench_root) == ("06-benchmark", SPEC, tmp_path / "run")
    assert (arm.stage, arm.params.serve.speculative) == ("06-benchmark.ab-baseline", None)
    assert arm.bench_root == tmp_path / "run" / AB_BASELINE
    second = open_run(path, tmp_path / "run", stage="05-serve", ab_arm="speculative")
    assert (second.stage, second.params.serve.speculative) == ("05-serve", SPEC), "the params' own plan"
    with pytest.raises(ValueError, match="not an A/B arm"):
        open_run(path, tmp_path / "run", stage="05-serve", ab_arm="eagle")
    with pytest.raises(ValueError, match="no arm of benchmark.ab: speculative"):
        open_run(path, tmp_path / "run", stage="05-serve", ab_arm="replicas")


def _point(c: int, *tput: float, accepted: int | None = None, output: int = 1000) -> SweepPoint:
    """A saved point with its repeats' output tok/s (the median reported) and, where given, what speculation did."""
    spec = None if accepted is None else {"drafts": accepted, "draft_tokens": 3 * accepted, "accepted": accepted,
                                          "accepted_per_position": [accepted, 0, 0]}
    return SweepPoint.model_validate({
        "max_concurrency": c, "output_throughput": sorted(tput)[len(tput) // 2], "total_output_tokens": output,
        "sparkbook": {"repeats": [{"output_throughput": t} for t in tput] if len(tput) > 1 else [],
                      "speculation": spec}})


BASELINE = [_point(1, 98, 100, 102), _point(4, 300, 310, 320), _point(16, 800, 820, 830)]
FASTER_ALONE = [_point(1, 138, 140, 141, accepted=300), _point(4, 310, 320, 345, accepted=300),
                _point(16, 700, 712, 720, accepted=300)]


def test_speculation_faster_at_one_stream_stays_and_the_crossing_is_named():
    rows = ab.ratios(BASELINE, FASTER_ALONE)
    assert [(r.max_concurrency, round(r.ratio, 3)) for r in rows] == [(1, 1.4), (4, 1.032), (16, 0.868)]
    assert [r.verdict for r in rows] == ["better", "within noise", "worse"]
    assert rows[1].noise_pct == pytest.approx(100 * 35 / 320), "the wider of the two arms' repeat spreads"
    verdict = ab.verdict(rows, None, SPECULATIVE)
    assert (verdict.kept, verdict.decided_at) == ("speculative", 1)
    assert verdict.crossing == "between c=4 (1.03x) and c=16 (0.87x)"
    decided = ab.decision(verdict, SPECULATIVE)
    assert decided.choice == "with serve.speculative (ngram, 3 tokens)" and decided.key == "ab"
    assert decided.evidence[-1] == "the ratio crosses 1 between c=4 (1.03x) and c=16 (0.87x)"
    assert "1.40x" in decided.reason and "without serve.speculative" == decided.alternatives[0].option


def test_deciding_where_it_only_matches_or_loses_keeps_the_baseline():
    rows = ab.ratios(BASELINE, FASTER_ALONE)
    at_four = ab.verdict(rows, 4, SPECULATIVE)
    assert at_four.kept == "baseline" and "within the noise" in at_four.reason
    at_sixteen = ab.verdict(rows, 16, SPECULATIVE)
    assert at_sixteen.kept == "baseline" and "slower beyond the noise" in at_sixteen.reason


def test_one_repeat_measures_no_noise_so_no_gain_keeps_speculation():
    rows = ab.ratios([_point(1, 100)], [_point(1, 150, accepted=400)])
    assert rows[0].noise_pct is None and rows[0].verdict == "no noise estimate"
    verdict = ab.verdict(rows, None, SPECULATIVE)
    assert verdict.kept == "baseline" and "benchmark.repeats to 2 or more" in verdict.reason
    assert verdict.crossing is None and ab.decision(verdict, SPECULATIVE).evidence[-1] == "the ratio does not cross 1"


def test_both_arms_rows_show_decode_steps_beside_output_tokens():
    rows = ab.arm_rows(BASELINE, FASTER_ALONE, SPECULATIVE)
    assert [(r["concurrency"], r["arm"]) for r in rows[:2]] == [(1, "baseline"), (1, "speculative")]
    assert rows[0]["decode steps/s"] == 100 and "mean accepted length" not in rows[0]
    # 1000 output tokens of which 300 were accepted drafts: 700 steps, 140 tok/s -> 98 steps/s
    assert rows[1]["decode steps/s"] == 98.0 and rows[1]["mean accepted length"] == 2.0
    assert rows[1]["steps drafting %"] == 42.9, "300 drafting steps of 700"
    assert rows[1]["tok/s min-max"] == "138.0-141.0"
    assert decode_steps_per_s(_point(1, 100, accepted=10, output=0)) is None, "no token count, no steps"


PARAMETERS = 'params_file = ""\nrun_dir = ""\nab_arm = None\nkeep = "speculative"'


@pytest.fixture
def ab_notebooks(tmp_path: Path) -> Path:
    """A 05 that notes the speculation its arm serves with, and a 06 whose A/B keeps `keep` (as the real one
    remembers its verdict)."""
    folder = tmp_path / "notebooks"
    folder.mkdir()
    opened = 'import json, sparkbook\nrun = sparkbook.open_run(params_file, run_dir, stage="{stage}", ab_arm=ab_arm)\n'
    serve = opened.format(stage="05-serve") + (
        'spec = run.params.serve.speculative\n'
        'with (run.run_dir / "served.jsonl").open("a") as fh:\n'
        '    fh.write(json.dumps([run.stage, ab_arm, spec.method if spec else None]) + "\\n")\n'
        'with (run.run_dir / "layouts.jsonl").open("a") as fh:\n'
        '    fh.write(json.dumps([run.stage, ab_arm, run.params.serve.layout]) + "\\n")\n')
    bench = opened.format(stage="06-benchmark") + (
        'from sparkbook.core.values.handoff import AbVerdict\n'
        'if ab_arm not in (None, "baseline"):\n'
        '    run.remember(AbVerdict(ab=run.params.benchmark.ab, kept=keep, reason="planted", decided_at=1, '
        'crossing=None, ratios=[]))\n')
    write_notebook(folder, "04-ray.ipynb", PARAMETERS, opened.format(stage="04-ray"))
    write_notebook(folder, "05-serve.ipynb", PARAMETERS, serve)
    write_notebook(folder, "06-benchmark.ipynb", PARAMETERS, bench)
    return folder


@pytest.fixture
def ab_params(base: dict[str, Any], write_params: Callable[..., Path], tmp_path: Path) -> Path:
    for node in base["nodes"]:
        node["transport"] = "local"
    for node in base["nodes"]:  # the run lock, in the head's state dir: this test's own
        node["state_dir"] = str(tmp_path / "state" / node["name"])
    base["serve"]["speculative"] = NGRAM
    base["benchmark"] = {"ab": "speculative"}
    return write_params(base)


def _served(run_dir: Path) -> list[list[str | None]]:
    return [json.loads(line) for line in (run_dir / "served.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("keep", ["speculative", "baseline"])
def test_the_driver_runs_both_arms_and_serves_the_kept_one_last(ab_notebooks, ab_params, tmp_path, keep, capfd):
    said: list[str] = []
    run_dir, manifest = driver.execute(ab_params, RunOptions(out_root=tmp_path / "out", folder=ab_notebooks,
                                                             parameters={"keep": keep}), say=said.append)
    assert "without encryption" not in capfd.readouterr().err  # no kernel's TCP warning amid the driver's lines
    expected = ["04-ray.ipynb", "05-serve.ab-baseline.ipynb", "06-benchmark.ab-baseline.ipynb", "05-serve.ipynb",
                "06-benchmark.ipynb"] + (["05-serve.ab-kept.ipynb"] if keep == "baseline" else [])
    assert [nb.name for nb in manifest.notebooks] == expected
    assert manifest.status == "ok" and all(nb.status == "ok" for nb in manifest.notebooks)
    assert all((run_dir / name).is_file() for name in expected)
    served = [["05-serve.ab-baseline", "baseline", None], ["05-serve", "speculative", "ngram"]]
    assert _served(run_dir) == served + ([["05-serve.ab-kept", "kept", None]] if keep == "baseline" else [])
    assert any("05-serve.ab-kept.ipynb serves it again" in line for line in said) == (keep == "baseline")


@pytest.mark.parametrize("keep", ["replicas", "baseline"])
def test_the_layout_ab_serves_tp_then_replicas_and_tp_again_where_tp_is_kept(ab_notebooks, ab_params, tmp_path, keep):
    data = yaml.safe_load(ab_params.read_text())
    data["serve"] = {**data["serve"], "layout": "replicas", "speculative": None}
    data["benchmark"] = {"ab": "layout"}
    ab_params.write_text(yaml.safe_dump(data))
    said: list[str] = []
    run_dir, manifest = driver.execute(ab_params, RunOptions(out_root=tmp_path / "out", folder=ab_notebooks,
                                                             parameters={"keep": keep}), say=said.append)
    assert manifest.status == "ok", manifest
    layouts = [json.loads(line) for line in (run_dir / "layouts.jsonl").read_text().splitlines()]
    assert layouts == [["05-serve.ab-baseline", "baseline", "tp"], ["05-serve", "replicas", "replicas"]] \
        + ([["05-serve.ab-kept", "kept", "tp"]] if keep == "baseline" else [])
    kept_line = [line for line in said if "serves it again" in line]
    assert kept_line == ([] if keep == "replicas" else [
        "the A/B keeps its baseline (serve.layout tp: one model split across the nodes): 05-serve.ab-kept.ipynb "
        "serves it again"])


@pytest.mark.parametrize("keep", ["replicas", "baseline"])
def test_up_after_the_layout_ab_serves_the_layout_it_kept(ab_notebooks, ab_params, tmp_path, keep):
    """`sparkbook up` and a rollback start from the deployment's run (seed, 04 and 05): where its A/B kept tp, 05
    runs as the kept arm and serves tp again, not the replicas the A/B rejected; once the params no longer ask for
    the A/B, they rule."""
    data = yaml.safe_load(ab_params.read_text())
    data["serve"] = {**data["serve"], "layout": "replicas", "speculative": None}
    data["benchmark"] = {"ab": "layout"}
    ab_params.write_text(yaml.safe_dump(data))
    run_dir, _ = driver.execute(ab_params, RunOptions(out_root=tmp_path / "out", folder=ab_notebooks,
                                                      parameters={"keep": keep}))
    said: list[str] = []
    up_dir, up = driver.execute(ab_params, RunOptions(out_root=tmp_path / "out", folder=ab_notebooks, seed=run_dir,
                                                      start="04", upto="05"), say=said.append)
    kept = keep == "baseline"
    assert up.status == "partial" and [nb.name for nb in up.notebooks if nb.status == "ok"] == \
        ["04-ray.ipynb", "05-serve.ab-kept.ipynb" if kept else "05-serve.ipynb"]
    assert [json.loads(line) for line in (up_dir / "layouts.jsonl").read_text().splitlines()] == \
        [["05-serve.ab-kept", "kept", "tp"] if kept else ["05-serve", None, "replicas"]]
    assert any("serves the baseline its A/B kept" in line for line in said) == kept
    again, _ = driver.execute(ab_params, RunOptions(out_root=tmp_path / "out", folder=ab_notebooks, seed=up_dir,
                                                    start="04", upto="05"))
    assert (again / "layouts.jsonl").read_text() == (up_dir / "layouts.jsonl").read_text(), "up after up: the same"
    data["serve"]["layout"], data["benchmark"] = "tp", {}
    ab_params.write_text(yaml.safe_dump(data))
    ruled, _ = driver.execute(ab_params, RunOptions(out_root=tmp_path / "out", folder=ab_notebooks, seed=up_dir,
                                                    start="04", upto="05"))
    assert [json.loads(line) for line in (ruled / "layouts.jsonl").read_text().splitlines()] == \
        [["05-serve", None, "tp"]], "the params changed as the decision said: they rule"


def test_an_ab_run_resumes_at_its_failed_arm(ab_notebooks, ab_params, tmp_path):
    run_dir, manifest = driver.execute(ab_params, RunOptions(out_root=tmp_path / "out", folder=ab_notebooks,
                                                             parameters={"keep": "nonsense"}))  # the verdict fails its schema in the last 06
    assert [nb.status for nb in manifest.notebooks][-2:] == ["ok", "failed"]
    _, manifest = driver.execute(ab_params, RunOptions(resume=run_dir, folder=ab_notebooks,
                                                       parameters={"keep": "baseline"}))
    assert [nb.name for nb in manifest.notebooks][-2:] == ["06-benchmark.ipynb", "05-serve.ab-kept.ipynb"]
    assert manifest.status == "ok"
    assert [stage for stage, _, _ in _served(run_dir)] == ["05-serve.ab-baseline", "05-serve", "05-serve.ab-kept"]


def test_without_both_serve_and_bench_there_is_no_ab(ab_params):
    params = load_params(ab_params)
    names = ["04-ray.ipynb", "05-serve.ipynb", "06-benchmark.ipynb"]
    assert arms.with_arms(names[:2], params) == names[:2]
    assert arms.with_arms(names, params.ab_baseline().model_copy(
        update={"benchmark": params.benchmark.model_copy(update={"ab": None})})) == names
    assert arms.source("05-serve.ab-kept.ipynb") == "05-serve.ipynb" and arms.source(names[2]) == names[2]
    run = arms.with_arms(names, params)
    assert [arms.parameters(n, run, "speculative") for n in run] == [
        {}, {"ab_arm": "baseline"}, {"ab_arm": "baseline"}, {"ab_arm": "speculative"}, {"ab_arm": "speculative"}]
    assert [arms.parameters(n, run, "layout") for n in run][3:] == [{"ab_arm": "replicas"}] * 2
    assert arms.parameters(names[2], names, "speculative") == {}, "06 alone (--only 06) decides no A/B"
    assert AbVerdict.key == "ab"


def test_the_ceilings_bound_decode_steps_not_the_tokens_speculation_emits():
    """On one H200 (outputs/examples/h200-one-ab) ngram speculation made 1798.6 output tok/s at c=8 against a ceiling
    of 1442.7: a step verifies ~4 drafted tokens and reads the weights once, so the ceiling bounds its steps."""
    from sparkbook.core.analysis.benchstats import StepModel, batch_ceilings, decode_steps_from_tpot
    model = StepModel(dense_params=10**9, experts=0, experts_per_token=0, moe_layers=0, expert_params=0,
                      bytes_per_param=2.0, kv_bytes_per_token=0.0, context_tokens=0.0, kv_replicated=False,
                      tensor_parallel=1, node_bandwidth_gbs=4000.0)  # 0.5 ms a step: 2000 steps/s per sequence
    plain, drafting = _point(1, 1500), _point(1, 1500, accepted=600, output=800)
    (a,), (b,) = batch_ceilings(model, [plain]), batch_ceilings(model, [drafting])
    assert a.ceiling_tok_s == b.ceiling_tok_s == pytest.approx(2000.0)
    assert (a.measured_tok_s, b.measured_tok_s) == (1500, pytest.approx(375.0)), "200 steps for 800 tokens"
    with_tpot = drafting.model_copy(update={"median_tpot_ms": 0.8})
    assert decode_steps_from_tpot(with_tpot) == pytest.approx(1250 * 0.25)
    assert decode_steps_from_tpot(plain.model_copy(update={"median_tpot_ms": 0.8})) == pytest.approx(1250)
