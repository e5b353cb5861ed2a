"""The benchmark stage: warm-up, a concurrency sweep from one or several load generators, the points as their
files hold them (the notebook writes them).

Each sweep point: warm-up requests (not counted; distinct prompts at the point's concurrency) → scrape /metrics →
`repeats` loads of fresh prompts → scrape again → the median and spread of the repeats' summaries with
`vllm bench serve`'s field names, stalled repeats, the server-side token cross-check and the client's own CPU cost.
With `clients > 1` the load runs on that many local ipyparallel engines, concurrency split between them,
started together at an agreed wall-clock instant; their per-request records are merged.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Protocol

import aiohttp

from ...core.analysis.benchstats import (
    ClientLoad,
    CrossCheck,
    Delta,
    RequestRecord,
    Roofline,
    aggregate_repeats,
    client_load,
    cross_check,
    find_stall,
    median_ttft_ms,
    prefill_group_sizes,
    prometheus_totals,
    prompt_seed,
    repeat_figures,
    summarize,
)
from ...core.analysis.depthsweep import DepthDelta, DepthSweep
from ...core.analysis.depthsweep import failed as failed_depth_requests
from ...core.cluster.nodes import Node
from ...core.values.benchbudget import point_timeout_s, warmup_count
from ...core.values.errors import SparkbookError
from ...core.values.evidence import Decision
from ...core.values.handoff import BenchDepth, BenchmarkSummary, BenchPoint, PrefixCacheFigure
from ...core.values.params import BenchmarkSettings
from ...core.values.stagelist import BENCH
from ...core.values.sweeppoint import GpuClocks, Speculation, Stall, SweepPoint
from .client import (
    CompletionsServer,
    LoadResult,
    Prompt,
    make_prompts,
    metrics_page,
    run_load,
    run_load_on_engine,
    send_prefill_groups,
    text_prompts,
    tokenize,
)
from .clocks import Sampler, gpu_nodes
from .clocks import summarize as summarize_clocks
from .specmetrics import spec_counters, speculation


@dataclass(frozen=True)
class Point:
    """One concurrency of the sweep: the vLLM-named result (medians over the repeats) and the evidence around it."""

    result: SweepPoint
    cross_checks: list[CrossCheck]
    clients: list[ClientLoad]  # per load generator, summed over the repeats
    records: list[RequestRecord]  # every repeat's, in order
    repeats: list[dict[str, float | None]]  # each repeat's REPEAT_METRICS
    stalls: list[Stall]
    clocks: list[GpuClocks] = field(default_factory=list)  # per GPU through the repeats (none: not sampled)
    clocks_note: str | None = None  # why no clocks were sampled, or which node stopped answering
    speculation: Speculation | None = None  # the server's speculative-decoding counters over the repeats


class LoadRunner(Protocol):
    def __call__(self, prompts: list[Prompt], output_len: int, concurrency: int,
                 timeout_s: float) -> list[LoadResult]: ...


def split(total: int, parts: int) -> list[int]:
    """`total` split into `parts` near-equal shares, larger shares first (zeros when total < parts)."""
    return [total // parts + (1 if i < total % parts else 0) for i in range(parts)]


def local_runner(target: CompletionsServer) -> LoadRunner:
    """The load from this process (one client)."""
    def run(prompts: list[Prompt], output_len: int, concurrency: int, timeout_s: float) -> list[LoadResult]:
        return [run_load(target, prompts, output_len, concurrency, timeout_s)]
    return run


class Engines:
    """`with Engines(n) as engines:` n local ipyparallel engines as load generators; stopped on exit."""

    def __init__(self, count: int, start_timeout_s: float = 120.0):
        self.count, self.start_timeout_s = count, start_timeout_s
        self._cluster: Any = None
        self._client: Any = None

    def __enter__(self) -> Engines:
        import ipyparallel as ipp

        self._cluster = ipp.Cluster(n=self.count, log_level=logging.WARNING)
        self._cluster.start_cluster_sync()
        self._client = self._cluster.connect_client_sync()
        self._client.wait_for_engines(self.count, timeout=self.start_timeout_s, interactive=False)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._client is not None:
            self._client.close()
        if self._cluster is not None:
            self._cluster.stop_cluster_sync()

    def runner(self, target: CompletionsServer, start_delay_s: float = 2.0) -> LoadRunner:
        """Each engine runs its share of prompts and concurrency, all starting at the same instant."""
        def run(prompts: list[Prompt], output_len: int, concurrency: int, timeout_s: float) -> list[LoadResult]:
            start_at = time.time() + start_delay_s
            shares, sizes = split(concurrency, self.count), split(len(prompts), self.count)
            jobs, offset = [], 0
            for engine, (share, size) in enumerate(zip(shares, sizes, strict=False)):
                if share and size:
                    jobs.append(self._client[engine].apply_async(
                        run_load_on_engine, asdict(target), prompts[offset:offset + size], output_len, share,
                        timeout_s, start_at))
                offset += size
            return [_load_result(job.get(timeout=timeout_s + start_delay_s + 30)) for job in jobs]
        return run


def _load_result(data: dict[str, Any]) -> LoadResult:
    return LoadResult(**{**data, "records": [RequestRecord(**r) for r in data["records"]]})


def prompt_pool(target: CompletionsServer) -> list[int]:
    """Token ids the server's tokenizer makes of ordinary text: the alphabet prompts are drawn from."""
    return sorted(set(tokenize(target)))


def warm_up(target: CompletionsServer, settings: BenchmarkSettings, pool: list[int], concurrency: int,
            timeout_s: float) -> None:
    """The point's warm-up, not counted, every prompt distinct and none shared with a measured repeat, never more
    than `concurrency` in flight: prefill-only groups of 1 .. concurrency prompts (benchstats.prefill_group_sizes), then
    of 1 .. concurrency - 1 beside one decoding sequence (the other parity of a step's token count), then
    warmup_count full-length requests `concurrency` at a time."""
    alone = prefill_group_sizes(settings, concurrency)
    if not alone:
        return
    beside = [k for k in alone if k < concurrency]
    ids = iter(make_prompts(pool, sum(alone) + sum(beside) + 1, settings.input_len, prompt_seed(concurrency, -2)))
    companion = next(ids)
    send_prefill_groups(target, [[next(ids) for _ in range(k)] for k in alone], timeout_s)
    if beside:
        send_prefill_groups(target, [[next(ids) for _ in range(k)] for k in beside], timeout_s, companion=companion,
                       companion_len=settings.output_len)
    prompts = text_prompts(target, pool, warmup_count(settings, concurrency), settings.input_len,
                           seed=prompt_seed(concurrency, -1))
    run_load(target, prompts, settings.output_len, concurrency, timeout_s)


class BenchmarkError(SparkbookError):
    """The benchmark could not go on; the message says why."""

    stage = BENCH.name


class ServerGone(BenchmarkError):
    """The server stopped answering during the benchmark: the message names it, the point and what was seen."""


def measure_point(target: CompletionsServer, settings: BenchmarkSettings, pool: list[int], concurrency: int,
                  runner: LoadRunner, timeout_s: float, sampler: Sampler | None = None) -> Point:
    """Warm up, then `repeats` times `num_prompts` fresh prompts at `concurrency`, between two /metrics scrapes.
    Raises ServerGone at once when the server stops answering (its requests fail, /metrics is refused)."""
    try:
        return _measure_point(target, settings, pool, concurrency, runner, timeout_s, sampler or Sampler([]))
    except (TimeoutError, aiohttp.ClientError, OSError) as exc:
        raise ServerGone(f"the server at {target.base_url} ({target.model}) stopped answering during the "
                         f"c={concurrency} point: {type(exc).__name__}: {str(exc)[:200]}",
                         remediation="read 05's serve log tails on the head and serve again (05)") from None


def _measure_point(target: CompletionsServer, settings: BenchmarkSettings, pool: list[int], concurrency: int,
                   runner: LoadRunner, timeout_s: float, sampler: Sampler) -> Point:
    warm_up(target, settings, pool, concurrency, timeout_s)
    prompt_sets = [text_prompts(target, pool, settings.num_prompts, settings.input_len,
                                seed=prompt_seed(concurrency, r))
                   for r in range(settings.repeats)]
    before = metrics_page(target)
    with sampler:
        runs = [runner(prompts, settings.output_len, concurrency, timeout_s) for prompts in prompt_sets]
    after = metrics_page(target)
    by_repeat = [[r for load in loads for r in load.records] for loads in runs]
    summaries = [summarize(records, max(load.finished_at for load in loads) - min(load.started_at for load in loads),
                           concurrency) for records, loads in zip(by_repeat, runs, strict=False)]
    result = aggregate_repeats(summaries)
    checks = cross_check(prometheus_totals(before), prometheus_totals(after), server_counts(result))
    clients = [client_load(i, sum(r.output_tokens for load in loads for r in load.records if r.ok),
                           sum(load.chunks for load in loads), sum(load.cpu_s for load in loads),
                           sum(load.finished_at - load.started_at for load in loads))
               for i, loads in enumerate(zip(*runs, strict=False))]
    baseline = min((m for m in map(median_ttft_ms, by_repeat) if m is not None), default=None)
    stalls = [s for r, records in enumerate(by_repeat) if (s := find_stall(records, concurrency, r, baseline))]
    note = "; ".join(f"{n}: {why}" for n, why in sampler.errors.items()) or None if sampler.nodes else \
        "not sampled: no node lists GPUs (params nodes[].gpus)"
    return Point(result, checks, clients, [r for records in by_repeat for r in records], repeat_figures(summaries),
                 stalls, summarize_clocks(sampler.samples, settings.clock_drop), note,
                 speculation(spec_counters(before), spec_counters(after)))


def server_counts(result: SweepPoint) -> dict[str, int]:
    """The client's token counts under the names of the server's counters that should equal them."""
    return {"vllm:generation_tokens_total": result.total_output_tokens or 0,
            "vllm:prompt_tokens_total": result.total_input_tokens or 0}


def sweep(target: CompletionsServer, settings: BenchmarkSettings, runner: LoadRunner,
          on_point: Callable[[Point], None] | None = None, sampler: Sampler | None = None) -> list[Point]:
    """Every concurrency of the settings, in order, each within its point_timeout_s; `on_point` is told after each;
    `sampler` samples the GPUs' clocks through each point's repeats."""
    pool = prompt_pool(target)
    points = []
    for concurrency in settings.concurrency:
        points.append(measure_point(target, settings, pool, concurrency, runner, point_timeout_s(settings, concurrency),
                                    sampler))
        if on_point:
            on_point(points[-1])
    return points


def run_sweep(target: CompletionsServer, settings: BenchmarkSettings,
              on_point: Callable[[Point], None] | None = None, nodes: list[Node] | None = None) -> list[Point]:
    """The sweep from this process (clients == 1) or from `settings.clients` ipyparallel engines; the clocks of the
    GPUs of `nodes` (those that list GPUs) sampled through every point."""
    sampler = Sampler(gpu_nodes(nodes or []))
    if settings.clients == 1:
        return sweep(target, settings, local_runner(target), on_point=on_point, sampler=sampler)
    with Engines(settings.clients) as engines:
        return sweep(target, settings, engines.runner(target), on_point=on_point, sampler=sampler)


def gpu_name(head: Node) -> str | None:
    """The card the head reports, as nvidia-smi names it (its first GPU; None: nvidia-smi names none)."""
    listed = head.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], timeout=30)
    names = listed.stdout.strip().splitlines() if listed.ok else []
    return (names[0].strip() or None) if names else None


def load_generator_verdict(points: list[Point], clients: int, busy: float = 0.7) -> Decision:
    """Were the load generators fast enough? Not when one was busier than `busy` of a core at some point."""
    worst = max((c for p in points for c in p.clients), key=lambda c: c.cpu_utilization)
    at = next(p.result.max_concurrency for p in points if worst in p.clients)
    evidence = [f"busiest client: engine {worst.engine} at concurrency {at}, {100 * worst.cpu_utilization:.0f}% of "
                f"a core, ceiling {worst.ceiling_tok_s or 0:,.0f} tok/s per client process"]
    if worst.cpu_utilization < busy:
        return Decision("Were the load generators the bottleneck?", "no",
                        f"every client stayed under {100 * busy:.0f}% of a core", evidence=evidence)
    return Decision("Were the load generators the bottleneck?", "possibly",
                    f"a client reached {100 * worst.cpu_utilization:.0f}% of a core: raise benchmark.clients "
                    f"above {clients} and compare", evidence=evidence)


# --- results as their files hold them ---------------------------------------------------------------------
def saved_point(point: Point, target: CompletionsServer, settings: BenchmarkSettings, clients: int) -> SweepPoint:
    """The point as `vllm bench serve --save-result` writes it (same names), plus sparkbook's extras."""
    ok = [r for r in point.records if r.ok]
    return SweepPoint.model_validate({
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"), "backend": "sparkbook", "endpoint_type": "vllm",
        "model_id": target.model, "base_url": target.base_url, "request_rate": "inf", "burstiness": 1.0,
        "random_input_len": settings.input_len, "random_output_len": settings.output_len,
        "num_warmups": warmup_count(settings, point.result.max_concurrency),
        **point.result.model_dump(exclude={"sparkbook"}),
        "input_lens": [r.prompt_tokens for r in ok], "output_lens": [r.output_tokens for r in ok],
        "ttfts": [r.ttft_s for r in ok], "itls": [r.chunk_gaps_s for r in ok],
        "errors": [r.error for r in point.records],
        "sparkbook": {"load_generators": clients, "itl_definition": "per chunk (vLLM); itl_per_token: per token",
                      "aggregation": "counts summed over the repeats, every other figure their median",
                      "repeats": point.repeats, "stalls": point.stalls,
                      "server_cross_check": [asdict(c) for c in point.cross_checks],
                      "client_load": [asdict(c) for c in point.clients],
                      "chunk_tokens": [r.chunk_tokens for r in ok],
                      "clocks": [asdict(c) for c in point.clocks], "clocks_note": point.clocks_note,
                      "speculation": asdict(point.speculation) if point.speculation else None},
    })


def saved_points(points: list[Point], target: CompletionsServer, settings: BenchmarkSettings,
                 clients: int) -> list[SweepPoint]:
    """Every point as its bench/c<concurrency>.json holds it, by concurrency (the notebook writes them)."""
    return sorted((saved_point(p, target, settings, clients) for p in points), key=lambda p: p.max_concurrency)


# --- the summary other notebooks read -----------------------------------------------------------------
def at_concurrency(results: list[SweepPoint], concurrency: int) -> SweepPoint | None:
    return next((r for r in results if r.max_concurrency == concurrency), None)


def depth_figures(depth: DepthSweep | None) -> dict[str, Any]:
    """The depth points and the prefix-cache pair as the summary hands them on (nothing: not measured)."""
    if depth is None:
        return {}
    pair = depth.prefix_cache
    return {"depths": [BenchDepth.model_validate(p.model_dump(include=set(BenchDepth.model_fields)))
                       for p in depth.points],
            "prefix_cache": PrefixCacheFigure(**pair.model_dump(include=set(PrefixCacheFigure.model_fields)),
                                              ratio=pair.ratio, reuse=pair.reuse()) if pair else None}


def summary(results: list[SweepPoint], roof: Roofline | None, bench_dir: Path, earlier: Path | None,
            deltas: list[Delta], depth: DepthSweep | None = None,
            depth_deltas: list[DepthDelta] | None = None) -> BenchmarkSummary:
    """What later readers need: single stream, peak, roofline share, the depth axis and the prefix-cache pair,
    regressions (for state.json)."""
    single = at_concurrency(results, 1)
    peak = max(results, key=lambda r: r.output_throughput or 0)
    worse = [f"c={d.max_concurrency} {d.metric} {d.change_pct:+.1f}%" for d in deltas if d.worse]
    worse += [f"depth {d.depth} {d.metric} {d.change_pct:+.1f}%" for d in depth_deltas or [] if d.worse]
    return BenchmarkSummary(
        single_stream_output_tok_s=single.output_throughput if single else None,
        single_stream_median_tpot_ms=single.median_tpot_ms if single else None,
        single_stream_median_ttft_ms=single.median_ttft_ms if single else None,
        peak_output_tok_s=peak.output_throughput, peak_at_concurrency=peak.max_concurrency,
        failed_requests=sum(r.failed for r in results) + failed_depth_requests(depth),
        roofline_ceiling_tok_s=roof.ceiling_tok_s if roof else None,
        roofline_percent=roof.percent_of_ceiling if roof else None,
        bench_dir=str(bench_dir), compared_with=str(earlier) if earlier else None,
        worse_than_earlier=worse,
        points=[BenchPoint.model_validate(r.model_dump(include=set(BenchPoint.model_fields))) for r in results],
        **depth_figures(depth),
    )
