"""One point of 06's concurrency sweep as a typed value, and its vLLM-bench JSON form on disk (bench/c*.json).

The point travels from the load client's summary through the sweep, the plots, the archive and the comparison of
two runs; its fields are named as `vllm bench serve --save-result` names them, so a file of either tool reads back
as a point. What a file holds beyond the fields read here (the per-request lists, the run's description, sparkbook's
cross-check and client load) is kept as it was read and written back unchanged. Core, because 06 writes points and
the records read them.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict

from .rundir import point_file, point_files

LATENCIES = ("ttft", "tpot", "itl", "itl_per_token", "e2el")
STATS = ("mean", "median", "std", "p90", "p99")


@dataclass(frozen=True)
class Stall:
    """A repeat whose TTFT p99 exceeded STALL_FACTOR x the median TTFT, and the requests over that line."""

    max_concurrency: int
    repeat: int
    median_ttft_ms: float  # this repeat's
    baseline_ttft_ms: float  # the median the line is drawn from: the lowest of the point's repeats' medians
    p99_ttft_ms: float
    requests: list[dict[str, int | float]]  # {"index": position in the repeat's prompts, "ttft_ms", "sent_at_s":
    #                                          after the repeat's first request}


@dataclass(frozen=True)
class GpuClocks:
    """One GPU through one point's repeats (06, nvidia-smi): its SM clock at the start, lowest and mean, the hottest
    it got and its mean power; whether the clock fell more than benchmark.clock_drop below its start."""

    node: str
    gpu: int
    samples: int
    sm_start_mhz: float | None
    sm_min_mhz: float | None
    sm_mean_mhz: float | None
    temperature_max_c: float | None
    power_mean_w: float | None
    drop_pct: float | None  # how far the lowest SM clock fell below the start, in %
    dropped: bool


@dataclass(frozen=True)
class Speculation:
    """The counters' growth over one point's window, and vLLM's figures of it (None where nothing was drafted)."""

    drafts: int
    draft_tokens: int
    accepted: int
    accepted_per_position: tuple[int, ...]

    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted / self.draft_tokens if self.draft_tokens else None

    @property
    def per_position_rate(self) -> tuple[float, ...]:
        return tuple(a / self.drafts for a in self.accepted_per_position) if self.drafts else ()

    @property
    def mean_acceptance_length(self) -> float | None:
        """Tokens each verification step emits: the accepted drafts and the target's own token."""
        return 1 + self.accepted / self.drafts if self.drafts else None


class SparkbookExtras(BaseModel):
    """sparkbook's own part of a point's file: each repeat's figures and the stalled repeats (read back by the
    tables and the noise band); the cross-check and client load are kept for a reader of the file."""

    model_config = ConfigDict(frozen=True, extra="allow")
    repeats: list[dict[str, float | None]] = []
    stalls: list[Stall] = []
    clocks: list[GpuClocks] = []  # none: not sampled (clocks_note says why) or a point saved before issue 31
    clocks_note: str | None = None
    speculation: Speculation | None = None  # what speculative decoding did (none: the server does not speculate)


class SweepPoint(BaseModel):
    """One concurrency: counts, throughputs and latency statistics (ms) under vLLM-bench's names; None where the
    point has no such figure (no completed request, or an older file without it)."""

    model_config = ConfigDict(frozen=True, extra="allow")
    max_concurrency: int
    num_prompts: int | None = None
    completed: int = 0
    failed: int = 0
    duration: float | None = None
    total_input_tokens: int | None = None
    total_output_tokens: int | None = None
    request_throughput: float | None = None
    output_throughput: float | None = None
    total_token_throughput: float | None = None
    mean_ttft_ms: float | None = None
    median_ttft_ms: float | None = None
    std_ttft_ms: float | None = None
    p90_ttft_ms: float | None = None
    p99_ttft_ms: float | None = None
    mean_tpot_ms: float | None = None
    median_tpot_ms: float | None = None
    std_tpot_ms: float | None = None
    p90_tpot_ms: float | None = None
    p99_tpot_ms: float | None = None
    mean_itl_ms: float | None = None
    median_itl_ms: float | None = None
    std_itl_ms: float | None = None
    p90_itl_ms: float | None = None
    p99_itl_ms: float | None = None
    mean_itl_per_token_ms: float | None = None
    median_itl_per_token_ms: float | None = None
    std_itl_per_token_ms: float | None = None
    p90_itl_per_token_ms: float | None = None
    p99_itl_per_token_ms: float | None = None
    mean_e2el_ms: float | None = None
    median_e2el_ms: float | None = None
    std_e2el_ms: float | None = None
    p90_e2el_ms: float | None = None
    p99_e2el_ms: float | None = None
    sparkbook: SparkbookExtras = SparkbookExtras()

    def figure(self, name: str) -> float | None:
        """A figure by its vLLM-bench name ('median_ttft_ms'): how comparisons and plots iterate over metrics."""
        if name not in FIGURES:
            raise KeyError(f"{name!r} is not a figure of a sweep point (one of {', '.join(FIGURES)})")
        value = getattr(self, name)
        return None if value is None else float(value)

    def to_json(self) -> dict[str, Any]:
        """The file's form: vLLM-bench's fields, then whatever else the point carries."""
        return self.model_dump(mode="json")


FIGURES = tuple(name for name in SweepPoint.model_fields if name not in ("max_concurrency", "sparkbook"))


def read_points(run_dir: Path) -> list[SweepPoint]:
    """The saved sweep points of a run dir, by concurrency ([] where 06 did not run)."""
    points = [SweepPoint.model_validate_json(p.read_text()) for p in point_files(run_dir)]
    return sorted(points, key=lambda p: p.max_concurrency)


def write_point(run_dir: Path, point: SweepPoint) -> Path:
    """Save one point in its vLLM-bench JSON form (bench/c<concurrency>.json)."""
    path = point_file(run_dir, point.max_concurrency)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(point.to_json(), indent=1))
    return path
