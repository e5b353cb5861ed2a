"""How long a benchmark point may take, from the settings alone: the stage list's longest wait and the sweep read it."""
from __future__ import annotations

import math

from .params import BenchmarkSettings

SLOWEST_DECODE_TOK_S = 5.0  # per sequence: a point's timeout allows decode this slow (GB10 single stream: ~27)
POINT_SLACK_S = 120.0


def point_timeout_s(settings: BenchmarkSettings, concurrency: int) -> float:
    """How long one point (warm-up, then `repeats` x `num_prompts` requests `concurrency` at a time) may take: its
    rounds of requests decoding `output_len` tokens at SLOWEST_DECODE_TOK_S, plus slack. Scales with the settings, so a
    slow node serving long outputs (32 x 1024 tokens at 27 tok/s) is measured, not cut off at a fixed limit."""
    rounds = (settings.repeats * math.ceil(settings.num_prompts / concurrency)
              + math.ceil(warmup_count(settings, concurrency) / concurrency))
    return POINT_SLACK_S + rounds * settings.output_len / SLOWEST_DECODE_TOK_S


def warmup_count(settings: BenchmarkSettings, concurrency: int) -> int:
    """Full-length warm-up requests of a point: none when `warmup_requests` is 0, else max(warmup_requests,
    concurrency), sent `concurrency` at a time (the batch the measurement decodes)."""
    return max(settings.warmup_requests, concurrency) if settings.warmup_requests else 0
