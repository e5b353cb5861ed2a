"""What speculative decoding did over one benchmark point, from vLLM's own counters on /metrics.

The names are SpecDecodingProm's (vllm/v1/spec_decode/metrics.py): counters of drafts, draft tokens and accepted
tokens, and accepted tokens per draft position (label `position`), one series per engine (data-parallel rank), so
they are summed. The figures are vLLM's own log line's: acceptance rate = accepted / draft tokens, the rate at
position k = accepted at k / drafts, mean acceptance length = 1 + accepted / drafts (the bonus token included).
Acceptance is not speed-up: that is output tok/s with and without speculation on the same workload.
"""
from __future__ import annotations

from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

from ...core.values.errors import SparkbookError
from ...core.values.stagelist import BENCH
from ...core.values.sweeppoint import Speculation

DRAFTS = "vllm:spec_decode_num_drafts_total"
DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens_total"
ACCEPTED = "vllm:spec_decode_num_accepted_tokens_total"
PER_POSITION = "vllm:spec_decode_num_accepted_tokens_per_pos_total"


@dataclass(frozen=True)
class SpecCounters:
    """One scrape's speculative-decoding counters, summed over engines."""

    drafts: float
    draft_tokens: float
    accepted: float
    accepted_per_position: tuple[float, ...]  # index k: position k


def spec_counters(text: str) -> SpecCounters | None:
    """The counters of a /metrics page; None where it has no drafts counter (the server does not speculate).
    Only the `_total` samples count: prometheus_client also exposes each counter's `_created` time."""
    totals: dict[str, float] = {}
    positions: dict[int, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == PER_POSITION:
                k = int(sample.labels["position"])
                positions[k] = positions.get(k, 0.0) + sample.value
            elif sample.name in (DRAFTS, DRAFT_TOKENS, ACCEPTED):
                totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
    if DRAFTS not in totals:
        return None
    return SpecCounters(totals[DRAFTS], totals.get(DRAFT_TOKENS, 0.0), totals.get(ACCEPTED, 0.0),
                        tuple(positions.get(k, 0.0) for k in range(max(positions, default=-1) + 1)))


def speculation(before: SpecCounters | None, after: SpecCounters | None) -> Speculation | None:
    """What the window between two scrapes drafted and accepted (None: the server does not speculate). A series
    absent before counts from zero; one that went down means the server restarted inside the window, whose
    figures would mix two servers."""
    if after is None:
        return None
    start = before or SpecCounters(0.0, 0.0, 0.0, ())
    positions = len(after.accepted_per_position)
    earlier = start.accepted_per_position + (0.0,) * (positions - len(start.accepted_per_position))
    deltas = [after.drafts - start.drafts, after.draft_tokens - start.draft_tokens, after.accepted - start.accepted,
              *(a - b for a, b in zip(after.accepted_per_position, earlier, strict=False))]
    if any(d < 0 for d in deltas) or len(earlier) > positions:
        raise SparkbookError(f"the speculative-decoding counters went down between two scrapes ({start} -> {after}): "
                             "the server restarted inside the point's window, whose figures would mix two servers",
                             stage=BENCH.name,
                             remediation="read 05's serve log tails on the head and benchmark again")
    drafts, draft_tokens, accepted, *per_position = (round(d) for d in deltas)
    return Speculation(drafts, draft_tokens, accepted, tuple(per_position))
