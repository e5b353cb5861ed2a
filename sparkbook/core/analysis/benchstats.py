"""Benchmark statistics as pure functions: per-request records → vLLM-named summaries, roofline, comparisons.

Definitions (as `vllm bench serve` computes them, vllm/benchmarks/serve.py):
- TTFT: request sent → first streamed chunk with text.
- TPOT: (E2EL − TTFT) / (output_tokens − 1), per request; requests with one output token have none.
- ITL: every gap between consecutive streamed chunks (per CHUNK; one chunk may carry several tokens).
- ITL per token (ours, `*_itl_per_token_ms`): each chunk gap split evenly over the tokens that chunk carried.
- E2EL: request sent → last streamed chunk.
Statistics use numpy's mean, median, population std and linearly interpolated percentiles, as vLLM does.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from ..values.modelinfo import ModelFacts, served_kv_bytes_per_token
from ..values.params import BenchmarkSettings
from ..values.sweeppoint import FIGURES, LATENCIES, STATS, Stall, SweepPoint

# The verdict of a change between two runs whose serving plan or image differ: they measure two setups, so neither is
# a regression test of the other.
ACROSS_SETUPS = "different setups: not judged"
# Higher is better for these; every *_ms metric is better lower.
HIGHER_IS_BETTER = ("output_throughput", "request_throughput", "total_token_throughput")


@dataclass(frozen=True)
class RequestRecord:
    """One streamed request as the client saw it; times in seconds, `sent_at` on the wall clock; a failed one's
    `e2el_s` is when it failed (the soak names an engine's death by the first request that reported it)."""

    ok: bool
    sent_at: float
    ttft_s: float | None = None
    e2el_s: float | None = None
    chunk_gaps_s: list[float] = field(default_factory=list)   # gap before each chunk after the first
    chunk_tokens: list[int] = field(default_factory=list)     # tokens in each of those chunks
    prompt_tokens: int | None = None
    output_tokens: int = 0
    error: str = ""

    @property
    def done_at(self) -> float:
        return self.sent_at + (self.e2el_s or 0.0)


def token_gaps(record: RequestRecord) -> list[float]:
    """ITL per token: each chunk gap spread evenly over the tokens that chunk carried (1 when unknown).

    A chunk without tokens (e.g. a bare finish chunk) hands its gap on to the next chunk that has some.
    """
    counts = record.chunk_tokens or [1] * len(record.chunk_gaps_s)
    gaps, carried = [], 0.0
    for gap, n in zip(record.chunk_gaps_s, counts, strict=False):
        carried += gap
        if n > 0:
            gaps += [carried / n] * n
            carried = 0.0
    return gaps


def tpot_s(record: RequestRecord) -> float | None:
    """vLLM's TPOT for one request, or None with fewer than two output tokens."""
    if record.output_tokens < 2 or record.e2el_s is None or record.ttft_s is None:
        return None
    return (record.e2el_s - record.ttft_s) / (record.output_tokens - 1)


def describe_ms(values_s: list[float], name: str) -> dict[str, float | None]:
    """{mean,median,std,p90,p99}_<name>_ms of values given in seconds (None when there are none)."""
    if not values_s:
        return {f"{s}_{name}_ms": None for s in STATS}
    ms = np.asarray(values_s, dtype=float) * 1000.0
    return {f"mean_{name}_ms": float(np.mean(ms)), f"median_{name}_ms": float(np.median(ms)),
            f"std_{name}_ms": float(np.std(ms)), f"p90_{name}_ms": float(np.percentile(ms, 90)),
            f"p99_{name}_ms": float(np.percentile(ms, 99))}


def summarize(records: list[RequestRecord], duration_s: float, max_concurrency: int) -> SweepPoint:
    """One sweep point as `vllm bench serve` names its result fields (plus ITL per token)."""
    ok = [r for r in records if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens or 0 for r in ok)
    result: dict[str, Any] = {
        "max_concurrency": max_concurrency, "num_prompts": len(records), "completed": len(ok),
        "failed": len(records) - len(ok), "duration": duration_s,
        "total_input_tokens": in_tokens, "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / duration_s if duration_s > 0 else None,
        "output_throughput": out_tokens / duration_s if duration_s > 0 else None,
        "total_token_throughput": (in_tokens + out_tokens) / duration_s if duration_s > 0 else None,
    }
    series = {
        "ttft": [r.ttft_s for r in ok if r.ttft_s is not None],
        "tpot": [t for t in (tpot_s(r) for r in ok) if t is not None],
        "itl": [g for r in ok for g in r.chunk_gaps_s],
        "itl_per_token": [g for r in ok for g in token_gaps(r)],
        "e2el": [r.e2el_s for r in ok if r.e2el_s is not None],
    }
    for name in LATENCIES:
        result.update(describe_ms(series[name], name))
    return SweepPoint.model_validate(result)


# --- warm-up, repeats and stalls ------------------------------------------------------------------
STALL_FACTOR = 10.0  # a repeat stalled when its TTFT p99 exceeds this many times the median (find_stall)


def prefill_group_sizes(settings: BenchmarkSettings, concurrency: int) -> list[int]:
    """Sizes of the prefill-only groups a point's warm-up sends first (none without warm-up): 1 .. concurrency
    prompts arriving together, i.e. every number of prefills a step of the measurement can hold (sent alone, and
    those below `concurrency` again beside one decoding sequence). vLLM runs a step
    above its CUDA-graph sizes with the real token count, and its fused-MoE Triton kernel is compiled per config
    (nearest tuned M) and per divisibility of the token count: a step of k prefills (+ decodes) the warm-up did not
    make compiles mid-measurement (measured on one H200: 12 requests of a wave stalled 1.1 s,
    tests/gpu/bench_repeats)."""
    return list(range(1, concurrency + 1)) if settings.warmup_requests else []


def prompt_seed(concurrency: int, repeat: int) -> int:
    """The prompt seed of one repeat of a point (repeat -1: its warm-up): distinct for every concurrency and repeat,
    so no repeat finds another's prompts in the prefix cache."""
    return concurrency * 1000 + repeat + 1


@dataclass(frozen=True)
class Spread:
    """One metric over a point's repeats: the median reported, and how far the repeats lie apart."""

    median: float
    low: float
    high: float
    stdev_pct: float  # sample standard deviation of the repeats, % of the median (0 with one repeat)
    values: list[float]


def spread(values: list[float]) -> Spread:
    """Median, min, max and the sample standard deviation (% of the median) of a metric's repeat values."""
    median = float(np.median(values))
    std = float(np.std(values, ddof=1)) if len(values) > 1 else 0.0
    return Spread(median, float(min(values)), float(max(values)), 100.0 * std / abs(median) if median else 0.0,
                  [float(v) for v in values])


# Counts over a point's repeats add up; every other numeric field is the median of the repeats'.
SUMMED = ("num_prompts", "completed", "failed", "duration", "total_input_tokens", "total_output_tokens")
# The per-repeat figures kept in a point's record (its spread and the noise band of comparisons).
REPEAT_METRICS = ("output_throughput", "request_throughput", "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms",
                  "p99_tpot_ms", "median_itl_per_token_ms", "median_e2el_ms")


def aggregate_repeats(results: list[SweepPoint]) -> SweepPoint:
    """One point from its repeats' summaries: counts summed, every other figure the median of the repeats'
    (None where a repeat has none)."""
    out: dict[str, Any] = {"max_concurrency": results[0].max_concurrency}
    for key in FIGURES:
        values = [getattr(r, key) for r in results]
        if any(v is None for v in values):
            out[key] = None
        else:
            out[key] = sum(values) if key in SUMMED else float(np.median(values))
    return SweepPoint.model_validate(out)


def repeat_figures(results: list[SweepPoint]) -> list[dict[str, float | None]]:
    """The REPEAT_METRICS of each repeat, in order (what a point's record keeps of them)."""
    return [{k: r.figure(k) for k in REPEAT_METRICS} for r in results]


def repeat_spread(point: SweepPoint, metric: str) -> Spread | None:
    """The spread of `metric` over a saved point's repeats (sparkbook.repeats), None without repeats."""
    values = [r.get(metric) for r in point.sparkbook.repeats]
    known = [v for v in values if v is not None]
    return spread(known) if values and len(known) == len(values) else None


def median_ttft_ms(records: list[RequestRecord]) -> float | None:
    """Median TTFT of the completed requests, in ms (None without any)."""
    ttfts = [r.ttft_s for r in records if r.ok and r.ttft_s is not None]
    return 1000.0 * float(np.median(ttfts)) if ttfts else None


def find_stall(records: list[RequestRecord], max_concurrency: int, repeat: int, baseline_ms: float | None = None,
               factor: float = STALL_FACTOR) -> Stall | None:
    """The stall of one repeat, or None: its TTFT p99 above `factor` x the median, the median being the lower of
    its own and `baseline_ms` (the point's calmest repeat: a stall that holds a wave of requests raises the
    repeat's own median; measured on one H200, 12 of 64 requests at 1.11 s put it at 112 ms against 64 ms)."""
    timed = [(i, r.ttft_s * 1000.0, r.sent_at) for i, r in enumerate(records) if r.ok and r.ttft_s is not None]
    if len(timed) < 2:
        return None
    ttfts = np.asarray([ms for _, ms, _ in timed])
    median, p99 = float(np.median(ttfts)), float(np.percentile(ttfts, 99))
    base = min(median, baseline_ms) if baseline_ms else median
    if p99 <= factor * base:
        return None
    start = min(sent for _, _, sent in timed)
    hit: list[dict[str, int | float]] = [{"index": i, "ttft_ms": round(ms, 1), "sent_at_s": round(sent - start, 3)}
                                         for i, ms, sent in timed if ms > factor * base]
    return Stall(max_concurrency, repeat, median, base, p99, hit)


# --- server-side cross-check ------------------------------------------------------------------
def prometheus_totals(text: str) -> dict[str, float]:
    """Each sample name of a Prometheus text page (e.g. `vllm:e2e_request_latency_seconds_sum`, a counter's
    `..._total`) summed over its label sets."""
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
    return totals


@dataclass(frozen=True)
class CrossCheck:
    """The server's own token counters over a window next to the client's counts."""

    metric: str
    server: float | None
    client: int
    agrees: bool


def cross_check(before: dict[str, float], after: dict[str, float], client_counts: dict[str, int],
                tolerance: float = 0.0) -> list[CrossCheck]:
    """Compare counter deltas (metric → client count) within a relative tolerance."""
    checks = []
    for metric, client in client_counts.items():
        server = after[metric] - before.get(metric, 0.0) if metric in after else None
        agrees = server is not None and abs(server - client) <= tolerance * max(client, 1)
        checks.append(CrossCheck(metric, server, client, agrees))
    return checks


# --- roofline ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Roofline:
    """Single-stream decode ceiling: every active weight read once per token, TP nodes reading in parallel."""

    active_params: int
    bytes_per_param: float
    tensor_parallel: int
    node_bandwidth_gbs: float
    bytes_per_token: float
    seconds_per_token: float
    ceiling_tok_s: float
    measured_tok_s: float | None
    percent_of_ceiling: float | None
    assumption: str


# The two single-stream figures, named the same on every page and table: the first is the one the runs are known by.
SINGLE_STREAM = "single-stream output tok/s (concurrency 1, wall clock)"
TPOT_DECODE = "decode tok/s from TPOT (1000 / median TPOT at concurrency 1; no prefill)"


def decode_tok_s(point: SweepPoint | None) -> float | None:
    """One stream's decode rate, 1000 / median TPOT (no prefill)."""
    tpot = point.median_tpot_ms if point else None
    return 1000.0 / tpot if tpot else None


def step_share(point: SweepPoint) -> float | None:
    """The share of a point's output tokens that took a step of the target model: every step of a sequence emits one
    token of its own plus the drafts it accepted, so steps = output tokens - accepted (1 without speculation;
    None where the point counted no tokens)."""
    s = point.sparkbook.speculation
    if s is None:
        return 1.0
    return 1 - s.accepted / point.total_output_tokens if point.total_output_tokens else None


def decode_steps_per_s(point: SweepPoint) -> float | None:
    """Decode steps per second over all sequences: the output tok/s without speculation; with it, the rate the target
    model itself stepped at (what llama-benchy reports as tokens/s, and why MTP's gain looks smaller there)."""
    share = step_share(point)
    return None if point.output_throughput is None or share is None else point.output_throughput * share


def decode_steps_from_tpot(point: SweepPoint | None) -> float | None:
    """One stream's decode steps per second from its TPOT: what the roofline bounds, since a step reads the weights
    once however many drafted tokens it verifies (1000 / median TPOT without speculation)."""
    rate, share = decode_tok_s(point), step_share(point) if point else None
    return None if rate is None or share is None else rate * share


def served_bytes_per_param(model_bytes_per_param: float, serve_dtype: str) -> float:
    """Bytes per weight as served: the --dtype the server was given, else the model's own."""
    return {"float32": 4.0, "bfloat16": 2.0, "float16": 2.0}.get(serve_dtype, model_bytes_per_param)


def roofline(active_params: int, bytes_per_param: float, tensor_parallel: int, node_bandwidth_gbs: float,
             measured_tok_s: float | None = None) -> Roofline:
    """Ceiling = tp × bandwidth / (active params × bytes per param); KV-cache and activation reads ignored."""
    per_token = active_params * bytes_per_param
    seconds = per_token / (tensor_parallel * node_bandwidth_gbs * 1e9)
    ceiling = 1.0 / seconds
    percent = 100.0 * measured_tok_s / ceiling if measured_tok_s else None
    assumption = (f"weights split evenly over {tensor_parallel} node(s), each reading its share at "
                  f"{node_bandwidth_gbs:g} GB/s per token; KV cache, activations and communication ignored")
    return Roofline(active_params, bytes_per_param, tensor_parallel, node_bandwidth_gbs, per_token, seconds,
                    ceiling, measured_tok_s, percent, assumption)


def experts_touched(experts: int, top_k: int, tokens: int) -> float:
    """Expected distinct experts of one MoE layer that `tokens` tokens route to, each picking `top_k` of
    `experts` uniformly: E x (1 - (1 - k/E)^B) (k at B = 1, towards E as B grows)."""
    return experts * (1.0 - (1.0 - top_k / experts) ** tokens) if experts else 0.0


@dataclass(frozen=True)
class StepModel:
    """What one decode step of B sequences reads from memory, and how fast the ranks read it."""

    dense_params: int  # read once per step whatever B: attention, embeddings, routers, dense and shared MLPs
    experts: int  # routed experts per MoE layer (0: dense)
    experts_per_token: int
    moe_layers: int
    expert_params: int  # one routed expert in one layer
    bytes_per_param: float
    kv_bytes_per_token: float  # whole model, as served
    context_tokens: float  # mean context of a sequence over its decode: input_len + output_len / 2
    kv_replicated: bool  # an MLA latent: every tensor-parallel rank reads all of it
    tensor_parallel: int
    node_bandwidth_gbs: float


@dataclass(frozen=True)
class BatchCeiling:
    """The decode ceiling at one concurrency and the measured output throughput against it."""

    concurrency: int
    experts_touched: float  # per MoE layer per step (0 for a dense model)
    weight_bytes: float  # per step, all ranks
    kv_bytes: float  # per step, all ranks
    step_s: float
    ceiling_tok_s: float
    measured_tok_s: float | None
    percent_of_ceiling: float | None


def step_model(facts: ModelFacts, serve_dtype: str, tensor_parallel: int, node_bandwidth_gbs: float,
               input_len: int, output_len: int) -> StepModel:
    """The step model of a served model from 02's facts and the benchmark's lengths."""
    dense = facts.active_params - facts.moe_layers * facts.experts_per_token * facts.expert_params
    return StepModel(dense, facts.experts, facts.experts_per_token, facts.moe_layers, facts.expert_params,
                     served_bytes_per_param(facts.bytes_per_param, serve_dtype),
                     served_kv_bytes_per_token(facts, serve_dtype), input_len + output_len / 2, facts.kv_latent,
                     tensor_parallel, node_bandwidth_gbs)


def batch_ceiling(m: StepModel, concurrency: int, measured_tok_s: float | None = None) -> BatchCeiling:
    """Ceiling at B = concurrency: B tokens per step, a step reading the dense weights once, the experts the
    B tokens touch, and each sequence's KV cache, over TP ranks reading in parallel at the node bandwidth."""
    touched = experts_touched(m.experts, m.experts_per_token, concurrency)
    weights = m.bytes_per_param * (m.dense_params + m.moe_layers * m.expert_params * touched)
    kv = concurrency * m.context_tokens * m.kv_bytes_per_token * (m.tensor_parallel if m.kv_replicated else 1)
    step = (weights + kv) / (m.tensor_parallel * m.node_bandwidth_gbs * 1e9)
    ceiling = concurrency / step
    return BatchCeiling(concurrency, touched, weights, kv, step, ceiling, measured_tok_s,
                        100.0 * measured_tok_s / ceiling if measured_tok_s else None)


def batch_ceilings(m: StepModel, points: Iterable[SweepPoint]) -> list[BatchCeiling]:
    """The ceiling at each measured concurrency, against its decode steps per second: its output throughput, or with
    speculation the steps (a step reads the weights once whatever it verifies, so tokens could pass the ceiling)."""
    return [batch_ceiling(m, p.max_concurrency, decode_steps_per_s(p)) for p in points]


# --- comparisons -----------------------------------------------------------------------------
@dataclass(frozen=True)
class Delta:
    """One metric of one sweep point against an earlier run, judged against the run-to-run noise."""

    max_concurrency: int
    metric: str
    earlier: float
    now: float
    change_pct: float
    noise_pct: float | None  # None: no repeats in either run nor earlier runs to estimate the noise from
    noise_from: str  # where the band comes from: "repeats", "earlier runs", or why there is none
    across_setups: bool = False  # the two runs served different plans or images (benchcompare.Setups)

    @property
    def verdict(self) -> str:
        """worse | better (outside the band, in the metric's bad or good direction) | within noise | no noise
        estimate (a change that nothing measured the noise of is not called either) | ACROSS_SETUPS."""
        if self.across_setups:
            return ACROSS_SETUPS
        if self.noise_pct is None:
            return "no noise estimate"
        good = self.change_pct if self.metric in HIGHER_IS_BETTER else -self.change_pct
        return "within noise" if abs(good) <= self.noise_pct else "better" if good > 0 else "worse"

    @property
    def worse(self) -> bool:
        return self.verdict == "worse"


def repeat_band_pct(point: SweepPoint, metric: str) -> float | None:
    """A point's own run-to-run spread of `metric`: (max - min) / median of its repeats, in %; None with fewer
    than two repeats. Per-request spread is never used: it is the load's, not the run's, variation."""
    repeats = repeat_spread(point, metric)
    if not repeats or len(repeats.values) < 2 or not repeats.median:
        return None
    return 100.0 * (repeats.high - repeats.low) / abs(repeats.median)


def spread_band_pct(values: list[float]) -> float | None:
    """The spread (max - min) / median, in %, of one figure across runs; None with fewer than two."""
    if len(values) < 2 or not float(np.median(values)):
        return None
    return 100.0 * (max(values) - min(values)) / abs(float(np.median(values)))


def compare(now: Iterable[SweepPoint], earlier: Iterable[SweepPoint], metrics: Iterable[str],
            history: dict[tuple[int, str], float] | None = None) -> list[Delta]:
    """Per concurrency and metric: the change, and the noise band it is judged against.

    The band is the wider of the two points' spreads over their repeats; where neither has repeats, the spread
    of the figure over earlier runs of the same params and image (`history`, by concurrency and metric); else
    there is no estimate, and the change is neither worse nor better.
    """
    before = {p.max_concurrency: p for p in earlier}
    deltas = []
    for point in now:
        old = before.get(point.max_concurrency)
        if old is None:
            continue
        for metric in metrics:
            a, b = old.figure(metric), point.figure(metric)
            if a is None or b is None or a == 0:
                continue
            bands = [x for x in (repeat_band_pct(point, metric), repeat_band_pct(old, metric)) if x is not None]
            past = (history or {}).get((point.max_concurrency, metric))
            noise, source = (max(bands), "repeats") if bands else (past, "earlier runs") if past is not None \
                else (None, "no repeats in either run and no earlier runs of the same params and image")
            deltas.append(Delta(point.max_concurrency, metric, a, b, 100.0 * (b - a) / abs(a), noise, source))
    return deltas


# --- the client's own ceiling ------------------------------------------------------------------
@dataclass(frozen=True)
class ClientLoad:
    """How much CPU one load-generator process spent on a point, and the token rate that implies at 100%."""

    engine: int
    tokens: int
    chunks: int
    cpu_s: float
    wall_s: float
    cpu_utilization: float
    ceiling_tok_s: float | None


def client_load(engine: int, tokens: int, chunks: int, cpu_s: float, wall_s: float) -> ClientLoad:
    """Ceiling = tokens per CPU-second of the client process (one core fully busy)."""
    util = cpu_s / wall_s if wall_s > 0 else 0.0
    return ClientLoad(engine, tokens, chunks, cpu_s, wall_s, util, tokens / cpu_s if cpu_s > 0 else None)
