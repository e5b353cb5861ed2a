"""Benchmark statistics against hand-computed values: vLLM's definitions, roofline, cross-check, comparison."""
from __future__ import annotations

import pytest

from sparkbook.core.analysis.benchstats import (
    RequestRecord,
    client_load,
    compare,
    cross_check,
    describe_ms,
    prometheus_totals,
    roofline,
    served_bytes_per_param,
    summarize,
    token_gaps,
    tpot_s,
)
from sparkbook.core.values.benchbudget import point_timeout_s
from sparkbook.core.values.params import BenchmarkSettings
from sparkbook.core.values.rundir import earlier_run
from sparkbook.core.values.sweeppoint import SweepPoint
from sparkbook.stages.bench.sweep import split


def rec(ttft: float, gaps: list[float], tokens: int, counts: list[int] | None = None, sent: float = 0.0,
        prompt: int = 64) -> RequestRecord:
    return RequestRecord(True, sent, ttft, ttft + sum(gaps), gaps, counts or [], prompt, tokens)


def test_tpot_is_vllms_definition():
    r = rec(0.5, [0.1, 0.1, 0.2], tokens=4)
    assert tpot_s(r) == pytest.approx((0.9 - 0.5) / 3)
    assert tpot_s(rec(0.5, [], tokens=1)) is None


def test_itl_per_token_splits_multi_token_chunks_and_carries_empty_ones():
    r = rec(0.5, [0.1, 0.3, 0.05, 0.2], tokens=6, counts=[1, 3, 0, 1])
    assert token_gaps(r) == pytest.approx([0.1, 0.1, 0.1, 0.1, 0.25])
    assert token_gaps(rec(0.5, [0.1, 0.2], tokens=3)) == pytest.approx([0.1, 0.2])


def test_describe_matches_numpy_conventions():
    stats = describe_ms([0.001, 0.002, 0.003, 0.004], "x")
    assert stats["mean_x_ms"] == pytest.approx(2.5)
    assert stats["median_x_ms"] == pytest.approx(2.5)
    assert stats["std_x_ms"] == pytest.approx(1.118034, rel=1e-6)   # population std, as np.std
    assert stats["p90_x_ms"] == pytest.approx(3.7)                   # linear interpolation
    assert stats["p99_x_ms"] == pytest.approx(3.97)
    assert describe_ms([], "x")["p99_x_ms"] is None


def test_summarize_uses_vllm_field_names_and_counts():
    records = [rec(0.1, [0.01] * 9, tokens=10, sent=0.0), rec(0.2, [0.02] * 9, tokens=10, sent=0.0),
               RequestRecord(False, 0.0, error="HTTP 500")]
    s = summarize(records, duration_s=2.0, max_concurrency=2)
    assert (s.completed, s.failed, s.num_prompts) == (2, 1, 3)
    assert (s.total_input_tokens, s.total_output_tokens) == (128, 20)
    assert s.output_throughput == pytest.approx(10.0)
    assert s.request_throughput == pytest.approx(1.0)
    assert s.median_ttft_ms == pytest.approx(150.0)
    assert s.mean_tpot_ms == pytest.approx(15.0)
    assert s.median_itl_ms == pytest.approx(15.0)          # 9 gaps of 10 ms and 9 of 20 ms
    assert s.mean_e2el_ms == pytest.approx((190 + 380) / 2)
    for key in ("p90_itl_per_token_ms", "p99_e2el_ms", "std_tpot_ms", "duration", "max_concurrency"):
        assert key in s.to_json()


def test_prometheus_totals_sum_label_sets_and_skip_comments():
    text = ('# HELP vllm:generation_tokens_total Number of generation tokens.\n'
            '# TYPE vllm:generation_tokens_total counter\n'
            'vllm:generation_tokens_total{engine="0",model_name="m"} 1200.0\n'
            'vllm:generation_tokens_total{engine="1",model_name="m"} 34.0\n'
            'vllm:num_requests_running{model_name="m"} 2.0\n'
            'process_cpu_seconds_total 5.5\n')
    totals = prometheus_totals(text)
    assert totals["vllm:generation_tokens_total"] == 1234.0
    assert totals["process_cpu_seconds_total"] == 5.5


# An excerpt of a vLLM (V1 engine) /metrics page as its prometheus_client exposes it.
VLLM_METRICS = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="hy-v4"} 3.0
# HELP vllm:prompt_tokens_total Number of prefill tokens processed.
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{engine="0",model_name="hy-v4"} 4096.0
# HELP vllm:prompt_tokens_created Number of prefill tokens processed.
# TYPE vllm:prompt_tokens_created gauge
vllm:prompt_tokens_created{engine="0",model_name="hy-v4"} 1.764594e+09
# HELP vllm:generation_tokens_total Number of generation tokens processed.
# TYPE vllm:generation_tokens_total counter
vllm:generation_tokens_total{engine="0",model_name="hy-v4"} 2048.0
# HELP vllm:request_success_total Count of successfully processed requests.
# TYPE vllm:request_success_total counter
vllm:request_success_total{engine="0",finished_reason="stop",model_name="hy-v4"} 12.0
vllm:request_success_total{engine="0",finished_reason="length",model_name="hy-v4"} 20.0
vllm:request_success_total{engine="0",finished_reason="abort",model_name="hy-v4"} 0.0
# HELP vllm:e2e_request_latency_seconds Histogram of e2e request latency in seconds.
# TYPE vllm:e2e_request_latency_seconds histogram
vllm:e2e_request_latency_seconds_bucket{engine="0",le="0.3",model_name="hy-v4"} 0.0
vllm:e2e_request_latency_seconds_bucket{engine="0",le="2.5",model_name="hy-v4"} 25.0
vllm:e2e_request_latency_seconds_bucket{engine="0",le="+Inf",model_name="hy-v4"} 32.0
vllm:e2e_request_latency_seconds_count{engine="0",model_name="hy-v4"} 32.0
vllm:e2e_request_latency_seconds_sum{engine="0",model_name="hy-v4"} 61.25
# HELP python_gc_objects_collected_total Objects collected during gc
# TYPE python_gc_objects_collected_total counter
python_gc_objects_collected_total{generation="0"} 9123.0
python_gc_objects_collected_total{generation="1"} 877.0
"""


def test_prometheus_totals_of_a_vllm_metrics_page():
    totals = prometheus_totals(VLLM_METRICS)
    assert totals["vllm:prompt_tokens_total"] == 4096.0
    assert totals["vllm:generation_tokens_total"] == 2048.0
    assert totals["vllm:request_success_total"] == 32.0
    assert totals["vllm:e2e_request_latency_seconds_sum"] == 61.25
    assert totals["vllm:e2e_request_latency_seconds_count"] == 32.0
    assert totals["vllm:num_requests_running"] == 3.0
    assert totals["python_gc_objects_collected_total"] == 10000.0


def test_cross_check_compares_counter_deltas():
    checks = cross_check({"a": 100.0}, {"a": 164.0, "b": 5.0}, {"a": 64, "b": 6, "c": 1})
    assert [(c.metric, c.server, c.agrees) for c in checks] == [("a", 64.0, True), ("b", 5.0, False),
                                                                 ("c", None, False)]


def test_roofline_of_the_gpu_facts_example():
    # ~3.3 B active params x 2 bytes over TP=2 at 4.3 TB/s -> ~0.77 ms/token -> ~1300 tok/s; 246 measured ~19 %
    r = roofline(3_300_000_000, 2.0, 2, 4300.0, measured_tok_s=246.0)
    assert r.seconds_per_token * 1000 == pytest.approx(0.767, abs=0.001)
    assert r.ceiling_tok_s == pytest.approx(1303, abs=1)
    assert r.percent_of_ceiling == pytest.approx(18.9, abs=0.1)
    assert "2 node(s)" in r.assumption


def test_served_dtype():
    assert served_bytes_per_param(2.0, "float32") == 4.0
    assert served_bytes_per_param(0.5, "auto") == 0.5


def point(conc: int, tput: float, ttft: float, std: float, n: int = 32) -> SweepPoint:
    return SweepPoint(max_concurrency=conc, completed=n, output_throughput=tput, median_ttft_ms=ttft,
                      std_ttft_ms=std)


def test_compare_never_takes_noise_from_single_requests():
    """Issue 31: bands of +-627 % came from the spread of single requests; without repeats or earlier runs there
    is no estimate, and no change is called worse or better."""
    earlier = [point(1, 100.0, 50.0, 1.0), point(8, 400.0, 80.0, 40.0)]
    now = [point(1, 90.0, 53.0, 1.0), point(8, 440.0, 95.0, 40.0), point(16, 500.0, 100.0, 1.0)]
    deltas = {(d.max_concurrency, d.metric): d for d in compare(now, earlier, ["output_throughput", "median_ttft_ms"])}
    assert len(deltas) == 4                                       # c=16 has nothing to compare with
    assert deltas[(1, "output_throughput")].change_pct == pytest.approx(-10.0)
    assert {d.verdict for d in deltas.values()} == {"no noise estimate"}
    assert all(d.noise_pct is None and not d.worse for d in deltas.values())
    history = {(1, "output_throughput"): 6.5, (8, "median_ttft_ms"): 25.0}
    deltas = {(d.max_concurrency, d.metric): d for d in compare(now, earlier, ["output_throughput", "median_ttft_ms"],
                                                                history)}
    assert deltas[(1, "output_throughput")].verdict == "worse"    # -10 % beyond the earlier runs' 6.5 %
    assert deltas[(1, "output_throughput")].noise_from == "earlier runs"
    assert deltas[(8, "median_ttft_ms")].verdict == "within noise"  # +18.75 % inside 25 %
    assert deltas[(1, "median_ttft_ms")].verdict == "no noise estimate"


def test_client_ceiling_is_tokens_per_cpu_second():
    load = client_load(0, tokens=1000, chunks=1000, cpu_s=0.5, wall_s=2.0)
    assert load.ceiling_tok_s == 2000.0 and load.cpu_utilization == 0.25


def test_split_concurrency_between_engines():
    assert split(8, 2) == [4, 4] and split(5, 2) == [3, 2] and split(1, 2) == [1, 0]


def test_earlier_run_is_newest_sibling_with_results(tmp_path):
    import os
    for name, mtime in (("20260101T000000Z", 1000), ("20260102T000000Z", 2000), ("empty", 3000)):
        (tmp_path / name / "bench").mkdir(parents=True)
        if name != "empty":
            f = tmp_path / name / "bench" / "c0001.json"
            f.write_text("{}")
            os.utime(f, (mtime, mtime))
    current = tmp_path / "20260103T000000Z"
    current.mkdir()
    assert earlier_run(current) == tmp_path / "20260102T000000Z"
    assert earlier_run(tmp_path / "20260102T000000Z") == tmp_path / "20260101T000000Z"


def test_a_point_timeout_scales_with_the_plan() -> None:
    """06 at the seed's single-stream rate (27 tok/s): 32 prompts x 1024 tokens one at a time take ~1,200 s, more
    than a fixed 600 s; the timeout allows rounds of requests at SLOWEST_DECODE_TOK_S (issue 22, item 6)."""
    seed = BenchmarkSettings(input_len=1024, output_len=1024, num_prompts=32, warmup_requests=2, concurrency=[1, 16])
    single = point_timeout_s(seed, 1)
    assert single > 32 * 1024 / 27 and single == pytest.approx(120 + 34 * 1024 / 5)
    assert point_timeout_s(seed, 16) == pytest.approx(120 + 3 * 1024 / 5), "two rounds of 16 and one warm-up round"
    assert point_timeout_s(BenchmarkSettings(), 8) < point_timeout_s(BenchmarkSettings(output_len=1024), 8)
