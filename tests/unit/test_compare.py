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
from sparkbook.core.analysis.benchstats import SINGLE_STREAM
from sparkbook.records import archive, compare, pages

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
    assert {throughput[8].verdict, throughput[1].verdict} == {"no noise estimate"}  # no repeats, no earlier runs
    text = c.text()
    assert "image: img:1 -> img:2  (changed)" in text and "vllm: 0.32.0  (same)" in text
    assert "c=8 output_throughput: 500.00 -> 400.00  -20.0 %: no noise estimate" in text
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
    assert c.deltas and all(d.noise_pct is None and d.verdict == "no noise estimate" for d in c.deltas)
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
