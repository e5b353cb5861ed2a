"""Benchmark figures (matplotlib): throughput and latency percentiles against concurrency, TTFT and decode against
context depth."""
from __future__ import annotations

import math
from typing import Any

from matplotlib.figure import Figure

from ...core.analysis.benchstats import BatchCeiling, repeat_spread
from ...core.analysis.depthsweep import DepthSweep
from ...core.values.sweeppoint import SweepPoint


def _value(figure: float | None) -> float:
    """A figure to plot: NaN (no marker) where the point has none."""
    return math.nan if figure is None else figure


def _concurrency_axis(ax: Any, concurrency: list[int]) -> None:
    ax.set_xscale("log", base=2)
    ax.set_xticks(concurrency, [str(c) for c in concurrency])
    ax.set_xlabel("concurrent requests")
    ax.grid(True, alpha=0.3)


def throughput_figure(points: list[SweepPoint], ceilings: list[BatchCeiling] | None = None,
                      earlier: list[SweepPoint] | None = None) -> Figure:
    """Output tokens/s (median of the repeats, their min-max as error bars) against concurrency; the decode ceiling
    at each concurrency and an earlier run when given."""
    fig = Figure(figsize=(6.5, 4))
    ax = fig.subplots()
    conc = [p.max_concurrency for p in points]
    tput = [_value(p.output_throughput) for p in points]
    spreads = [repeat_spread(p, "output_throughput") for p in points]
    bars = [[t - s.low if s else 0.0 for t, s in zip(tput, spreads, strict=True)],
            [s.high - t if s else 0.0 for t, s in zip(tput, spreads, strict=True)]]
    ax.errorbar(conc, tput, yerr=bars, fmt="o-", capsize=3,
                label="output tok/s (this run; median, min-max of the repeats)")
    if earlier:
        ax.plot([p.max_concurrency for p in earlier], [_value(p.output_throughput) for p in earlier], "s--",
                alpha=0.6, label="output tok/s (earlier run)")
    if ceilings:
        ax.plot([c.concurrency for c in ceilings], [c.ceiling_tok_s for c in ceilings], "v:", color="grey",
                label="decode ceiling at each concurrency")
        for c in ceilings:
            if c.percent_of_ceiling is not None:
                ax.annotate(f"{c.percent_of_ceiling:.0f}%", (c.concurrency, c.measured_tok_s), fontsize=7,
                            textcoords="offset points", xytext=(4, -10))
        if max(c.ceiling_tok_s for c in ceilings) > 10 * max(p.output_throughput or 0 for p in points):
            ax.set_yscale("log")  # a ceiling far above the measured points would flatten them
    _concurrency_axis(ax, conc)
    ax.set_ylabel("output tokens / s")
    ax.set_title("Throughput")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def latency_figure(points: list[SweepPoint]) -> Figure:
    """TTFT, TPOT and ITL per token: median, p90 and p99 against concurrency."""
    fig = Figure(figsize=(12, 3.8))
    conc = [p.max_concurrency for p in points]
    for ax, (metric, label) in zip(fig.subplots(1, 3), (("ttft", "TTFT"), ("tpot", "TPOT"),
                                                         ("itl_per_token", "ITL per token")), strict=True):
        for stat, style in (("median", "o-"), ("p90", "^--"), ("p99", "v:")):
            ax.plot(conc, [_value(p.figure(f"{stat}_{metric}_ms")) for p in points], style, label=stat)
        _concurrency_axis(ax, conc)
        ax.set_ylabel("ms")
        ax.set_title(label)
        ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def depth_figure(sweep: DepthSweep) -> Figure:
    """TTFT and decode tok/s (single stream, medians of the repeats) against context depth; the prefix-cache pair's
    second TTFT at its depth where it was measured."""
    fig = Figure(figsize=(10, 3.8))
    ttft_ax, decode_ax = fig.subplots(1, 2)
    depths = [p.depth for p in sweep.points]
    ttft_ax.plot(depths, [_value(p.ttft_ms) for p in sweep.points], "o-", label="TTFT (fresh prompt)")
    pair = sweep.prefix_cache
    if pair is not None and pair.second_ttft_ms is not None:
        ttft_ax.plot([pair.prefix_tokens], [pair.second_ttft_ms], "s", color="green",
                     label=f"TTFT, prefix cached ({pair.ratio or 0:.2f}x)")
    decode_ax.plot(depths, [_value(p.decode_tok_s) for p in sweep.points], "o-")
    for ax, (title, unit) in zip((ttft_ax, decode_ax), (("TTFT by depth", "ms"), ("Decode by depth", "tokens / s")),
                                 strict=True):
        ax.set_xlabel("context depth (tokens before the prompt)")
        ax.set_ylabel(unit)
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
    ttft_ax.legend(fontsize=8)
    fig.tight_layout()
    return fig
