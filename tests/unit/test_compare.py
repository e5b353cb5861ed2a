"""`sparkbook compare`: params, image and versions, decisions and figures of two runs, as text and a page; the
committed GPU records compared."""
from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
from committed import examples
from rundirs import make_run, point

from sparkbook import cli
from sparkbook.core.analysis import benchcompare
from sparkbook.core.analysis.benchstats import ACROSS_SETUPS, SINGLE_STREAM
from sparkbook.core.analysis.depthsweep import DepthDelta
from sparkbook.core.values.sweeppoint import read_points
from sparkbook.records import archive, compare, pages
from sparkbook.stages.bench import sweep

REPO = Path(__file__).resolve().parents[2]
IMAGE = {"03": [{"question": "Which image serves X?", "choice": "img:1", "reason": "r", "alternatives": []}]}


@pytest.fixture
def two_runs(tmp_path: Path) -> tuple[Path, Path]:
    lab = tmp_path / "lab"
    a = make_run(lab, "20261201T100000Z", image="img:1", image_id="sha256:1", decisions=IMAGE,
                 points=[point(1, 100.0), point(8, 500.0)],
                 events=[{"at": "t", "stage": "06-benchmark", "kind": "roofline",
                          "data": {"roofline": {"percent_of_ceiling": 10.0}}}])
    b = make_run(lab, "20261201T110000Z", image="img:2", image_id="sha256:2",
                 decisions={"03": [{**IMAGE["03"][0], "choice": "img:2"}]},
                 points=[point(1, 101.0), point(8, 400.0)],
                 params_yaml="cluster: lab\nserve:\n  max_num_seqs: 32\n")
    return a, b


def test_params_image_decisions_and_figures_that_changed(two_runs: tuple[Path, Path]) -> None:
    c = compare.compare_runs(*two_runs)
    assert [(x.what, x.a, x.b) for x in c.params] == [("params.serve.max_num_seqs", 16, 32)] and not c.params_note
    changed = {x.what: (x.a, x.b) for x in c.setup if x.differs}
    assert changed == {"image": ("img:1", "img:2"), "image id": ("sha256:1", "sha256:2")}
    assert [(x.what, x.a, x.b) for x in c.decisions] == [("03: Which image serves X?", "img:1", "img:2")]
    figures = {f.name: f for f in c.figures}
    assert figures["peak tok/s"].change_pct == pytest.approx(-20.0)
    assert figures[SINGLE_STREAM].change_pct == pytest.approx(1.0)
    assert figures["% of roofline"].b is None and figures["% of roofline"].change_pct is None
    throughput = {d.max_concurrency: d for d in c.deltas if d.metric == "output_throughput"}
    assert {throughput[8].noise_pct, throughput[1].noise_pct} == {None}  # no repeats, no earlier runs
    text = c.text()
    assert "image: img:1 -> img:2  (changed)" in text and "vllm: 0.32.0  (same)" in text
    assert "c=8 output_throughput: 500.00 -> 400.00  -20.0 %: different setups: not judged" in text
    assert ("no noise estimate (no repeats in either run and no earlier runs of the same params and image): such "
            "changes are not judged") in text
    assert "sweep points" not in c.text(sweep=False)


def test_a_run_without_its_params_file_compares_only_the_parameters(tmp_path: Path) -> None:
    a = make_run(tmp_path / "lab", "20261201T100000Z", params_yaml=None)
    b = make_run(tmp_path / "lab", "20261201T110000Z", params_yaml="cluster: other\n")
    c = compare.compare_runs(a, b)
    assert c.params == [] and "20261201T100000Z did not keep their params file" in c.params_note


def test_the_page_links_both_runs(two_runs: tuple[Path, Path], tmp_path: Path) -> None:
    a, b = two_runs
    for run_dir in two_runs:
        (run_dir / "index.html").write_text("run")
    page = pages.write_compare(compare.compare_runs(a, b), tmp_path / "elsewhere" / "c.html")
    hrefs = re.findall(r'href="([^"]+)"', page.read_text())
    assert len(hrefs) == 2 and all((page.parent / h).resolve().exists() for h in hrefs)
    assert "no noise estimate" in page.read_text() and "params.serve.max_num_seqs" in page.read_text()


def test_the_cli_finds_runs_by_id_and_writes_the_page(two_runs: tuple[Path, Path], tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["compare", "20261201T100000Z", "20261201T110000Z", "--outputs", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "params.serve.max_num_seqs: 16 -> 32" in out
    assert (tmp_path / "lab" / "compare" / "20261201T100000Z-vs-20261201T110000Z.html").exists()
    committed = tmp_path / "outputs" / "examples"
    committed.mkdir(parents=True)
    shutil.rmtree(tmp_path / "lab" / "compare")
    (tmp_path / "lab").rename(committed / "lab")
    assert cli.main(["compare", "20261201T100000Z", "20261201T110000Z", "--outputs", str(committed)]) == 0
    assert (tmp_path / "outputs" / "lab" / "compare" / "20261201T100000Z-vs-20261201T110000Z.html").exists()
    assert not (committed / "lab" / "compare").exists(), "never into the committed records"
    assert cli.main(["compare", "20261201T100000Z", "29990101T000000Z", "--outputs", str(tmp_path)]) == 1
    assert "no run dir of that id" in capsys.readouterr().err


def test_the_committed_gpu_records_ray_against_mp() -> None:
    c = compare.compare_runs(examples() / "h200-duo/20261130T144302Z",
                          examples() / "h200-duo-mp/20261130T161541Z")
    assert [(x.a, x.b) for x in c.setup if x.what == "executor"] == [("ray", "mp")]
    assert [(x.what, x.a, x.b) for x in c.setups.plan][-1] == ("executor", "ray", "mp"), "a plan of its own"
    assert [x.what for x in c.decisions] == ["05: Which distributed executor serves the model?"]
    c64 = next(d for d in c.deltas if d.max_concurrency == 64 and d.metric == "output_throughput")
    assert (round(c64.earlier, 1), round(c64.now, 1), round(c64.change_pct, 1)) == (3405.6, 5536.5, 62.6)


def test_flatten_names_nested_keys() -> None:
    assert compare.flatten({"a": {"b": [1, {"c": 2}]}, "d": {}, "e": []}) == {"a.b[0]": 1, "a.b[1].c": 2}


def test_a_baseline_with_bench_results_only_still_compares_its_points(two_runs: tuple[Path, Path]) -> None:
    a, b = two_runs
    for name in ("manifest.json", "state.json", "events.jsonl"):
        (a / name).unlink()
    c = compare.compare_runs(a, b)
    assert c.a.kind == "unreadable" and "no manifest.json" in c.a.status
    assert {d.max_concurrency for d in c.deltas} == {1, 8}
    assert not any(x.differs for x in c.setup)  # nothing recorded for A: no change claimed


def test_earlier_runs_of_the_same_params_and_image_give_the_band(tmp_path: Path) -> None:
    """Runs without repeats: the band is the spread of the figure over the runs before both, with B's params and
    image (A and B themselves left out); a run of other params does not count."""
    lab = tmp_path / "lab"
    for run_id, tok_s in (("20261201T080000Z", 100.0), ("20261201T090000Z", 104.0)):
        make_run(lab, run_id, points=[point(1, tok_s)])
    make_run(lab, "20261201T093000Z", points=[point(1, 300.0)], params_yaml="cluster: lab\nother: 1\n")
    a = make_run(lab, "20261201T100000Z", points=[point(1, 102.0)])
    b = make_run(lab, "20261201T110000Z", points=[point(1, 92.0)])
    d = next(d for d in compare.compare_runs(a, b).deltas if d.metric == "output_throughput")
    assert d.noise_from == "earlier runs" and d.noise_pct == pytest.approx(100.0 * 4.0 / 102.0)
    assert d.verdict == "worse"  # -9.8 % outside +-3.9 %
    assert "c=1 output_throughput: 102.00 -> 92.00  -9.8 %: worse (noise +-3.9 % from earlier runs)" in \
        compare.compare_runs(a, b).text()


def test_the_committed_ok_lab_runs_claim_no_band_wider_than_their_repeats(tmp_path: Path) -> None:
    """Issue 31: bands of +-627.9 % came from single requests. These runs have one repeat per point and no earlier
    run of their params: no estimate, said plainly, nothing called worse or better; the page goes under compare/."""
    a, b = examples() / "lab/20261130T150551Z", examples() / "lab/20261201T195946Z"
    c = compare.compare_runs(a, b)
    assert c.deltas and all(d.noise_pct is None for d in c.deltas)
    assert c.setups.plan == [] and [x.what for x in c.setups.image] == ["image id"], "the image was rebuilt"
    assert "WORSE" not in c.text() and "worse" not in {d.verdict for d in c.deltas}
    page = f"lab/compare/{a.name}-vs-{b.name}.html"
    assert compare.page_path(c.a, c.b, examples().parent) == examples().parent / page, "not into the committed tree"
    assert compare.page_path(c.a, c.b, tmp_path) == tmp_path / page


def test_compare_of_any_examples_tree_writes_under_the_commands_outputs_never_beside_it(tmp_path: Path) -> None:
    """Issue 56: a tree named examples anywhere (a checkout of another project) is not written beside."""
    tree = tmp_path / "elsewhere" / "examples" / "lab"
    a, b = make_run(tree, "20261201T100000Z", points=[point(1, 100.0)]), make_run(tree, "20261201T110000Z")
    c = compare.compare_runs(a, b)
    page = compare.page_path(c.a, c.b, tmp_path / "outputs")
    assert page == tmp_path / "outputs" / "lab" / "compare" / f"{a.name}-vs-{b.name}.html"
    own = make_run(tmp_path / "outputs" / "lab", "20261201T120000Z")
    assert compare.page_path(c.a, compare.compare_runs(a, own).b, tmp_path / "outputs").parent == own.parent / "compare"


def test_the_layout_stands_beside_the_image_and_executor(tmp_path: Path) -> None:
    """serve.layout from each run's params copy: "tp" where they name none (runs before the field), "-" where the run
    kept no params; in the cluster index's row, the run's page and `compare`."""
    lab = tmp_path / "lab"
    a = make_run(lab, "20261201T100000Z", params_yaml="cluster: lab\nserve:\n  max_num_seqs: 16\n")
    b = make_run(lab, "20261201T110000Z", params_yaml="cluster: lab\nserve:\n  layout: replicas\n")
    none = make_run(lab, "20261201T120000Z", params_yaml=None)
    ra, rb, rn = (archive.read_run(d) for d in (a, b, none))
    assert (ra.layout, rb.layout, rn.layout) == ("tp", "replicas", None)
    row = archive.row(rb)
    assert list(row)[list(row).index("executor") + 1] == "layout" and row["layout"] == "replicas"
    assert archive.row(rn)["layout"] == "-"
    c = compare.compare_runs(a, b)
    assert [(x.what, x.a, x.b) for x in c.setup][-2:] == [("executor", "mp", "mp"), ("layout", "tp", "replicas")]
    assert "  layout: tp -> replicas  (changed)" in c.text()
    assert {"figure": "layout (serve.layout)", "value": "replicas"} in pages.key_figures(rb)
    assert "<th>layout</th>" in pages.cluster_page("lab", [rb, ra])


def test_runs_of_other_plans_and_images_say_so_first_and_call_no_change_worse(two_runs: tuple[Path, Path],
                                                                            tmp_path: Path) -> None:
    c = compare.compare_runs(*two_runs)
    said = ("These runs differ in plan (serve.max_num_seqs 16 -> 32) and image (image img:1 -> img:2, image id "
            "sha256:1 -> sha256:2): their figures are not a regression test of each other")
    assert c.setups.line() == said and c.text().splitlines()[0] == said
    assert {d.verdict for d in c.deltas} == {ACROSS_SETUPS} and "worse" not in c.text()
    c8 = next(d for d in c.deltas if d.max_concurrency == 8 and d.metric == "output_throughput")
    assert (c8.earlier, c8.now, c8.change_pct) == (500.0, 400.0, -20.0), "the deltas themselves are kept"
    page = pages.write_compare(c, tmp_path / "c.html").read_text()
    assert page.index(pages.e(said)) < page.index("<p>A: "), "at the top of the page"
    assert 'class="worse"' not in page and 'class="better"' not in page


def _redeploy(lab: Path, b_params: str) -> tuple[Path, Path]:
    """Runs A and B of one image, B's params `b_params`, with two earlier runs of B's params for the noise band
    (+-4 %): B's TTFT at c=4 is +109 % on A's."""
    for run_id, ttft in (("20261201T080000Z", 50.0), ("20261201T090000Z", 52.0)):
        make_run(lab, run_id, points=[point(4, 400.0, ttft)], params_yaml=b_params)
    a = make_run(lab, "20261201T100000Z", points=[point(4, 400.0, 50.0)],
                 params_yaml="cluster: lab\nserve:\n  max_num_seqs: 128\n")
    return a, make_run(lab, "20261201T110000Z", points=[point(4, 400.0, 104.5)], params_yaml=b_params)


def test_a_redeploy_with_another_max_num_seqs_is_no_regression_of_the_plan_before(tmp_path: Path) -> None:
    """Issue 57: a redeploy with max_num_seqs 64 showed '+109 % TTFT at c=4' beside the run of 128 as if it were
    a regression."""
    a, b = _redeploy(tmp_path / "lab", "cluster: lab\nserve:\n  max_num_seqs: 64\n")
    c = compare.compare_runs(a, b)
    ttft = next(d for d in c.deltas if d.max_concurrency == 4 and d.metric == "median_ttft_ms")
    assert round(ttft.change_pct) == 109 and ttft.noise_pct is not None and ttft.verdict == ACROSS_SETUPS
    assert c.text().startswith("These runs differ in plan (serve.max_num_seqs 128 -> 64): their figures are not a "
                               "regression test of each other\n")
    assert "c=4 median_ttft_ms: 50.00 -> 104.50  +109.0 %: different setups: not judged" in c.text()
    ours = benchcompare.compare_dirs(a, b)
    assert ours.text().startswith(c.text().splitlines()[0]) and ours.deltas == c.deltas, "06 says the same"
    assert sweep.summary(read_points(b), None, b, a, ours.deltas).worse_than_earlier == [], \
        "06's summary names no regression"


def test_runs_that_differ_only_in_benchmark_settings_are_judged_as_before(tmp_path: Path) -> None:
    params = "cluster: lab\nserve:\n  max_num_seqs: 128\nbenchmark:\n  num_prompts: 64\n  repeats: 1\n"
    a, b = _redeploy(tmp_path / "lab", params)
    c = compare.compare_runs(a, b)
    assert c.setups.line() is None and not c.text().startswith("These runs")
    assert [x.what for x in c.params] == ["params.benchmark.num_prompts", "params.benchmark.repeats"]
    ttft = next(d for d in c.deltas if d.max_concurrency == 4 and d.metric == "median_ttft_ms")
    assert ttft.verdict == "worse", "+109 % outside +-4 %: the same plan, a regression"


def test_what_shapes_serving_among_the_params() -> None:
    serving = ["serve.max_num_seqs", "serve.max_model_len", "serve.dtype", "serve.tensor_parallel_size",
               "serve.speculative.method", "serve.extra_args[0]", "model.path", "model.hf_id", "nodes[0].gpus[1]",
               "runtime.env.NCCL_IB_HCA"]
    other = ["serve.smoke.prompt", "serve.quality.depths[0]", "serve.port", "serve.ready_timeout_s",
             "serve.max_remedies", "model.cache_dir", "nodes[0].host", "benchmark.concurrency[0]", "cluster"]
    assert [k for k in serving + other if benchcompare.serving(k)] == serving


def test_depth_changes_between_setups_are_not_judged_either() -> None:
    d = DepthDelta(1024, "ttft_ms", 100.0, 200.0, 100.0, 2.0)
    assert d.verdict == "worse"
    (across,) = benchcompare.judged([d], benchcompare.Setups([compare.Change("serve.dtype", "auto", "float16")], []))
    assert across.verdict == ACROSS_SETUPS and not across.worse and across.change_pct == 100.0
    assert benchcompare.judged([d], benchcompare.Setups([], [])) == [d], "the same setup: judged as before"
