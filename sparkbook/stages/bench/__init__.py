"""06: the benchmark stage: the sweep (sweep), its HTTP load generator (client), the context-depth axis and the
prefix-cache pair (depth), its tables and its plots (plot), the A/B of speculative decoding or of the layout (ab);
its front door, `preview` and `run`, here.

`run` measures the served model and sets the evidence around it: the sweep and its stalls, TTFT and decode at each
context depth and what a cached prefix saves, the server's /metrics
against the client's counts, the roofline and the ceiling at each concurrency, 04's all_reduce beside the decode,
the load generators' own ceiling, the earlier run of the cluster, the summary 06 hands on and, in an A/B's second
arm, which configuration stays serving.
"""
from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from matplotlib.figure import Figure

from ...core.analysis import benchstats, depthsweep, fabric, membandwidth
from ...core.analysis.benchcompare import EarlierSweep, SweepComparison
from ...core.analysis.benchstats import BatchCeiling, Roofline, StepModel
from ...core.analysis.depthsweep import DepthSweep
from ...core.analysis.membandwidth import Bandwidth
from ...core.cluster.context import Context
from ...core.cluster.progress import Progress
from ...core.values import rundir
from ...core.values.abarm import BASELINE
from ...core.values.evidence import Decision, Shown, StageOutcome
from ...core.values.handoff import (
    AbAnswers,
    AbBaseline,
    AbVerdict,
    BenchmarkSummary,
    Endpoint,
    FabricProof,
    ImageChoice,
)
from ...core.values.modelinfo import ModelFacts
from ...core.values.params import BenchmarkSettings
from ...core.values.state import Handoff
from ...core.values.sweeppoint import SweepPoint, read_points
from . import ab, depth, plot, sweep, tables
from .client import CompletionsServer, served_models
from .soak import SoakFailed, SoakResult, run_soak
from .soakplot import soak_figure
from .sweep import BenchmarkError, Point

NOT_COMPARED_IN_BASELINE = ("the A/B's baseline arm: the params' own plan, measured in the second arm, is what is "
                            "compared with the earlier run")
NO_AB = "no A/B in this run (benchmark.ab is not set, or the run did not include both 05 and 06)"
AB_BASELINE_ARM = "the A/B's baseline arm: the A/B is decided after the params' own plan is measured"
FAILED = "requests failed: see the sweep table and bench/*.json errors"

# where 06's points go once measured (session.keep_sweep): the session writes the run dir, not the stage
Keep = Callable[[list[SweepPoint], DepthSweep | None], object]


class FailedRequests(BenchmarkError):
    """Some of the sweep's requests failed: the figures do not measure the server serving every request."""


@dataclass(frozen=True)
class BenchPreview:
    """What 06 would send and to whom: the benchmark settings, the server (from 05's endpoint) and what it lists,
    the model facts the roofline needs (02) and 04's fabric figures; the endpoint-dependent parts are None where
    no notebook of the run has handed them on yet (`sparkbook plan` before any run)."""

    settings: BenchmarkSettings
    target: CompletionsServer | None
    served: tuple[str, ...] | None  # what GET /v1/models lists (None: no endpoint known to ask, or no answer)
    model: ModelFacts | None
    proof: FabricProof | None
    assumed: tuple[Handoff, ...] = ()
    unanswered: str | None = None  # why the server listed nothing (not up yet: `sparkbook plan` before 05)

    def shown(self) -> list[Shown]:
        s = self.settings
        where = {"endpoint": "not known yet (05-serve hands it on)", "served model": "-", "server lists": "-"}
        if self.target is not None:
            where = {"endpoint": self.target.base_url, "served model": self.target.model,
                     "server lists": ", ".join(self.served or ()) or f"no answer: {self.unanswered}"}
        return [Shown("Benchmark settings", {
            **where, "input tokens": s.input_len, "output tokens": s.output_len, "prompts per point": s.num_prompts,
            "concurrency": str(s.concurrency), "warm-up requests per point": s.warmup_requests,
            "repeats per point": s.repeats, "load generators": s.clients,
            "context depths (single stream)": str(s.depths) if s.depths else "none (benchmark.depths is [])",
            "prompt / output tokens at each depth": f"{s.depth_input_len} / {s.depth_output_len}"})]


def target_of(endpoint: Endpoint) -> CompletionsServer:
    return CompletionsServer(endpoint.base_url, endpoint.model, api_key_env=endpoint.api_key_env)


def preview(ctx: Context) -> BenchPreview:
    """The settings and the target; asks the server which models it lists (a read-only GET) where 05 named it."""
    endpoint = ctx.handoffs.get(Endpoint)
    target = target_of(endpoint) if endpoint is not None else None
    served, unanswered = None, None
    try:
        served = tuple(served_models(target)) if target is not None else None
    except (OSError, TimeoutError, aiohttp.ClientError) as exc:  # the server 05 would start is not up yet
        unanswered = f"{type(exc).__name__}: {exc}"[:200]
    return BenchPreview(ctx.params.benchmark, target, served, ctx.handoffs.get(ModelFacts),
                        ctx.handoffs.get(FabricProof), unanswered=unanswered)


@dataclass(frozen=True)
class AbResult:
    """The A/B's second arm: both arms' points, what they compare, the verdict and the decision recorded from it."""

    baseline: list[SweepPoint]
    second: list[SweepPoint]  # the params' own plan (ab.Contest.second names it)
    contest: ab.Contest
    verdict: AbVerdict
    decision: Decision

    def shown(self) -> list[Shown]:
        base, second = self.contest.labels
        return [Shown("Both arms at each concurrency (same prompts, seeds, warm-ups)",
                      ab.arm_rows(self.baseline, self.second, self.contest)),
                Shown(f"{second.capitalize()} / {base} output tok/s, against the noise band "
                      f"({self.verdict.crossing_words()})", ab.ratio_rows(self.verdict, self.contest))]


@dataclass(kw_only=True)
class BenchOutcome(StageOutcome):
    """The sweep and the evidence around it, each part for its own cell of the notebook."""

    settings: BenchmarkSettings
    ab_arm: str | None = None
    points: list[Point] = field(default_factory=list)
    paths: list[Path] = field(default_factory=list)  # bench/c<concurrency>.json per point (session.keep_sweep)
    bench_dir: str = "bench"  # where they are, relative to the run dir (ab-baseline/bench in the baseline arm)
    results: list[SweepPoint] = field(default_factory=list)  # each point as its file holds it, by concurrency
    stalls: list[dict[str, Any]] = field(default_factory=list)
    checks: list[dict[str, Any]] = field(default_factory=list)
    roof: Roofline | None = None  # None: no bandwidth known (`bandwidth` says why)
    bandwidth: Bandwidth | None = None
    step: StepModel | None = None
    ceilings: list[BatchCeiling] = field(default_factory=list)
    fabric: list[dict[str, object]] = field(default_factory=list)
    figures: dict[str, Figure] = field(default_factory=dict)
    load_generators: Decision | None = None
    soak: SoakResult | None = None
    soak_figures: dict[str, Figure] = field(default_factory=dict)  # rundir.SOAK_FIGURE, where a soak ran
    earlier_dir: Path | None = None
    looked_in: Path | None = None  # where the earlier run was looked for: the cluster's outputs
    comparison: SweepComparison | None = None
    summary: BenchmarkSummary | None = None
    ab: AbResult | None = None
    depth: DepthSweep | None = None  # None: benchmark.depths is []
    depth_file: str | None = None  # bench/depth.json, relative to the run dir, where the notebook keeps `depth`

    @property
    def single(self) -> SweepPoint | None:
        return sweep.at_concurrency(self.results, 1)

    def sweep_shown(self) -> list[Shown]:
        return [Shown(f"Sweep: medians of {self.settings.repeats} repeat(s) ({len(self.paths)} JSON files in "
                      f"{self.bench_dir}/ of the run dir)", tables.table(self.results)),
                Shown("Stalled repeats", self.stalls or "no repeat stalled (TTFT p99 within 10x the median)")]

    def depth_shown(self) -> list[Shown]:
        if self.depth is None:
            return [Shown("Context depth", "not measured: benchmark.depths is []")]
        pair = self.depth.prefix_cache
        return [Shown(f"Single stream at each context depth (medians of {self.settings.repeats} repeat(s); "
                      f"{self.depth_file} in the run dir)",
                      tables.depth_rows(self.depth)),
                Shown("Prefix caching: the same prefix sent twice", tables.prefix_rows(pair) if pair else
                      self.depth.prefix_cache_note),
                Shown("Prefix caching, said plainly", pair.verdict() if pair else self.depth.prefix_cache_note)]

    def cross_check_shown(self) -> list[Shown]:
        return [Shown("/metrics deltas against the client's counts", self.checks)]

    def roofline_shown(self) -> list[Shown]:
        bw = self.bandwidth
        if self.roof is None or bw is None:
            return [Shown("Single-stream decode roofline", f"not computed: {bw.source if bw else 'the sweep failed'}")]
        spec = ", in decode steps: speculation is on" if self.single and self.single.sparkbook.speculation else ""
        shown = [Shown(f"Single-stream decode roofline (bandwidth {bw.gbs:g} GB/s from the {bw.source}); its "
                       f"measured_tok_s is the {benchstats.TPOT_DECODE}, not the {benchstats.SINGLE_STREAM}{spec}",
                       self.roof)]
        return shown + ([Shown("Bandwidth of the params against the card's", bw.finding.text)] if bw.finding else [])

    @property
    def ceiling_formula(self) -> str:
        """The per-concurrency ceiling's formula with this run's numbers (markdown)."""
        return tables.ceiling_markdown(self.step, self.ceilings) if self.step else ""

    def ceilings_shown(self) -> list[Shown]:
        return [Shown("Decode ceiling at each measured concurrency, and the % of it reached",
                      tables.ceiling_rows(self.ceilings))]

    def fabric_shown(self) -> list[Shown]:
        return [Shown("04's all_reduce test beside the single-stream decode", self.fabric)]

    def load_generators_shown(self) -> list[Shown]:
        return [Shown("Load generators", tables.client_rows(self.points))]

    def comparison_shown(self) -> list[Shown]:
        if self.ab_arm == BASELINE:
            return [Shown("Compared with nothing", NOT_COMPARED_IN_BASELINE)]
        if self.comparison is None or self.earlier_dir is None:
            return [Shown("Compared with nothing", f"no earlier run with bench results under {self.looked_in}")]
        shown = [Shown(f"Compared with {self.earlier_dir.name}", self.comparison.text())]
        if self.comparison.deltas:
            shown.append(Shown("Sweep points against the earlier run", self.comparison.rows()))
        if self.comparison.depth_deltas:
            shown.append(Shown("Context depths against the earlier run", self.comparison.depth_rows()))
        return shown

    def summary_shown(self) -> list[Shown]:
        return [Shown("Benchmark summary", self.summary.model_dump(exclude={"points"}))] if self.summary else []

    def soak_shown(self) -> list[Shown]:
        return self.soak.shown() if self.soak else [Shown("Soak", "not run: the sweep's requests failed")]

    def ab_shown(self) -> list[Shown]:
        if self.ab is not None:
            return self.ab.shown()
        return [Shown("A/B", AB_BASELINE_ARM if self.ab_arm == BASELINE else NO_AB)]


def run(ctx: Context, preview: BenchPreview, *, ab_arm: str | None, bench_root: Path,
        earlier: EarlierSweep | None, keep: Keep) -> BenchOutcome:
    """The sweep, then the evidence around it in the notebook's order; failed requests end it as `error` once the
    summary is handed on, and the A/B's second arm (`ab_arm` other than None and "baseline") decides which
    configuration stays serving. Its points and depth points go to `keep` (session.keep_sweep, which writes them
    under `bench_root`'s bench/: the run dir, or the A/B baseline arm's own dir) as soon as they are measured, before
    the soak, so a soak that kills the kernel loses none; `earlier`: the earlier run's sweep to compare with
    (records.earlier.earlier_sweep through session.earlier_sweep(); None: there is none)."""
    s = preview.settings
    target = preview.target or target_of(ctx.handoffs.need(Endpoint))
    model = preview.model or ctx.handoffs.need(ModelFacts)
    out = BenchOutcome(settings=s, ab_arm=ab_arm)
    with Progress("benchmark sweep", total=len(s.concurrency), unit=" points") as progress:
        out.points = sweep.run_sweep(target, s, on_point=lambda p: progress.advance(
            note=f"c={p.result.max_concurrency}: {p.result.output_throughput:.0f} tok/s"), nodes=list(ctx.cluster))
    out.results = sweep.saved_points(out.points, target, s, s.clients)
    out.paths = [rundir.point_file(bench_root, r.max_concurrency) for r in out.results]
    out.bench_dir = os.path.relpath(bench_root / rundir.BENCH, ctx.run_dir)
    out.depth = _depths(ctx, target, s)
    out.depth_file = os.path.relpath(depthsweep.depth_file(bench_root), ctx.run_dir) if out.depth else None
    keep(out.results, out.depth)
    out.stalls = tables.stall_rows(out.results)
    out.event("bench_stalls", out.stalls)
    out.checks = tables.cross_check_rows(out.points, s)
    out.event("bench_cross_check", out.checks)
    roof = _roofline(ctx, model, out)
    out.fabric = fabric.beside_decode(preview.proof, out.single.median_tpot_ms if out.single else None)
    compared = earlier if ab_arm != BASELINE else None
    out.earlier_dir, out.looked_in = compared.earlier.run_dir if compared else None, ctx.run_dir.parent
    out.figures = {"throughput.png": plot.throughput_figure(out.results, out.ceilings,
                                                            compared.earlier.points if compared else []),
                   "latency.png": plot.latency_figure(out.results)}
    if out.depth is not None and out.depth.points:
        out.figures["depth.png"] = plot.depth_figure(out.depth)
    out.load_generators = out.decide(sweep.load_generator_verdict(out.points, s.clients))
    out.comparison = compared.compared(out.results, out.depth) if compared else None
    deltas = out.comparison.deltas if out.comparison else []
    out.summary = sweep.summary(out.results, roof, bench_root / rundir.BENCH, out.earlier_dir, deltas, out.depth,
                                out.comparison.depth_deltas if out.comparison else [])
    out.handoffs.append(out.summary)
    if out.summary.failed_requests:
        out.error = FailedRequests(FAILED)
        return out
    if _soak(ctx, target, out, bench_root / rundir.BENCH):
        return out
    out.ab = ab_second_arm(ctx, out.results, ab_arm)
    if out.ab is not None:
        out.decide(out.ab.decision)
        out.handoffs.append(out.ab.verdict)
    return out


def _depths(ctx: Context, target: CompletionsServer, s: BenchmarkSettings) -> DepthSweep | None:
    """The context-depth axis and the prefix-cache pair on the server the sweep warmed (None where
    benchmark.depths is []); the server's argv (05's, the head's) says whether prefix caching is on."""
    if not s.depths:
        return None
    endpoint = ctx.handoffs.get(Endpoint)
    argv = endpoint.commands.get(ctx.head.name, []) if endpoint is not None else []
    with Progress("context depths", total=len(s.depths) + (max(s.depths) > 0), unit=" requests") as progress:
        return depth.measure(target, s, sweep.prompt_pool(target), argv, on_step=lambda note: progress.advance(
            note=note))


def _roofline(ctx: Context, model: ModelFacts, out: BenchOutcome) -> Roofline | None:
    """The single-stream roofline and the ceiling at each concurrency, recorded as one "roofline" event with the
    bandwidth and where it came from (None, said so: no bandwidth known for the card)."""
    serve, s = ctx.params.serve, out.settings
    out.bandwidth = membandwidth.bandwidth(s.memory_bandwidth_gbs, sweep.gpu_name(ctx.head))
    bandwidth = out.bandwidth.gbs
    if bandwidth is not None:
        out.roof = benchstats.roofline(model.active_params,
                                       benchstats.served_bytes_per_param(model.bytes_per_param, serve.dtype),
                                       serve.tensor_parallel_size, bandwidth,
                                       benchstats.decode_steps_from_tpot(out.single))
        out.step = benchstats.step_model(model, serve.dtype, serve.tensor_parallel_size, bandwidth, s.input_len,
                                         s.output_len)
        out.ceilings = benchstats.batch_ceilings(out.step, out.results)
    out.event("roofline", {"roofline": out.roof, "bandwidth": out.bandwidth, "by_concurrency": out.ceilings})
    return out.roof


def _soak(ctx: Context, target: CompletionsServer, out: BenchOutcome, bench_dir: Path) -> bool:
    """The soak after the sweep (its series in `bench_dir`), its report handed on and recorded; True where it failed
    (the outcome's error)."""
    out.soak = run_soak(ctx, target, bench_dir, out.ab_arm)
    if out.soak.skipped:
        return False
    report = out.soak.report()
    out.handoffs.append(report)
    out.event("soak", report.model_dump())
    out.soak_figures = {rundir.SOAK_FIGURE: soak_figure(out.soak)}
    if out.soak.failure:
        out.error = SoakFailed(out.soak.failure.text(), node=out.soak.failure.node,
                                    remediation="read the lines above and the serve logs (sparkbook logs), bring the "
                                    "deployment back (sparkbook up) and lower benchmark.soak_context or "
                                    "soak_concurrency, or serve.gpu_memory_utilization, where memory ran out")
    return out.soak.failure is not None


def _images(ctx: Context) -> tuple[str, str]:
    """The image A/B's two images by name: the baseline's (03's AbBaseline) and 03's choice."""
    baseline = ctx.handoffs.need(AbBaseline).image
    return baseline.ref if baseline else "no baseline", ctx.handoffs.need(ImageChoice).ref


def ab_second_arm(ctx: Context, results: list[SweepPoint], ab_arm: str | None) -> AbResult | None:
    """The A/B, in its second arm only: None without an A/B (ab_arm None) and in the baseline arm, which measures
    before the params' own plan is known."""
    if ab_arm is None or ab_arm == BASELINE or ctx.params.benchmark.ab is None:
        return None
    contest, decide_at = ab.contest(ctx.params), ctx.params.benchmark.ab_decide_at
    baseline = read_points(ctx.run_dir / rundir.AB_BASELINE)
    rows = ab.ratios(baseline, results)
    verdict = ab.image_verdict(rows, decide_at, contest, ctx.handoffs.get(AbAnswers) or AbAnswers(),
                               ctx.params.serve.quality.min_agreement, _images(ctx)) if contest.ab == "image" \
        else ab.verdict(rows, decide_at, contest)
    return AbResult(baseline, results, contest, verdict, ab.decision(verdict, contest))
