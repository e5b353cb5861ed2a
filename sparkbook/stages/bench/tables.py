"""06's tables and the roofline's worked formula: the rows and markdown the notebook shows of its sweep points, its
depth points and its prefix-cache pair."""
from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from ...core.analysis.benchstats import BatchCeiling, StepModel, decode_steps_per_s, repeat_spread
from ...core.analysis.depthsweep import DepthSweep, PrefixCachePair
from ...core.values.params import BenchmarkSettings
from ...core.values.sweeppoint import GpuClocks, SweepPoint
from .sweep import Point


def stall_rows(points: Iterable[SweepPoint]) -> list[dict[str, Any]]:
    """One row per stalled repeat of the saved points (sparkbook.stalls): where, how bad, which requests."""
    return [{"concurrency": s.max_concurrency, "repeat": s.repeat, "TTFT ms p50": round(s.median_ttft_ms, 1),
             "TTFT ms p50 (calmest repeat)": round(s.baseline_ttft_ms, 1),
             "TTFT ms p99": round(s.p99_ttft_ms, 1), "requests hit": len(s.requests),
             "request index: TTFT ms": ", ".join(f"{q['index']}: {q['ttft_ms']:,.0f}" for q in s.requests)}
            for p in points for s in p.sparkbook.stalls]


def clock_columns(p: SweepPoint) -> dict[str, Any]:
    """The GPUs' clocks through the point, beside its figures: SM MHz start→lowest, hottest, mean power, and the
    drop flagged beyond benchmark.clock_drop (per GPU, `node/gpu`); why not, where nothing was sampled."""
    clocks = p.sparkbook.clocks
    if not clocks:
        return {"GPU clocks": p.sparkbook.clocks_note or "not recorded"}
    def each(value: Callable[[GpuClocks], float | None]) -> str:
        return "; ".join(f"{c.node}/{c.gpu} " + ("-" if value(c) is None else f"{value(c):.0f}") for c in clocks)
    return {"SM MHz start": each(lambda c: c.sm_start_mhz), "SM MHz min": each(lambda c: c.sm_min_mhz),
            "temp °C max": each(lambda c: c.temperature_max_c), "power W mean": each(lambda c: c.power_mean_w),
            "clock drop": "; ".join(f"{c.node}/{c.gpu} {c.drop_pct:.1f} %" + (" DROPPED" if c.dropped else "")
                                    for c in clocks if c.drop_pct is not None) or None}


def speculation_columns(p: SweepPoint) -> dict[str, Any]:
    """What speculative decoding did over the point, from the server's counters (specmetrics): the decode steps per
    second beside the output tok/s, the share of steps that drafted at all (ngram drafts only where the context
    repeats), the tokens each drafting step emitted (mean accepted length, vLLM's mean acceptance length), the
    share of drafted tokens accepted, and the rate at each draft position; nothing where the server does not
    speculate. A high acceptance on few drafting steps gains little: the steps column shows it."""
    s = p.sparkbook.speculation
    if s is None:
        return {}
    rate, steps = s.acceptance_rate, decode_steps_per_s(p)
    all_steps = (p.total_output_tokens or 0) - s.accepted
    return {"decode steps/s": None if steps is None else round(steps, 1),
            "steps drafting %": round(100 * s.drafts / all_steps, 1) if all_steps > 0 else None,
            "mean accepted length": None if s.mean_acceptance_length is None else round(s.mean_acceptance_length, 2),
            "draft acceptance %": None if rate is None else round(100 * rate, 1),
            "acceptance by position": ", ".join(f"{r:.2f}" for r in s.per_position_rate) or None}


def table(points: Iterable[SweepPoint]) -> list[dict[str, Any]]:
    """One row per saved sweep point with the numbers a reader compares first (rounded): the medians over its
    repeats, the output throughput's min-max and standard deviation over them, and the repeats that stalled."""
    def r(value: float | None, digits: int = 1) -> float | None:
        return None if value is None else round(value, digits)

    def extras(p: SweepPoint) -> dict[str, Any]:
        tput = repeat_spread(p, "output_throughput")
        stalls = p.sparkbook.stalls
        return {"repeats": len(tput.values) if tput else 1,
                "tok/s min-max": f"{tput.low:,.1f}-{tput.high:,.1f}" if tput else None,
                "stdev %": r(tput.stdev_pct, 2) if tput else None,
                "stalled repeats": ", ".join(str(s.repeat) for s in stalls) or None, **speculation_columns(p),
                **clock_columns(p)}

    return [{"concurrency": p.max_concurrency, "completed": p.completed, "failed": p.failed,
             "output tok/s": r(p.output_throughput), **extras(p), "req/s": r(p.request_throughput, 2),
             "TTFT ms p50": r(p.median_ttft_ms), "TTFT p99": r(p.p99_ttft_ms),
             "TPOT ms p50": r(p.median_tpot_ms, 2), "TPOT p99": r(p.p99_tpot_ms, 2),
             "ITL/chunk p50": r(p.median_itl_ms, 2), "ITL/token p50": r(p.median_itl_per_token_ms, 2),
             "E2EL ms p50": r(p.median_e2el_ms)} for p in points]


def ceiling_rows(ceilings: list[BatchCeiling]) -> list[dict[str, Any]]:
    return [{"concurrency": c.concurrency, "experts touched / MoE layer": round(c.experts_touched, 1),
             "weights MB / step": round(c.weight_bytes / 1e6, 1), "KV MB / step": round(c.kv_bytes / 1e6, 2),
             "step ms": round(c.step_s * 1e3, 3), "ceiling tok/s": round(c.ceiling_tok_s, 1),
             "decode steps/s (output tok/s without speculation)": None if c.measured_tok_s is None
             else round(c.measured_tok_s, 1),
             "% of ceiling": None if c.percent_of_ceiling is None else round(c.percent_of_ceiling, 1)}
            for c in ceilings]


def ceiling_markdown(m: StepModel, ceilings: list[BatchCeiling]) -> str:
    """The per-concurrency ceiling's formula with this model's numbers plugged in, one line per point."""
    moe = f"; MoE layers = {m.moe_layers}, params/expert = {m.expert_params:,}" if m.experts else ""
    kv_factor = f" x {m.tensor_parallel} (MLA latent read by every rank)" if m.kv_replicated else ""
    lines = [
        "**Decode ceiling at concurrency B** (B tokens per step; one step reads the dense weights once, the experts "
        "the B tokens touch, and each sequence's KV cache):",
        "",
        "ceiling(B) = B / t_step(B),  t_step(B) = [ bytes/param x (dense params" + (" + MoE layers x params/expert x "
        "E_B" if m.experts else "") + ") + B x context x KV bytes/token ] / (TP x bandwidth)",
        "",
    ]
    if m.experts:
        lines += [f"E_B = E x (1 - (1 - k/E)^B), the expected distinct experts B tokens touch per MoE layer, with "
                  f"E = {m.experts}, k = {m.experts_per_token}.", ""]
    lines += [f"Here: bytes/param = {m.bytes_per_param:g}; dense params = {m.dense_params:,}{moe}; context = "
              f"{m.context_tokens:g} tokens (input + output/2); KV bytes/token = {m.kv_bytes_per_token:,.0f}"
              f"{kv_factor}; TP = {m.tensor_parallel}; bandwidth = {m.node_bandwidth_gbs:g} GB/s per rank.", ""]
    lines += [f"- B = {c.concurrency}: " + (f"E_B = {c.experts_touched:.1f}; " if m.experts else "")
              + f"t_step = ({c.weight_bytes / 1e6:,.1f} MB + {c.kv_bytes / 1e6:,.2f} MB) / "
              f"({m.tensor_parallel} x {m.node_bandwidth_gbs:g} GB/s) = {c.step_s * 1e3:.3f} ms → ceiling "
              f"{c.ceiling_tok_s:,.0f} tok/s" + (f"; measured {c.measured_tok_s:,.1f} steps/s = "
                                                 f"{c.percent_of_ceiling:.1f} %" if c.percent_of_ceiling else "")
              for c in ceilings]
    return "\n".join(lines)


def cross_check_rows(points: list[Point], settings: BenchmarkSettings) -> list[dict[str, Any]]:
    """Per point: the server's counters against the client's counts, and the prompt lengths it saw."""
    rows = []
    for p in points:
        lens = [r.prompt_tokens for r in p.records if r.ok and r.prompt_tokens is not None]
        row: dict[str, Any] = {"concurrency": p.result.max_concurrency}
        for c in p.cross_checks:
            short = c.metric.removeprefix("vllm:").removesuffix("_total")
            row |= {f"server {short}": c.server, f"client {short}": c.client, f"{short} agree": c.agrees}
        asked = settings.input_len
        row["prompt tokens (server usage)"] = f"{min(lens, default=0)}..{max(lens, default=0)} (asked {asked})"
        rows.append(row)
    return rows


def client_rows(points: list[Point]) -> list[dict[str, Any]]:
    """Per point and load generator: tokens, CPU seconds, share of a core, and the implied ceiling."""
    return [{"concurrency": p.result.max_concurrency, "engine": c.engine, "tokens": c.tokens,
             "chunks": c.chunks, "client CPU s": round(c.cpu_s, 3), "wall s": round(c.wall_s, 2),
             "CPU % of a core": round(100 * c.cpu_utilization, 1),
             "ceiling tok/s": round(c.ceiling_tok_s) if c.ceiling_tok_s else None}
            for p in points for c in p.clients]


def depth_rows(sweep: DepthSweep) -> list[dict[str, Any]]:
    """One row per depth: the prompt the server counted, TTFT, prefill and decode rates (medians), failures."""
    def r(value: float | None, digits: int = 1) -> float | None:
        return None if value is None else round(value, digits)

    return [{"depth": p.depth, "prompt tokens (depth + input)": p.depth + p.input_len,
             "prompt tokens (server usage)": p.prompt_tokens, "output tokens": p.output_len,
             "repeats": len(p.ttft_ms_repeats), "TTFT ms": r(p.ttft_ms), "prefill tok/s": r(p.prefill_tok_s),
             "decode tok/s": r(p.decode_tok_s, 2), "failed": len(p.errors),
             "errors": "; ".join(p.errors)[:300] or None} for p in sweep.points]


def prefix_rows(pair: PrefixCachePair) -> list[dict[str, Any]]:
    """The prefix-cache pair as two rows, the first request (cold) and the second (same prefix)."""
    return [{"request": name, "prompt tokens": pair.prefix_tokens + pair.suffix_tokens,
             "shared prefix tokens": pair.prefix_tokens, "TTFT ms": None if ttft is None else round(ttft, 1),
             "against the first": None if ttft is None or not pair.first_ttft_ms
             else round(ttft / pair.first_ttft_ms, 3),
             "prefix-cache lookups (tokens)": queried, "prefix-cache hits (tokens)": hits}
            for name, ttft, queried, hits in (("first (fills the cache)", pair.first_ttft_ms, None, None),
                                              ("second (same prefix, new suffix)", pair.second_ttft_ms,
                                               pair.queried_tokens, pair.cached_tokens))]
