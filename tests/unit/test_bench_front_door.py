"""06's front door: a preview before any endpoint is known, which arm of an A/B decides, what the notebook shows of
each branch, and the comparison with the earlier run (core.analysis.benchcompare) that the stage and `sparkbook compare`
share."""
from __future__ import annotations

from pathlib import Path

from rundirs import make_run, point

from sparkbook import open_run
from sparkbook.core.analysis import benchcompare
from sparkbook.core.cluster.context import Context
from sparkbook.core.values.evidence import Decision
from sparkbook.core.values.handoff import Endpoint
from sparkbook.core.values.modelinfo import ModelFacts
from sparkbook.core.values.params import Params, Speculative, load_params
from sparkbook.core.values.rundir import AB_BASELINE
from sparkbook.core.values.sweeppoint import SweepPoint, read_points, write_point
from sparkbook.records import archive, compare, pages
from sparkbook.stages import bench
from sparkbook.stages.bench.client import CompletionsServer
from sparkbook.stages.bench.soak import SoakResult

PARAMS = Path(__file__).resolve().parents[2] / "params" / "lab.yaml"
SPEC = Speculative.model_validate({"method": "ngram", "num_speculative_tokens": 3})
FACTS = ModelFacts(architectures=["LlamaForCausalLM"], model_type="llama", dtype="bfloat16", quantization=None,
                   bytes_per_param=2.0, total_params=10**6, active_params=10**6, weight_bytes=2 * 10**6,
                   weight_source="safetensors files", num_layers=2, kv_bytes_per_token=1024, kv_latent=False,
                   dir_on_nodes="/srv/models/tiny")


def _params(speculative: bool = False) -> Params:
    """params/lab.yaml, or with ngram speculation and its A/B (benchmark.ab: speculative)."""
    params = load_params(PARAMS)
    return params.model_copy(update={
        "serve": params.serve.model_copy(update={"speculative": SPEC if speculative else None}),
        "benchmark": params.benchmark.model_copy(update={"ab": "speculative" if speculative else None})})


def _context(tmp_path: Path, speculative: bool = False) -> Context:
    return Context(_params(speculative), None, None, tmp_path)  # type: ignore[arg-type]  # no node is reached


def _point(c: int, *tput: float) -> SweepPoint:
    return SweepPoint.model_validate({"max_concurrency": c, "output_throughput": sorted(tput)[len(tput) // 2],
                                      "total_output_tokens": 1000,
                                      "sparkbook": {"repeats": [{"output_throughput": t} for t in tput]}})


def test_the_preview_before_any_endpoint_shows_the_settings_and_says_the_endpoint_is_not_known(tmp_path):
    preview = bench.preview(_context(tmp_path))
    assert (preview.target, preview.served, preview.model, preview.assumed) == (None, None, None, ())
    [shown] = preview.shown()
    assert shown.title == "Benchmark settings"
    assert shown.value["endpoint"] == "not known yet (05-serve hands it on)"
    assert shown.value["concurrency"] == str(_params().benchmark.concurrency)


def test_only_the_second_arm_of_an_ab_decides(tmp_path):
    results = [_point(1, 138, 140, 141), _point(4, 310, 320, 345)]
    for p in (_point(1, 98, 100, 102), _point(4, 300, 310, 320)):
        write_point(tmp_path / AB_BASELINE, p)
    ctx = _context(tmp_path, speculative=True)
    assert bench.ab_second_arm(ctx, results, None) is None
    assert bench.ab_second_arm(ctx, results, "baseline") is None
    decided = bench.ab_second_arm(ctx, results, "speculative")
    assert decided is not None and decided.verdict.kept == "speculative" and decided.decision.key == "ab"
    titles = [s.title for s in decided.shown()]
    assert titles[0].startswith("Both arms") and titles[1].startswith("Speculative / baseline output tok/s")


def test_what_the_ab_cell_shows_in_each_arm():
    settings = _params().benchmark
    assert [s.value for s in bench.BenchOutcome(settings=settings, ab_arm=None).ab_shown()] == [bench.NO_AB]
    assert [s.value for s in bench.BenchOutcome(settings=settings, ab_arm="baseline").ab_shown()] == \
        [bench.AB_BASELINE_ARM]


def test_the_comparison_with_the_earlier_run_names_params_image_and_each_point(tmp_path):
    lab = tmp_path / "lab"
    a = make_run(lab, "20261201T100000Z", image="img:1", points=[point(1, 100.0), point(8, 500.0)])
    b = make_run(lab, "20261201T110000Z", image="img:2", points=[point(1, 101.0), point(8, 400.0)],
                 params_yaml="cluster: lab\nserve:\n  max_num_seqs: 32\n")
    c = benchcompare.compare_dirs(a, b)
    assert [(x.what, x.a, x.b) for x in c.params] == [("params.serve.max_num_seqs", 16, 32)] and not c.params_note
    assert [(x.what, x.a, x.b) for x in c.image_differences] == [("image", "img:1", "img:2")]
    assert "params:\n  params.serve.max_num_seqs: 16 -> 32" in c.text()
    # the same deltas as `sparkbook compare`, which judges them by the same code
    assert c.deltas == compare.compare_runs(a, b).deltas and c.rows() == compare.delta_rows(c.deltas)
    shown = bench.BenchOutcome(settings=_params().benchmark, earlier_dir=a, comparison=c).comparison_shown()
    assert [s.title for s in shown] == [f"Compared with {a.name}", "Sweep points against the earlier run"]


def test_without_an_earlier_run_the_comparison_says_so():
    [shown] = bench.BenchOutcome(settings=_params().benchmark).comparison_shown()
    assert shown.title == "Compared with nothing"


def test_a_run_without_its_params_file_compares_only_the_points(tmp_path):
    lab = tmp_path / "lab"
    a = make_run(lab, "20261201T100000Z", points=[point(1, 100.0)], params_yaml=None)
    b = make_run(lab, "20261201T110000Z", points=[point(1, 90.0)])
    c = benchcompare.compare_dirs(a, b)
    assert c.params == [] and c.params_note and "20261201T100000Z" in c.params_note
    assert [d.metric for d in c.deltas][:1] == ["output_throughput"]


def test_a_preview_of_a_server_not_up_yet_says_it_did_not_answer(tmp_path):
    """`sparkbook plan` before 05: the endpoint 05 would start is handed on, and nothing listens there yet."""
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    endpoint = Endpoint(base_url=f"http://127.0.0.1:{port}", model="m", executor="mp", commands={}, env={}, logs={},
                        ready_s=0.0, attempts=0, reused=False)
    preview = bench.preview(_context(tmp_path).with_handoffs(endpoint))
    assert preview.served is None and preview.unanswered
    [shown] = preview.shown()
    assert shown.value["server lists"].startswith("no answer: ") and shown.value["endpoint"] == endpoint.base_url


def _measured(monkeypatch, fresh: list[SweepPoint], gpu: str | None = None) -> list[str]:
    """06's remote steps replaced by values: the sweep measures `fresh`, the head reports `gpu` (None: no card), no
    soak runs; the steps called, in order."""
    called: list[str] = []
    monkeypatch.setattr(bench.sweep, "gpu_name", lambda head: gpu)
    monkeypatch.setattr(bench.sweep, "run_sweep", lambda target, s, on_point, nodes: called.append("sweep") or [])
    monkeypatch.setattr(bench.sweep, "saved_points", lambda points, target, s, clients: fresh)
    monkeypatch.setattr(bench.sweep, "load_generator_verdict",
                        lambda points, clients: Decision("Were the load generators the bottleneck?", "no", "idle"))
    monkeypatch.setattr(bench.tables, "cross_check_rows", lambda points, s: [])
    monkeypatch.setattr(bench, "run_soak", lambda ctx, target, bench_dir, arm: called.append(f"soak {bench_dir}")
                        or SoakResult(ctx.params.benchmark, "no soak"))
    return called


class NoNodes(list[object]):
    """A cluster without nodes: 06's steps that would reach one are replaced."""

    head = None


def _run_ctx(params_file: Path, run_dir: Path, bandwidth_gbs: float | None = 20.0) -> Context:
    """The params without depths, benchmark.memory_bandwidth_gbs as given (lab.yaml's 20; None: from the card)."""
    params = load_params(params_file)
    params = params.model_copy(update={"benchmark": params.benchmark.model_copy(
        update={"depths": [], "memory_bandwidth_gbs": bandwidth_gbs})})
    return Context(params, NoNodes(), None, run_dir)  # type: ignore[arg-type]  # no node is reached


def test_run_writes_nothing_and_compares_its_fresh_points_as_sparkbook_compare_does(tmp_path, monkeypatch):
    lab = tmp_path / "lab"
    a = make_run(lab, "20261201T100000Z", points=[point(1, 100.0), point(8, 500.0)])
    b = make_run(lab, "20261201T110000Z", image="img:2", points=[])  # this run: its params and image, no points yet
    fresh = [SweepPoint.model_validate(point(1, 101.0)), SweepPoint.model_validate(point(8, 400.0))]
    called = _measured(monkeypatch, fresh)
    ctx = _run_ctx(PARAMS, b)
    preview = bench.BenchPreview(ctx.params.benchmark, CompletionsServer("http://x:8000", "m"), None, FACTS, None)
    session = open_run(PARAMS, b, stage="06-benchmark")
    kept: list[tuple[list[SweepPoint], object]] = []
    keep = lambda points, depth: kept.append((points, depth)) or called.append("keep")  # noqa: E731
    out = bench.run(ctx, preview, ab_arm=None, bench_root=session.bench_root, earlier=session.earlier_sweep(),
                    keep=keep)
    assert called == ["sweep", "keep", f"soak {b / 'bench'}"], "the points are handed to keep before the soak"
    assert kept == [(fresh, None)] and list((b / "bench").iterdir()) == [], "the stage wrote none itself"
    assert out.results == fresh and out.paths == [b / "bench" / "c0001.json", b / "bench" / "c0008.json"]
    assert out.earlier_dir == a and out.summary is not None and out.summary.compared_with == str(a)
    assert out.comparison is not None and [(d.max_concurrency, round(d.change_pct, 1)) for d in out.comparison.deltas
                                           if d.metric == "output_throughput"] == [(1, 1.0), (8, -20.0)]
    assert session.keep_sweep(out.results, out.depth) == out.paths
    assert read_points(b) == fresh and out.comparison == benchcompare.compare_dirs(a, b), \
        "kept as the files hold them, and judged as `sparkbook compare` judges the two runs"


def test_the_baseline_arm_keeps_its_points_apart_and_compares_with_no_earlier_run(tmp_path, monkeypatch):
    lab = tmp_path / "lab"
    make_run(lab, "20261201T100000Z", points=[point(1, 100.0)])
    b = make_run(lab, "20261201T110000Z", points=[])
    called = _measured(monkeypatch, [SweepPoint.model_validate(point(1, 60.0))])
    ctx = _run_ctx(PARAMS, b)
    preview = bench.BenchPreview(ctx.params.benchmark, CompletionsServer("http://x:8000", "m"), None, FACTS, None)
    session = open_run(PARAMS, b, stage="06-benchmark")
    session.ab_arm = "baseline"  # as open_run sets it for params with an A/B
    out = bench.run(ctx, preview, ab_arm="baseline", bench_root=session.bench_root, earlier=session.earlier_sweep(),
                    keep=session.keep_sweep)
    assert read_points(b / AB_BASELINE) == [SweepPoint.model_validate(point(1, 60.0))], "kept before the soak"
    assert out.bench_dir == f"{AB_BASELINE}/bench" and called[-1] == f"soak {b / AB_BASELINE / 'bench'}"
    assert out.comparison is None and out.summary is not None and out.summary.compared_with is None
    assert [s.value for s in out.comparison_shown()] == [bench.NOT_COMPARED_IN_BASELINE]
    assert out.paths == [b / AB_BASELINE / "bench" / "c0001.json"]


def _bench(tmp_path: Path, monkeypatch, gpu: str | None, bandwidth_gbs: float | None) -> tuple[Path, bench.BenchOutcome]:
    """06 run on a head that reports `gpu`, with benchmark.memory_bandwidth_gbs `bandwidth_gbs`, and recorded."""
    b = make_run(tmp_path / "lab", "20261201T110000Z", points=[])
    _measured(monkeypatch, [SweepPoint.model_validate(point(1, 60.0))], gpu=gpu)
    ctx = _run_ctx(PARAMS, b, bandwidth_gbs)
    preview = bench.BenchPreview(ctx.params.benchmark, CompletionsServer("http://x:8000", "m"), None, FACTS, None)
    session = open_run(PARAMS, b, stage="06-benchmark")
    out = bench.run(ctx, preview, ab_arm=None, bench_root=session.bench_root, earlier=None, keep=session.keep_sweep)
    session.record_outcome(out)
    return b, out


def test_the_roofline_uses_the_card_the_head_reports_and_says_so(tmp_path, monkeypatch):
    b, out = _bench(tmp_path, monkeypatch, "NVIDIA H100 80GB HBM3", None)
    assert out.bandwidth is not None and out.bandwidth.gbs == 3350.0 and out.roof is not None
    assert out.roof.node_bandwidth_gbs == 3350.0 and out.step is not None and out.step.node_bandwidth_gbs == 3350.0
    assert "3350 GB/s from the table entry for NVIDIA H100 80GB HBM3 (H100 SXM datasheet)" in \
        out.roofline_shown()[0].title and len(out.roofline_shown()) == 1, "no finding where nothing disagrees"
    assert archive.read_run(b).findings == []


def test_an_override_far_from_the_reported_card_is_a_finding_on_the_run_page(tmp_path, monkeypatch):
    b, out = _bench(tmp_path, monkeypatch, "NVIDIA H100 80GB HBM3", 4800.0)
    assert out.roof is not None and out.roof.node_bandwidth_gbs == 4800.0, "the override is used"
    assert "4800 GB/s from the override in params" in out.roofline_shown()[0].title
    said = out.roofline_shown()[1].value
    assert isinstance(said, str) and "+43 % from the 3350 GB/s of the NVIDIA H100 80GB HBM3" in said
    (found,) = archive.read_run(b).findings
    assert (found["severity"], found["topic"], found["text"]) == ("warning", "bandwidth", said)
    assert pages.e(said) in pages.run_page(archive.read_run(b)), "one line in the run page's findings"


def test_a_card_the_table_lacks_without_an_override_gets_no_roofline_and_says_why(tmp_path, monkeypatch):
    b, out = _bench(tmp_path, monkeypatch, "NVIDIA Quadro K2200", None)
    assert out.roof is None and out.step is None and out.ceilings == [] and out.ceiling_formula == ""
    assert out.summary is not None and out.summary.roofline_ceiling_tok_s is None
    (shown,) = out.roofline_shown()
    assert shown.value == ("not computed: unknown card 'NVIDIA Quadro K2200' (not in the table of known cards): no "
                           "roofline; set benchmark.memory_bandwidth_gbs for one")
    assert archive.read_run(b).roofline_pct is None and archive.read_run(b).findings == []
