"""The soak's series over time (matplotlib): output tok/s per sample interval with its windows, each node's
MemAvailable, swap and memory pressure, the server's queue, and the GPUs' clocks, temperature and power where sampled;
a failure is the red line where it was found."""
from __future__ import annotations

from typing import Any

from matplotlib.figure import Figure

from .soak import SoakResult, token_times, window_length


def _minutes(at: float, start: float) -> float:
    return (at - start) / 60


def _throughput(ax: Any, r: SoakResult, start: float) -> None:
    step = r.settings.soak_sample_s
    chunks = [c for rec in r.records for c in token_times(rec)]
    bins = int((r.ended_at - start) // step) + 1
    counts = [0.0] * bins
    for at, tokens in chunks:
        if start <= at < start + bins * step:
            counts[int((at - start) // step)] += tokens
    ax.plot([_minutes(start + (k + 0.5) * step, start) for k in range(bins)], [c / step for c in counts], ".-",
            label=f"per {step:g} s")
    if r.windows:
        first = min(at for at, _ in chunks)
        length = window_length(r.settings.soak_s)
        edges = [w.start_s for w in r.windows] + [r.windows[-1].start_s + r.windows[-1].length_s]
        ax.step([_minutes(first + e, start) for e in edges], [w.tok_s for w in r.windows] + [r.windows[-1].tok_s],
                where="post", label=f"per {length:g}-s window")
    ax.set_ylabel("output tok/s")
    ax.set_title("Throughput")


def _nodes(axes: Any, r: SoakResult, start: float) -> None:
    mem, psi = axes
    for node in dict.fromkeys(s.node for s in r.nodes):
        mine = [s for s in r.nodes if s.node == node and not s.unreachable]
        t = [_minutes(s.at, start) for s in mine]
        mem.plot(t, [s.mem_available_gib for s in mine], label=f"{node} MemAvailable")
        mem.plot(t, [s.swap_used_gib for s in mine], "--", label=f"{node} swap used")
        psi.plot(t, [s.psi_some for s in mine], label=f"{node} some")
        psi.plot(t, [s.psi_full for s in mine], ":", label=f"{node} full")
    mem.set_ylabel("GiB")
    mem.set_title("Memory")
    psi.set_ylabel("% of time (avg10)")
    psi.set_title("Memory pressure (PSI)")


def _server(ax: Any, r: SoakResult, start: float) -> None:
    t = [_minutes(s.at, start) for s in r.server]
    ax.plot(t, [s.running for s in r.server], label="running")
    ax.plot(t, [s.waiting for s in r.server], label="waiting")
    ax.set_ylabel("requests")
    ax.set_title("Server queue (/metrics)")


def _gpus(ax: Any, r: SoakResult, start: float) -> None:
    gpus = [(s.at, g) for s in r.nodes for g in s.gpus]
    if not gpus:
        ax.text(0.5, 0.5, "no GPU sampled\n(no node lists GPUs, or no nvidia-smi)", ha="center", va="center",
                transform=ax.transAxes)
    for key in dict.fromkeys((g.node, g.gpu) for _, g in gpus):
        mine = [(at, g) for at, g in gpus if (g.node, g.gpu) == key]
        t = [_minutes(at, start) for at, _ in mine]
        ax.plot(t, [g.sm_mhz for _, g in mine], label=f"{key[0]} GPU{key[1]} SM MHz")
        ax.plot(t, [g.temperature_c for _, g in mine], "--", label=f"{key[0]} GPU{key[1]} C")
        ax.plot(t, [g.power_w for _, g in mine], ":", label=f"{key[0]} GPU{key[1]} W")
    ax.set_title("GPU clocks, temperature, power")


def soak_figure(r: SoakResult) -> Figure:
    """Five panels over minutes into the soak."""
    fig = Figure(figsize=(12, 9))
    axes = fig.subplots(3, 2).flatten()
    start = r.started_at
    _throughput(axes[0], r, start)
    _nodes(axes[1:3], r, start)
    _server(axes[3], r, start)
    _gpus(axes[4], r, start)
    axes[5].axis("off")
    axes[5].text(0, 0.5, r.failure.text()[:600] if r.failure else "the soak held", wrap=True, fontsize=8,
                 color="#a00" if r.failure else "green", transform=axes[5].transAxes)
    for ax in axes[:5]:
        if r.failure:
            ax.axvline(_minutes(r.failure.at, start), color="red", alpha=0.7)
        ax.set_xlabel("minutes into the soak")
        ax.grid(True, alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    fig.tight_layout()
    return fig
