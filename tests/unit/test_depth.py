"""06's context-depth axis and prefix-cache pair (issue 41, item 3): the params' limit, the prompts of an exact token
count, the figures from the requests, the comparison of two runs, and the run page's plots."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError
from rundirs import make_run, point
from test_html_injection import Tags, assert_links_stay_inside

from sparkbook.core.analysis import depthsweep
from sparkbook.core.analysis.benchcompare import compare_dirs
from sparkbook.core.analysis.benchstats import RequestRecord, Roofline
from sparkbook.core.analysis.depthsweep import DepthSweep, depth_point, prefix_pair, prefix_setting
from sparkbook.core.values.handoff import BenchmarkSummary
from sparkbook.core.values.params import Params
from sparkbook.core.values.sweeppoint import SweepPoint
from sparkbook.records import compare, pages
from sparkbook.runbook import driver
from sparkbook.runbook.manifest import Manifest
from sparkbook.stages.bench import depth, plot, sweep, tables
from sparkbook.stages.bench.tables import depth_rows, prefix_rows

REPO = Path(__file__).resolve().parents[2]
POOL = list(range(100, 140))


def lab_params(**bench: object) -> dict:
    data = yaml.safe_load((REPO / "params" / "lab.yaml").read_text())
    data["benchmark"].update(bench)
    return data


def test_every_lab_params_file_fits_its_depths_and_the_default_reaches_4096() -> None:
    for name in ("lab.yaml", "lab-hf.yaml", "lab-native.yaml", "lab-ab.yaml"):
        bench = Params.model_validate(yaml.safe_load((REPO / "params" / name).read_text())).benchmark
        assert bench.depths == [0, 1024] and bench.depth_input_len + bench.depth_output_len < 1024, name
    data = lab_params()
    del data["benchmark"]["depths"]
    data["serve"]["max_model_len"] = None
    assert Params.model_validate(data).benchmark.depths == [0, 4096]


def test_left_out_depths_are_the_deepest_that_fit_a_short_window() -> None:
    """A params file that never names benchmark.depths (every one written before 06 measured depth) is no params
    error on a 2048-token window: the default keeps 0 and the deepest of 4096, 2048, 1024, 512, as far as they fit with
    the default prompt and output (512 + 32); named depths are held to the window."""
    data = lab_params()
    for key in ("depths", "depth_input_len", "depth_output_len"):
        del data["benchmark"][key]
    assert Params.model_validate(data).benchmark.depths == [0, 1024]
    data["serve"]["max_model_len"] = 8192
    assert Params.model_validate(data).benchmark.depths == [0, 4096]
    data["serve"]["max_model_len"] = 1000
    assert Params.model_validate(data).benchmark.depths == [0]
    data["serve"]["max_model_len"] = 500
    assert Params.model_validate(data).benchmark.depths == []


def test_a_depth_past_max_model_len_is_refused_naming_the_field_and_what_fits() -> None:
    with pytest.raises(ValidationError) as err:
        Params.model_validate(lab_params(depths=[0, 1024, 2000]))
    msg = str(err.value)
    assert "benchmark.depths: [2000] + depth_input_len 64 + depth_output_len 16" in msg
    assert "serve.max_model_len 2048; the deepest that fits is 1968" in msg


def test_a_depth_prompt_has_exactly_depth_plus_input_tokens_and_each_seed_its_own() -> None:
    a = depth.depth_prompt(POOL, 1024, 64, depth.depth_seed(1024, 0))
    assert len(a) == 1088 and set(a) <= set(POOL)
    assert a != depth.depth_prompt(POOL, 1024, 64, depth.depth_seed(1024, 1))
    assert a == depth.depth_prompt(POOL, 1024, 64, depth.depth_seed(1024, 0)), "the same seed, the same prompt"
    seeds = {depth.depth_seed(d, r) for d in (0, 1024, 4096) for r in (-1, 0, 1, 2)}
    assert len(seeds) == 12 and min(seeds) > 16 * 1000 + 20, "no depth seed is a sweep seed (prompt_seed)"


def test_the_prefix_pair_shares_exactly_its_prefix() -> None:
    first, second = depth.prefix_pair_prompts(POOL, 1024, 64, 5)
    assert len(first) == len(second) == 1088 and first[:1024] == second[:1024]
    assert first[1024] != second[1024], "the suffixes differ from their first token"
    for seed in range(50):  # a one-token pool of two ids: the draw that repeats is turned aside
        a, b = depth.prefix_pair_prompts([1, 2], 8, 1, seed)
        assert a[:8] == b[:8] and a[8] != b[8]


def test_a_deep_request_may_take_its_prefill_and_decode_at_the_slowest_rates() -> None:
    bench = Params.model_validate(lab_params()).benchmark
    assert depth.request_timeout_s(bench, 100_064) == pytest.approx(120 + 100_064 / 200 + 16 / 5)


def record(ttft: float, e2el: float, out: int = 16, prompt: int = 1088) -> RequestRecord:
    return RequestRecord(True, 0.0, ttft, e2el, prompt_tokens=prompt, output_tokens=out)


def test_depth_figures_are_llama_benchys() -> None:
    p = depth_point(1024, 64, 16, [record(0.5, 2.0), record(0.3, 1.8), RequestRecord(False, 0.0, error="HTTP 400")])
    assert p.ttft_ms == pytest.approx(400.0)  # the median of 500 and 300
    assert p.decode_tok_s == pytest.approx(10.0)  # (16 - 1) / (2.0 - 0.5) and (16 - 1) / (1.8 - 0.3)
    assert p.prefill_tok_s == pytest.approx(1088 / 0.4)
    assert p.prompt_tokens == 1088 and p.errors == ["HTTP 400"] and len(p.ttft_ms_repeats) == 2
    assert depthsweep.decode_tok_s(record(0.5, 0.5)) is None and depthsweep.decode_tok_s(record(0.1, 1.0, 1)) is None
    empty = depth_point(0, 64, 16, [RequestRecord(False, 0.0, error="no tokens streamed")])
    assert empty.ttft_ms is None and empty.prefill_tok_s is None and depthsweep.failed(
        DepthSweep(points=[empty], prefix_cache=None)) == 1


@pytest.mark.parametrize(("argv", "said"), [
    (["vllm", "serve", "m"], "not set on the command line (vLLM's default: on)"),
    (["vllm", "serve", "m", "--enable-prefix-caching"], "on (--enable-prefix-caching on the command line)"),
    (["vllm", "serve", "m", "--enable-prefix-caching", "--no-enable-prefix-caching"],
     "off (--no-enable-prefix-caching on the command line)"),
    (["vllm", "serve", "--enable-prefix-caching=false"], "off (--enable-prefix-caching=false on the command line)"),
])
def test_the_servers_argv_says_whether_prefix_caching_is_on(argv: list[str], said: str) -> None:
    assert prefix_setting(argv) == said


def counters(queries: float, hits: float) -> dict[str, float]:
    return {depthsweep.QUERIES: queries, depthsweep.HITS: hits}


def test_the_prefix_cache_pair_is_said_plainly_from_the_servers_counters() -> None:
    cached = prefix_pair(1024, 64, record(0.5, 1.0), record(0.05, 0.6), counters(0, 100), counters(1088, 1120),
                         prefix_setting([]))
    assert cached.ratio == pytest.approx(0.1) and (cached.cached_tokens, cached.queried_tokens) == (1020, 1088)
    assert cached.verdict() == (
        "the second request's TTFT was 0.10x the first's (50.0 ms against 500.0 ms, 1024 shared tokens): the server "
        "served 1020 of its tokens from its prefix cache; prefix caching on the server's command line: not set on "
        "the command line (vLLM's default: on)")
    # the lab's CPU vLLM turns prefix caching off for its MLA model whatever the argv says: no lookup at all, and a
    # ratio of 0.52 from the noise of a shared machine is not taken for a cached prefix
    off = prefix_pair(1024, 64, record(0.45, 1.0), record(0.236, 1.0), counters(0, 0), counters(0, 0),
                      prefix_setting([]))
    assert off.reuse() == "the server looked nothing up in a prefix cache: prefix caching is off on it"
    missed = prefix_pair(1024, 64, record(0.5, 1.0), record(0.5, 1.0), counters(10, 0), counters(1098, 0), "on")
    assert missed.reuse() == "prefix caching is on (the server looked up 1088 tokens) but none was cached"
    blind = prefix_pair(1024, 64, record(0.5, 1.0), record(0.1, 1.0), {}, {}, "x")
    assert blind.cached_tokens is None and blind.reuse() == ("the ratio suggests a cached prefix (the server has "
                                                             "no prefix-cache counters to say)")
    failed = prefix_pair(1024, 64, RequestRecord(False, 0.0, error="HTTP 400: too long"), record(0.1, 1.0), {}, {},
                         "x")
    assert failed.ratio is None and failed.verdict() == "not measured: first: HTTP 400: too long"
    rows = prefix_rows(cached)
    assert [r["TTFT ms"] for r in rows] == [500.0, 50.0] and rows[1]["against the first"] == 0.1
    assert rows[1]["prefix-cache hits (tokens)"] == 1020 and rows[0]["prefix-cache hits (tokens)"] is None


def sweep_of(ttfts: dict[int, list[float]], decode: float = 10.0, ratio: float | None = 0.1) -> DepthSweep:
    points = [depth_point(d, 64, 16, [record(t, t + 15 / decode) for t in ts]) for d, ts in ttfts.items()]
    pair = prefix_pair(max(ttfts), 64, record(1.0, 2.0), record(ratio, 2.0), counters(0, 0), counters(1088, 1000),
                       "x") if ratio else None
    return DepthSweep(points=points, prefix_cache=pair)


def test_two_runs_depths_compare_against_their_repeats_noise(tmp_path: Path) -> None:
    a = sweep_of({0: [0.10, 0.11], 1024: [1.0, 1.02]})
    b = sweep_of({0: [0.10, 0.11], 1024: [2.0, 2.04], 4096: [5.0]}, ratio=0.9)
    deltas = {(d.depth, d.metric): d for d in depthsweep.compare(a, b)}
    assert set(deltas) == {(0, "ttft_ms"), (0, "decode_tok_s"), (1024, "ttft_ms"), (1024, "decode_tok_s")}
    assert deltas[1024, "ttft_ms"].change_pct == pytest.approx(100.0) and deltas[1024, "ttft_ms"].worse
    assert deltas[0, "ttft_ms"].verdict == "within noise"
    assert depthsweep.compare(None, b) == [] and depthsweep.ratios(a, b) == (pytest.approx(0.1), pytest.approx(0.9))
    single = sweep_of({0: [0.1]}), sweep_of({0: [0.2]})
    assert [d.verdict for d in depthsweep.compare(*single)] == ["no noise estimate"] * 2
    lines = depthsweep.delta_lines(depthsweep.compare(a, b), depthsweep.ratios(a, b))
    assert "  d=1024 ttft_ms: 1,010.00 -> 2,020.00  +100.0 %: worse (noise +-2.0 %)" in lines
    assert lines[-1] == "  prefix cache, second TTFT / first: 0.10 -> 0.90"


def test_the_summary_hands_on_the_depths_the_pair_and_their_regressions(tmp_path: Path) -> None:
    a, b = sweep_of({0: [0.10, 0.11], 1024: [1.0, 1.02]}), sweep_of({0: [0.10, 0.11], 1024: [2.0, 2.04]})
    results = [SweepPoint.model_validate(point(1, 100.0))]
    roof = Roofline(1, 2.0, 1, 20.0, 2.0, 0.1, 10.0, None, None, "test")
    s = sweep.summary(results, roof, tmp_path, None, [], b, depthsweep.compare(a, b))
    again = BenchmarkSummary.model_validate_json(s.model_dump_json())
    assert [(d.depth, round(d.ttft_ms or 0)) for d in again.depths] == [(0, 105), (1024, 2020)]
    assert again.prefix_cache and again.prefix_cache.ratio == pytest.approx(0.1)
    assert again.prefix_cache.cached_tokens == 1000 and again.prefix_cache.prefix_tokens == 1024
    assert again.prefix_cache.reuse == "the server served 1000 of its tokens from its prefix cache"
    assert "depth 1024 ttft_ms +100.0%" in again.worse_than_earlier
    old = BenchmarkSummary.model_validate({k: v for k, v in json.loads(s.model_dump_json()).items()
                                          if k not in ("depths", "prefix_cache")})
    assert old.depths == [] and old.prefix_cache is None, "a state.json from before the depth axis still reads"


def test_06s_tables_and_plot_of_the_depths() -> None:
    s = sweep_of({0: [0.1], 1024: [1.0]})
    rows = depth_rows(s)
    assert [(r["depth"], r["prompt tokens (depth + input)"], r["TTFT ms"]) for r in rows] == [(0, 64, 100.0),
                                                                                             (1024, 1088, 1000.0)]
    fig = plot.depth_figure(s)
    ttft_ax = fig.axes[0]
    assert [list(line.get_xdata()) for line in ttft_ax.lines] == [[0, 1024], [1024]], "the cached TTFT at its depth"
    assert tables.depth_rows(DepthSweep(points=[], prefix_cache=None)) == []


def test_the_comparisons_read_the_depth_file_of_both_runs(tmp_path: Path) -> None:
    lab = tmp_path / "lab"
    a = make_run(lab, "20261201T100000Z", points=[point(1, 100.0)])
    b = make_run(lab, "20261201T110000Z", points=[point(1, 100.0)])
    depthsweep.write(a, sweep_of({1024: [1.0, 1.02]}))
    depthsweep.write(b, sweep_of({1024: [2.0, 2.04]}, ratio=0.9))
    ours = compare_dirs(a, b)
    assert [(d.depth, d.metric, d.verdict) for d in ours.depth_deltas] == [(1024, "ttft_ms", "worse"),
                                                                          (1024, "decode_tok_s", "within noise")]
    assert "prefix cache, second TTFT / first: 0.10 -> 0.90" in ours.text() and ours.depth_rows()[0]["depth"] == 1024
    theirs = compare.compare_runs(a, b)
    assert theirs.depth_deltas == ours.depth_deltas
    assert "  d=1024 ttft_ms: 1,010.00 -> 2,020.00  +100.0 %: worse (noise +-2.0 %)" in theirs.text()
    page = pages.compare_page(theirs, tmp_path)
    assert "<h2>Context depth</h2>" in page and "0.10 -&gt; 0.90" in page and '<span class="worse">worse' in page


def test_the_run_page_embeds_the_plots_the_run_dir_holds(tmp_path: Path) -> None:
    run_dir = make_run(tmp_path / "outputs" / "lab", "20261201T100000Z", points=[point(1, 100.0)])
    plain = driver.write_index(run_dir, Manifest.read(run_dir)).read_text()
    assert "Benchmark plots" not in plain, "no plot section without plots"
    for name in ("throughput.png", "latency.png"):
        (run_dir / "bench" / name).write_bytes(b"\x89PNG")
    page = driver.write_index(run_dir, Manifest.read(run_dir)).read_text()
    tags = Tags(page)
    assert [a["src"] for t, a in tags.tags if t == "img"] == ["bench/throughput.png", "bench/latency.png"]
    assert "TTFT, TPOT and ITL by concurrency" in page and "depth.png" not in page
    assert_links_stay_inside(tags, run_dir, also=("../index.html",))
