"""06's context-depth axis and prefix-cache pair (definitions: core.analysis.depthsweep): single-stream requests whose
prompts are token ids of an exact count, sent after the concurrency sweep on the server it warmed.

Prompts go as token ids, not text: a depth of 100k tokens is exactly that many (text re-tokenizes to a few more or
fewer), and the pair's shared prefix is identical token by token (two texts joined at a boundary can tokenize
differently there, and a prefix that differs in its last block is not reused).
"""
from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import replace

import aiohttp

from ...core.analysis.benchstats import RequestRecord, prometheus_totals
from ...core.analysis.depthsweep import (
    DepthPoint,
    DepthSweep,
    PrefixCachePair,
    depth_point,
    prefix_pair,
    prefix_setting,
)
from ...core.values.benchbudget import SLOWEST_DECODE_TOK_S
from ...core.values.params import BenchmarkSettings
from .client import CompletionsServer, make_prompts, metrics_page, run_load
from .sweep import ServerGone

SLOWEST_PREFILL_TOK_S = 200.0  # a depth request's timeout allows prefill this slow (GB10 prefills thousands/s)
REQUEST_SLACK_S = 120.0
SEED = 7_000_000  # above every prompt_seed of the concurrency sweep: no depth prompt repeats a sweep prompt
NO_PAIR = "no depth above 0 in benchmark.depths to send twice as a shared prefix"


def depth_seed(depth: int, repeat: int) -> int:
    """A distinct seed per depth and repeat (and for the pair: repeat -1), so no request finds another's prompt in
    the prefix cache."""
    return SEED + depth * 100 + repeat + 1


def depth_prompt(pool: list[int], depth: int, input_len: int, seed: int) -> list[int]:
    """`depth` context tokens then `input_len` prompt tokens: one prompt of exactly depth + input_len random ids."""
    return make_prompts(pool, 1, depth + input_len, seed)[0]


def prefix_pair_prompts(pool: list[int], prefix_len: int, suffix_len: int, seed: int) -> tuple[list[int], list[int]]:
    """Two prompts sharing their first `prefix_len` tokens, then `suffix_len` tokens each that differ from their
    first token on (so the second's prompt is not the first's again, only its prefix)."""
    prefix, first, second = (make_prompts(pool, 1, n, seed + i)[0] for i, n in enumerate((prefix_len, suffix_len,
                                                                                             suffix_len)))
    if second[0] == first[0] and len(set(pool)) > 1:
        second[0] = random.Random(seed).choice([t for t in pool if t != first[0]])
    return prefix + first, prefix + second


def request_timeout_s(settings: BenchmarkSettings, prompt_tokens: int) -> float:
    """One depth request's limit: its prefill at SLOWEST_PREFILL_TOK_S and its decode at SLOWEST_DECODE_TOK_S, plus
    slack (so a deep prompt on a slow node is measured, not cut off at the client's default)."""
    return REQUEST_SLACK_S + prompt_tokens / SLOWEST_PREFILL_TOK_S + settings.depth_output_len / SLOWEST_DECODE_TOK_S


def one(target: CompletionsServer, settings: BenchmarkSettings, prompt: list[int]) -> RequestRecord:
    """One streamed request, alone on the server."""
    limit = request_timeout_s(settings, len(prompt))
    return run_load(replace(target, request_timeout_s=limit), [prompt], settings.depth_output_len, 1,
                    limit + 10).records[0]


def measure_depth(target: CompletionsServer, settings: BenchmarkSettings, pool: list[int], depth: int) -> DepthPoint:
    """`repeats` requests at `depth`, one at a time, each with fresh tokens."""
    records = [one(target, settings, depth_prompt(pool, depth, settings.depth_input_len, depth_seed(depth, r)))
               for r in range(settings.repeats)]
    return depth_point(depth, settings.depth_input_len, settings.depth_output_len, records)


def prefix_cache(target: CompletionsServer, settings: BenchmarkSettings, pool: list[int],
                 argv: list[str]) -> PrefixCachePair:
    """The deepest depth sent as a prefix twice: its first request fills the cache, the second may read it; the
    server's prefix-cache counters are read around the second."""
    deepest = max(settings.depths)
    first, second = prefix_pair_prompts(pool, deepest, settings.depth_input_len, depth_seed(deepest, -1))
    cold = one(target, settings, first)
    before = prometheus_totals(metrics_page(target))
    warm = one(target, settings, second)
    after = prometheus_totals(metrics_page(target))
    return prefix_pair(deepest, settings.depth_input_len, cold, warm, before, after, prefix_setting(argv))


def measure(target: CompletionsServer, settings: BenchmarkSettings, pool: list[int], argv: list[str],
            on_step: Callable[[str], None] | None = None) -> DepthSweep:
    """Every depth of the settings in order, then the prefix-cache pair (none without a depth above 0); `on_step`
    is told after each. Raises ServerGone when the server stops answering."""
    tell = on_step or (lambda _: None)
    try:
        points = []
        for depth in settings.depths:
            points.append(measure_depth(target, settings, pool, depth))
            tell(f"d={depth}: TTFT {points[-1].ttft_ms or 0:,.0f} ms")
        if max(settings.depths, default=0) == 0:
            return DepthSweep(points=points, prefix_cache=None, prefix_cache_note=NO_PAIR)
        pair = prefix_cache(target, settings, pool, argv)
        tell(f"prefix cache: {pair.ratio or 0:.2f}x")
        return DepthSweep(points=points, prefix_cache=pair)
    except (TimeoutError, aiohttp.ClientError, OSError) as exc:
        raise ServerGone(f"the server at {target.base_url} ({target.model}) stopped answering during the depth "
                         f"sweep: {type(exc).__name__}: {str(exc)[:200]}",
                         remediation="read 05's serve log tails on the head and serve again (05)") from None
