"""vLLM's speculative-decoding counters (issue 32 item 2): read from real /metrics text, and a window's figures
checked against vLLM's own "SpecDecoding metrics" log lines of real servers."""
from __future__ import annotations

from pathlib import Path

import pytest

from sparkbook.core.analysis.benchstats import prometheus_totals
from sparkbook.core.values.errors import SparkbookError
from sparkbook.stages.bench.specmetrics import SpecCounters, spec_counters, speculation

DATA = Path(__file__).parent / "data"


def test_a_single_engine_page_counts_totals_not_their_created_times():
    counters = spec_counters((DATA / "vllm-metrics-spec-decode.txt").read_text())
    assert counters == SpecCounters(6491797.0, 6491797.0, 0.0, ())  # one token per draft; accepted not quoted
    assert prometheus_totals((DATA / "vllm-metrics-spec-decode.txt").read_text())[
        "vllm:spec_decode_num_drafts_created"] == pytest.approx(1.77692439403224e9)  # what a prefix match would add


def test_data_parallel_engines_are_summed_and_positions_kept_apart():
    counters = spec_counters((DATA / "vllm-metrics-spec-decode-dp8.txt").read_text())
    assert counters is not None
    assert counters.drafts == 22 + 15 + 29 + 20 + 25 + 24 + 27 + 26 == 188
    assert counters.accepted_per_position == (0.0, 0.0, 0.0, 0.0, 2 + 4 + 13 + 6 + 22 + 17)


def test_a_server_that_does_not_speculate_has_no_counters():
    page = ('# HELP vllm:generation_tokens_total Number of generation tokens processed.\n'
            '# TYPE vllm:generation_tokens_total counter\n'
            'vllm:generation_tokens_total{engine="0",model_name="m"} 2048.0\n')
    assert spec_counters(page) is None
    assert speculation(None, spec_counters(page)) is None


# vLLM's log line over one interval (vllm/v1/spec_decode/metrics.py, SpecDecodingLogging.log), from two servers:
# eugr/spark-vllm-docker#200 (Qwen3.6-35B-A3B-FP8 on a DGX Spark, MTP with 2 tokens):
#   "Mean acceptance length: 2.93, ... Accepted: 419 tokens, Drafted: 434 tokens, Per-position acceptance rate:
#    0.982, 0.949, Avg Draft acceptance rate: 96.5%"
# noonghunna/club-3090#105 (Qwen3.6-27B on 2x RTX 3090, MTP with 6 tokens):
#   "Mean acceptance length: 2.87, ... Accepted: 489 tokens, Drafted: 1572 tokens, Per-position acceptance rate:
#    0.740, 0.473, 0.309, 0.187, 0.099, 0.057, Avg Draft acceptance rate: 31.1%"
# The counters' growth over that interval: drafts = drafted / tokens per draft (434 / 2, 1572 / 6), accepted at each
# position = its rate x drafts (they sum to the accepted count, as they must).
@pytest.mark.parametrize("window, length, rate, per_position", [
    ((217, 434, 419, (213, 206)), 2.93, 0.965, (0.982, 0.949)),
    ((262, 1572, 489, (194, 124, 81, 49, 26, 15)), 2.87, 0.311, (0.740, 0.473, 0.309, 0.187, 0.099, 0.057))],
    ids=["spark-mtp2", "3090-mtp6"])
def test_a_windows_figures_are_vllms_own(window, length, rate, per_position):
    drafts, draft_tokens, accepted, positions = window
    assert sum(positions) == accepted
    before = SpecCounters(1000.0, 1000.0 * len(positions), 700.0, tuple(100.0 for _ in positions))
    after = SpecCounters(before.drafts + drafts, before.draft_tokens + draft_tokens, before.accepted + accepted,
                         tuple(b + p for b, p in zip(before.accepted_per_position, positions, strict=True)))
    s = speculation(before, after)
    assert (s.drafts, s.draft_tokens, s.accepted, s.accepted_per_position) == window
    assert round(s.mean_acceptance_length, 2) == length
    assert round(s.acceptance_rate, 3) == rate
    assert tuple(round(r, 3) for r in s.per_position_rate) == per_position


def test_an_idle_window_has_no_figures_and_a_restart_inside_it_is_refused():
    page = spec_counters((DATA / "vllm-metrics-spec-decode.txt").read_text())
    idle = speculation(page, page)
    assert (idle.drafts, idle.acceptance_rate, idle.mean_acceptance_length, idle.per_position_rate) == \
        (0, None, None, ())
    with pytest.raises(SparkbookError, match="restarted"):
        speculation(page, SpecCounters(10.0, 10.0, 5.0, ()))


def test_a_real_ngram_servers_page_from_the_labs_vllm_cpu_build():
    """vLLM 0.32.0's CPU build speculates with ngram (the lab's newer image): its page after two 48-token completions.
    The generation counter holds the 96 tokens the two replies carried (usage said 48 + 48)."""
    page = (DATA / "vllm-0.32-cpu-ngram-metrics.txt").read_text()
    counters = spec_counters(page)
    assert counters == SpecCounters(6.0, 11.0, 7.0, (4.0, 3.0))
    s = speculation(None, counters)
    assert (s.drafts, s.draft_tokens, s.accepted, s.accepted_per_position) == (6, 11, 7, (4, 3))
    assert round(s.mean_acceptance_length, 2) == 2.17 and round(s.acceptance_rate, 3) == 0.636
    assert tuple(round(r, 3) for r in s.per_position_rate) == (0.667, 0.5)
    assert prometheus_totals(page)["vllm:generation_tokens_total"] == 96.0
