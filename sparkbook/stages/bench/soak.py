"""06's soak: sustained load at long context after the sweep, every node and the server sampled throughout, ended
early and failed on what minutes of load find: a dead engine, a node that stops answering, an Xid, an OOM kill, an
error rate past `benchmark.soak_max_error_rate`. Otherwise throughput over time and its worst window.

Why: engines die after 10-30 minutes with the cluster up and nothing serving (eugr/spark-vllm-docker#257), a GB10
freezes under sustained unified-memory pressure (vllm#46307), MTP crashes after minutes at 12-21k tokens of context
(vllm#40756); none of it shows in a health check or a sweep of short prompts.
"""
from __future__ import annotations

import json
import statistics
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import asdict, dataclass, field, replace
from datetime import UTC, datetime
from functools import partial
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from ...core.analysis.benchstats import RequestRecord
from ...core.cluster.context import Context
from ...core.cluster.nodes import Node, NodeError
from ...core.cluster.progress import Progress
from ...core.cluster.qualityapi import QualityReport, check, load_reference
from ...core.cluster.runtime import Spawned
from ...core.cluster.topology import places
from ...core.values.errors import SparkbookError
from ...core.values.evidence import Shown
from ...core.values.handoff import Endpoint, SoakReport
from ...core.values.params import SoakSettings, bearer
from ...core.values.rundir import SOAK_SERIES
from ...core.values.stagelist import BENCH
from . import nodewatch, soakload
from .client import CompletionsServer
from .nodewatch import NodeSample
from .sweep import prompt_pool

DEAD_AFTER = 2  # consecutive samples without an answer (/health, the node's probe, its serving process) that end it
MIN_ENDED = 10  # requests ended before the error rate is judged mid-soak (at the end: any number)
# vLLM's EngineDeadError: what its API server answers each request once the engine core died, while its /health may
# still answer for a sample or two (a rate rule would name the symptom, not the death)
ENGINE_DEAD_ERROR = "EngineCore encountered an issue"
LOG_TAIL_BYTES = 3000
HEALTH_TIMEOUT_S = 10.0


class SoakFailed(SparkbookError):
    """The soak found what the sweep did not: the message names the rule, the node, the time and the log lines."""

    stage = BENCH.name


@dataclass(frozen=True)
class ServerSample:
    """The server at one instant: /health, and the queue and error counters of its /metrics (vLLM's names)."""

    at: float
    answered: bool
    why: str | None = None  # what /health or /metrics said instead
    running: float | None = None  # vllm:num_requests_running
    waiting: float | None = None  # vllm:num_requests_waiting
    kv_usage: float | None = None  # vllm:kv_cache_usage_perc (0-1)
    aborted: float | None = None  # vllm:request_success_total{finished_reason="abort"}
    errors_5xx: float | None = None  # http_requests_total{status="5xx"}
    preemptions: float | None = None  # vllm:num_preemptions_total


@dataclass(frozen=True)
class Failure:
    rule: str  # engine dead | node unreachable | Xid | OOM kill | error rate | answers
    node: str | None
    at: float
    message: str
    lines: list[str] = field(default_factory=list)

    @property
    def time(self) -> str:
        return datetime.fromtimestamp(self.at, UTC).isoformat(timespec="seconds")

    def text(self) -> str:
        where = f" on {self.node}" if self.node else ""
        lines = "".join(f"\n  {line}" for line in self.lines)
        return f"soak failed: {self.rule}{where} at {self.time}: {self.message}{lines}"


@dataclass(frozen=True)
class Window:
    start_s: float  # seconds after the soak's first token
    length_s: float  # the window's span: `window_length`, or less for the last one
    tok_s: float  # output tokens streamed within it, per second of its span
    ended_ok: int
    ended_failed: int


# --- the metrics page ------------------------------------------------------------------------------------------
def server_sample(at: float, page: str) -> ServerSample:
    """The queue and error counters of a /metrics page (summed over engines and models)."""
    sums: dict[str, float] = {}
    for family in text_string_to_metric_families(page):
        for s in family.samples:
            key = s.name
            if s.name == "vllm:request_success_total":
                key = f"{s.name}:{s.labels.get('finished_reason')}"
            elif s.name == "http_requests_total":
                key = f"{s.name}:{s.labels.get('status')}"
            sums[key] = sums.get(key, 0.0) + s.value
    kv = sums.get("vllm:kv_cache_usage_perc", sums.get("vllm:gpu_cache_usage_perc"))
    return ServerSample(at, True, None, sums.get("vllm:num_requests_running"), sums.get("vllm:num_requests_waiting"),
                        kv, sums.get("vllm:request_success_total:abort"), sums.get("http_requests_total:5xx"),
                        sums.get("vllm:num_preemptions_total"))


def ask_server(target: CompletionsServer, headers: dict[str, str]) -> ServerSample:
    """GET /health, then /metrics, each under HEALTH_TIMEOUT_S."""
    at = time.time()
    try:
        health = httpx.get(target.url("/health"), timeout=HEALTH_TIMEOUT_S, headers=headers)
        if health.status_code != 200:
            return ServerSample(at, False, f"/health answered HTTP {health.status_code}")
        page = httpx.get(target.url("/metrics"), timeout=HEALTH_TIMEOUT_S, headers=headers)
        page.raise_for_status()
    except httpx.HTTPError as exc:
        return ServerSample(at, False, f"{type(exc).__name__}: {exc}"[:200])
    return server_sample(at, page.text)


# --- the verdict -------------------------------------------------------------------------------------------------
def kernel_failure(samples: list[NodeSample]) -> Failure | None:
    """The first Xid or OOM kill in the kernel lines new since each node's baseline."""
    for s in samples:
        for event in s.kernel_events:
            what = f"Xid {event.xid}" if event.xid is not None else event.kind
            return Failure(event.kind, s.node, s.at, f"the kernel log reports {what}", [event.line])
    return None


def engine_failure(server: list[ServerSample], nodes: list[NodeSample], head: str,
                   dead_after: int = DEAD_AFTER) -> Failure | None:
    """The server has not answered its last `dead_after` samples, a node's serving process was gone in its last
    `dead_after`, or a node's probe failed that often (a frozen node answers nothing)."""
    last = server[-dead_after:]
    if len(last) == dead_after and not any(s.answered for s in last):
        return Failure("engine dead", head, last[0].at, f"the server stopped answering ({last[-1].why})")
    for name in dict.fromkeys(s.node for s in nodes):
        mine = [s for s in nodes if s.node == name][-dead_after:]
        if len(mine) < dead_after:
            continue
        if all(s.serving is False for s in mine):
            return Failure("engine dead", name, mine[0].at, "its serving process is gone")
        if all(s.unreachable for s in mine):
            return Failure("node unreachable", name, mine[0].at, f"the node stopped answering ({mine[-1].unreachable})")
    return None


def engine_error(records: list[RequestRecord], head: str) -> Failure | None:
    """A request answered with vLLM's EngineDeadError: the engine core behind the head's API server died, by the
    time the first such answer came."""
    died = sorted((r for r in records if not r.ok and ENGINE_DEAD_ERROR in r.error), key=lambda r: r.done_at)
    return Failure("engine dead", head, died[0].done_at, f"its engine core died: {len(died)} request(s) answered "
                   "vLLM's EngineDeadError", [died[0].error]) if died else None


def error_failure(records: list[RequestRecord], max_rate: float, at: float, head: str, *,
                  final: bool) -> Failure | None:
    """More than `max_rate` of the ended requests failed (judged mid-soak once MIN_ENDED ended; at the end always)."""
    failed = [r for r in records if not r.ok]
    if not records or (not final and len(records) < MIN_ENDED) or len(failed) <= max_rate * len(records):
        return None
    errors = list(dict.fromkeys(r.error for r in failed))[:3]
    return Failure("error rate", head, at, f"{len(failed)} of {len(records)} requests failed "
                   f"({100 * len(failed) / len(records):.1f}% > benchmark.soak_max_error_rate "
                   f"{100 * max_rate:g}%)", errors)


def verdict(server: list[ServerSample], nodes: list[NodeSample], records: list[RequestRecord], max_rate: float,
            head: str, *, final: bool = False) -> Failure | None:
    """The first rule broken: the kernel's word first (it names the cause), then a dead engine or node, then the
    error rate, judged only while the server answers (requests failing against a dead one are the engine's death)."""
    at = server[-1].at if server else time.time()
    found = kernel_failure(nodes) or engine_failure(server, nodes, head) or engine_error(records, head)
    if found or (server and not server[-1].answered):
        return found
    return error_failure(records, max_rate, at, head, final=final)


# --- throughput over time ----------------------------------------------------------------------------------------
def token_times(record: RequestRecord) -> list[tuple[float, int]]:
    """(wall clock, tokens) of each streamed chunk of an ok request: the first at its TTFT, then after each gap."""
    if not record.ok or record.ttft_s is None:
        return []
    first = record.output_tokens - sum(record.chunk_tokens)
    at = record.sent_at + record.ttft_s
    out = [(at, first)]
    for gap, tokens in zip(record.chunk_gaps_s, record.chunk_tokens, strict=False):
        at += gap
        out.append((at, tokens))
    return out


def window_length(soak_s: float) -> float:
    """A minute, or a quarter of a soak under 3 minutes (the lab's), so a short soak still has windows to compare."""
    return 60.0 if soak_s >= 180 else max(2.0, soak_s / 4)


def windows(records: list[RequestRecord], end: float, length: float) -> list[Window]:
    """Output tok/s in consecutive windows from the soak's first token to `end`; a request's end is counted in the
    window it ended in. The first token comes seconds after the load starts (a full batch's prefill), so a last
    window of at least half a length is kept, rated over its own span: a 5-minute soak has 5 windows, not 4."""
    chunks = sorted(c for r in records for c in token_times(r))
    if not chunks:
        return []
    start, out = chunks[0][0], []
    spans = int((end - start) // length)
    bounds = [(start + k * length, start + (k + 1) * length) for k in range(spans)]
    if end - (start + spans * length) >= length / 2:
        bounds.append((start + spans * length, end))
    for lo, hi in bounds:
        ended = [r for r in records if lo <= r.done_at < hi]
        out.append(Window(round(lo - start, 1), round(hi - lo, 1),
                          round(sum(n for t, n in chunks if lo <= t < hi) / (hi - lo), 2),
                          sum(r.ok for r in ended), sum(not r.ok for r in ended)))
    return out


def worst(found: list[Window]) -> tuple[Window | None, float | None]:
    """The window of least throughput, and the median over the windows."""
    if not found:
        return None, None
    return min(found, key=lambda w: w.tok_s), round(statistics.median(w.tok_s for w in found), 2)


# --- the run ------------------------------------------------------------------------------------------------------
@dataclass
class SoakResult:
    settings: SoakSettings
    skipped: str | None = None  # why no soak ran
    started_at: float = 0.0
    ended_at: float = 0.0
    nodes: list[NodeSample] = field(default_factory=list)
    server: list[ServerSample] = field(default_factory=list)
    records: list[RequestRecord] = field(default_factory=list)
    windows: list[Window] = field(default_factory=list)
    failure: Failure | None = None
    series: str = ""
    answers: QualityReport | None = None  # 05's answer checks asked again once the soak held
    answers_note: str | None = None  # why they were not asked (None: asked, or the soak failed first)
    answers_problem: str | None = None  # what they found wrong (None: nothing)

    def report(self) -> SoakReport:
        s, (low, median) = self.settings, worst(self.windows)
        f = self.failure
        return SoakReport(planned_s=s.soak_s, ran_s=round(self.ended_at - self.started_at, 1),
                          concurrency=s.soak_concurrency, context=s.soak_context, output_len=s.soak_output_len,
                          requests_ok=sum(r.ok for r in self.records),
                          requests_failed=sum(not r.ok for r in self.records), window_s=window_length(s.soak_s),
                          median_tok_s=median, worst_tok_s=low.tok_s if low else None,
                          worst_at_s=low.start_s if low else None, failure=f.text() if f else None,
                          failed_rule=f.rule if f else None, failed_node=f.node if f else None,
                          failed_at=f.time if f else None, lines=f.lines if f else [], series=self.series,
                          answers=self.answers_text())

    def answers_text(self) -> str | None:
        """The answer checks after the soak in words (None: the soak failed before them)."""
        r = self.answers
        if r is None:
            return self.answers_note
        shares = ", ".join(f"{a.prompt} {a.share:.0%}" for a in r.agreements) or "no prompt"
        known = f"known answers skipped ({r.skipped})" if r.skipped else f"{len(r.answers)} known answers asked"
        head = f"failed: {self.answers_problem}" if self.answers_problem else "held"
        return f"{head}; top-1 tokens identical to the reference's: {shares}; {known} ({r.seconds:.0f} s)"

    def notes(self) -> dict[str, str]:
        """What each node could not tell (its last sample's notes)."""
        last = {s.node: s for s in self.nodes}
        return {n: "; ".join(s.notes) for n, s in last.items() if s.notes}

    def shown(self) -> list[Shown]:
        if self.skipped:
            return [Shown("Soak", self.skipped)]
        r = self.report()
        low, median = worst(self.windows)
        verdict_text = r.failure or (f"held for {r.ran_s:.0f} s: worst {r.window_s:g}-s window {r.worst_tok_s} tok/s "
                                     f"at {r.worst_at_s} s, {_share(low, median)} of the median {r.median_tok_s}")
        return [Shown("Soak verdict", verdict_text),
                Shown("Answers after the soak (05's checks asked again)", self.answers_text() or
                      "not asked: the soak failed first"),
                Shown("Soak settings and counts", r.model_dump(exclude={"failure", "lines"})),
                Shown("Throughput by window", [asdict(w) for w in self.windows] or "no full window"),
                Shown("Each node at its last sample", [_node_row(s) for s in {s.node: s for s in self.nodes}.values()]),
                Shown("What a node could not tell", self.notes() or "every node told everything sampled"),
                Shown("The server at its last sample", asdict(self.server[-1]) if self.server else "never asked")]


def _share(low: Window | None, median: float | None) -> str:
    return f"{100 * low.tok_s / median:.0f}%" if low and median else "-"


def _node_row(s: NodeSample) -> dict[str, object]:
    gpus = ", ".join(f"GPU{g.gpu} {g.sm_mhz} MHz {g.temperature_c} C {g.power_w} W" for g in s.gpus) or "-"
    return {"node": s.node, "time": s.time, "MemAvailable GiB": s.mem_available_gib, "swap used GiB": s.swap_used_gib,
            "PSI some/full avg10 %": f"{s.psi_some}/{s.psi_full}", "GPUs": gpus, "serving": s.serving,
            "unreachable": s.unreachable}


def skipped(settings: SoakSettings, ab_arm: str | None) -> str | None:
    if not settings.soak_s:
        return "no soak: benchmark.soak_s is 0"
    if ab_arm == "baseline":
        return "no soak in the A/B's baseline arm: the configuration that stays serving is soaked in the second arm"
    return None


def run_soak(ctx: Context, target: CompletionsServer, bench_dir: Path, ab_arm: str | None) -> SoakResult:
    """The soak under the params (skipped where soak_s is 0 and in the A/B's baseline arm), its series written to
    bench_dir/soak.json; ended early by the verdict, the load stopped before it returns."""
    s = ctx.params.benchmark
    out = SoakResult(s, skipped(s, ab_arm))
    if out.skipped:
        return out
    endpoint = ctx.handoffs.need(Endpoint)
    head = ctx.params.head.name
    serving = _serving_checks(ctx, endpoint)
    sampler = ThreadPoolExecutor(len(list(ctx.cluster)), thread_name_prefix="soak-sample")
    stop, before = threading.Event(), dict[str, list[str]]()
    out.started_at = time.time()
    until = out.started_at + s.soak_s
    worker, load = soakload.start(target, prompt_pool(target), s.soak_concurrency, s.soak_context,
                                  s.soak_output_len, until, s.soak_wait_s + 60, stop, out.records)
    try:
        with Progress("soak", total=int(s.soak_s), unit=" s") as progress:
            while not load.done():
                tick = time.monotonic()
                _sample(ctx, target, sampler, serving, before, out)
                out.failure = verdict(out.server, out.nodes, list(out.records), s.soak_max_error_rate, head)
                if out.failure:
                    stop.set()
                    break
                out.ended_at = time.time()  # so far: the series is saved as it goes, and a run cut short (a
                out.series = _save(bench_dir, out)  # timeout, a kill) keeps what it sampled
                progress.update(min(time.time() - out.started_at, s.soak_s),
                                note=f"{sum(r.ok for r in out.records)} requests ok")
                wait([load], timeout=max(0.0, s.soak_sample_s - (time.monotonic() - tick)))
    finally:
        stop.set()
        load.result(timeout=s.soak_wait_s + 90)
        worker.shutdown()
        sampler.shutdown(wait=False, cancel_futures=True)
    out.ended_at = min(time.time(), until)
    with ThreadPoolExecutor(len(list(ctx.cluster))) as last:  # the series ends with the state at its end: a death
        _sample(ctx, target, last, serving, before, out)  # a request reported shows in the samples too
    if out.failure is None:
        out.failure = verdict(out.server, out.nodes, out.records, s.soak_max_error_rate, head, final=True)
    if out.failure is None:
        out.failure = _answers_after(ctx, target, endpoint, out)
    if out.failure and out.failure.rule == "engine dead" and out.failure.node:
        out.failure = _with_log(ctx, endpoint, out.failure)
    out.windows = windows(out.records, out.ended_at, window_length(s.soak_s))
    out.series = _save(bench_dir, out)
    return out


def _answers_after(ctx: Context, target: CompletionsServer, endpoint: Endpoint, out: SoakResult) -> Failure | None:
    """05's answer checks asked again of the soaked server, against the reference 05 passed: output that turns to
    token soup after minutes of load shows behind a green /health only here. The failure where they disagree or
    their requests fail; where they cannot be asked, `out.answers_note` says why."""
    key = endpoint.quality_key
    if key is None:
        out.answers_note = "not asked: 05 checked no answers (serve.quality.enabled is false)"
        return None
    reference = load_reference(ctx.run_dir, key)
    if reference is None:
        out.answers_note = f"not asked: no reference {key} beside the cluster's runs"
        return None
    serve, head = ctx.params.serve, ctx.params.head.name
    try:
        out.answers = check(target.base_url, target.model, serve, key, reference, serve.smoke_tokens())
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as exc:  # a refused request or a reply unlike vLLM's
        out.answers_note = f"asked, and a request failed: {type(exc).__name__}: {str(exc)[:300]}"
        return Failure("answers", head, time.time(), f"the answer checks after the soak failed on {head}: "
                       f"{out.answers_note}")
    out.answers_problem = out.answers.problem(serve.quality.min_agreement)
    if out.answers_problem is None:
        return None
    return Failure("answers", head, time.time(), f"the answers changed under load on {head}: "
                   f"{out.answers_problem} (05 agreed with run {reference.run}'s reference before the soak)")


def _serving_checks(ctx: Context, endpoint: Endpoint) -> dict[str, Callable[[], bool]]:
    """Per serving node (05's endpoint), whether the process 05 spawned with its log still runs."""
    where = places(ctx.params, "")
    return {n.name: partial(ctx.runtime.running, n, where[n.name], Spawned(n.name, where[n.name].name,
                                                                            endpoint.logs[n.name]))
            for n in ctx.cluster if n.name in endpoint.logs}


def _sample(ctx: Context, target: CompletionsServer, pool: ThreadPoolExecutor,
            serving: dict[str, Callable[[], bool]], before: dict[str, list[str]], out: SoakResult) -> None:
    """One sample of every node (in parallel, each under its timeout) and of the server; each node's kernel tail
    kept for the next sample's new lines."""
    timeout = max(15.0, 3 * ctx.params.benchmark.soak_sample_s)  # a loaded node answers late; a frozen one never

    def one(node: Node) -> NodeSample:
        return nodewatch.sample(node, before.get(node.name), serving.get(node.name), timeout)

    jobs = {n.name: pool.submit(one, n) for n in ctx.cluster}
    out.server.append(ask_server(target, bearer(ctx.params.serve.api_key_env)))
    for name, job in jobs.items():
        try:
            got = job.result(timeout=timeout + 30)
        except Exception as exc:  # a sample that raised or hung: the node did not answer (not the soak's end)
            got = NodeSample(name, time.time(), unreachable=f"{type(exc).__name__}: {exc}"[:200])
        out.nodes.append(got)
        if not got.unreachable:
            before[got.node] = got.kernel_lines


def _with_log(ctx: Context, endpoint: Endpoint, failure: Failure) -> Failure:
    """A dead engine's failure with the last lines of its node's serve log (where the node still answers)."""
    node = next((n for n in ctx.cluster if n.name == failure.node), None)
    if node is None or failure.node not in endpoint.logs:
        return failure
    try:
        tail = ctx.runtime.read(node, places(ctx.params, "")[node.name], endpoint.logs[node.name],
                                tail_bytes=LOG_TAIL_BYTES)
    except (NodeError, OSError) as exc:
        return replace(failure, lines=[f"its serve log could not be read: {exc}"[:200]])
    lines = [line for line in tail.splitlines() if line.strip()][-12:]
    return replace(failure, lines=[f"{endpoint.logs[node.name]} (last lines):", *lines])


def _save(bench_dir: Path, out: SoakResult) -> str:
    """The samples, windows and verdict so far as bench/soak.json; its path relative to bench's parent."""
    bench_dir.mkdir(parents=True, exist_ok=True)
    path = bench_dir / SOAK_SERIES
    data = {"report": out.report().model_dump(exclude={"series"}), "windows": [asdict(w) for w in out.windows],
            "server": [asdict(s) for s in out.server],
            "nodes": [{**asdict(s), "kernel_lines": None} for s in out.nodes],
            "requests": [{"sent_at": r.sent_at, "ok": r.ok, "e2el_s": r.e2el_s, "ttft_s": r.ttft_s,
                          "output_tokens": r.output_tokens, "error": r.error or None} for r in out.records]}
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=1))
    tmp.replace(path)  # whole or not at all: it is rewritten at every sample
    return f"{bench_dir.name}/{SOAK_SERIES}"
