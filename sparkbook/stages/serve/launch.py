"""05's launch and readiness: spawn each node's `vllm serve` in its container, then poll the API from here while
checking every node's container and process, so a dead node ends the wait with its classified log tail; and the
record of every attempt of a bring-up."""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx
from tenacity import Retrying, retry_if_result, wait_fixed

from ...core.cluster import probes
from ...core.cluster.context import Context
from ...core.cluster.nodes import Node
from ...core.cluster.runtime import Spawned
from ...core.cluster.topology import FRONT_LOG, LOG_DIR
from ...core.values.evidence import Alternative, Decision
from ...core.values.params import api_key
from . import front
from .commands import ServeCommand, ServePlan
from .failures import FailureCause, Remedy, classify, not_ready
from .keyed_router import KEY_ENV
from .memory import Settle, kernel_lines
from .router import RouterInstall

POLL_S = 1.0
TAIL_BYTES = 6000


ROUTER = "router"  # the router's key beside the nodes' in log tails and dead processes (it runs on the head)


@dataclass(frozen=True)
class Launch:
    plan: ServePlan
    attempt: int
    spawned: dict[str, Spawned]
    started_at: float
    router: Spawned | None = None  # the front in its own place, or (replicas, serve.front: none) the head's router


def log_path(attempt: int, slot: int = 0) -> str:
    """A server's log (its PID file beside it): per attempt, and per slot behind the front (front.slot_of), so a
    blue-green replacement's servers never take the old ones' files."""
    return f"{LOG_DIR}/serve-{attempt}{'' if slot == 0 else f'-slot{slot}'}.log"


def router_log_path(attempt: int) -> str:
    return f"{LOG_DIR}/router-{attempt}.log"


def router_log(serve_plan: ServePlan, attempt: int) -> str:
    """The router's log: the front's own (one per cluster, it outlives attempts and replacements), else the
    attempt's."""
    return FRONT_LOG if serve_plan.settings.front == "router" else router_log_path(attempt)


def standing_front(ctx: Context, serve_plan: ServePlan) -> Spawned | None:
    """The front (serve.front: router) already running in its own place on the head, as an earlier launch spawned
    it; None where there is none or the plan has no front."""
    if serve_plan.router is None or serve_plan.settings.front != "router":
        return None
    spawned = Spawned(ctx.head.name, ctx.front.name, FRONT_LOG)
    return spawned if front.runs(ctx, serve_plan, spawned) else None


def replica_urls(serve_plan: ServePlan) -> dict[str, str]:
    """Each server's address as the router reaches it (its `--worker-urls`, in order): every replica's, or the
    head's behind the front; none without a router. 05 is ready only when every one is: the router answers once one
    does."""
    if serve_plan.router is None:
        return {}
    urls = front.workers(serve_plan.router)
    nodes = serve_plan.commands if serve_plan.settings.layout == "replicas" else serve_plan.commands[:1]
    return {c.node: url for c, url in zip(nodes, urls, strict=True)}


def address(url: str) -> tuple[str, str]:
    """A server's URL (http://HOST:PORT) as (host, port)."""
    host, port = url.rsplit("/", 1)[-1].rsplit(":", 1)
    return host, port


def host_port(serve_plan: ServePlan) -> tuple[str, str]:
    """The serve address of the plan's base URL, as (host, port)."""
    return address(serve_plan.base_url)


def _head_api(serve_plan: ServePlan) -> tuple[str, str]:
    """The head server's own address (host, port), which worker ranks follow: behind the front, its port there,
    not the front's (which outlives it)."""
    own = replica_urls(serve_plan).get(serve_plan.commands[0].node) if serve_plan.settings.layout == "tp" else None
    return address(own) if own is not None else host_port(serve_plan)


def launch(ctx: Context, serve_plan: ServePlan, attempt: int = 1) -> Launch:
    """Spawn every node's command in its container (head first), logs to a file per attempt; worker ranks
    follow the head's API (they end when it is gone: probes/follow.py), while replicas are servers of their own, each
    with the key; the router starts with them in its place (the front's own, else the head's) and waits for them itself.
    The head gets serve.api_key_env's value as VLLM_API_KEY in its process environment only, as the runtime gives
    secrets (never on an argv, in the plan, which is recorded, or in a place's inspectable env)."""
    t0 = time.monotonic()
    host, port = _head_api(serve_plan)
    follow = probes.source("follow")
    key = api_key(serve_plan.settings.api_key_env)
    secret = {"VLLM_API_KEY": key} if key else {}
    alone = serve_plan.settings.layout == "replicas"  # every replica is a server of its own, with the key

    def argv(rank: int, c: ServeCommand) -> list[str]:
        return c.argv if rank == 0 or alone else ["python3", "-c", follow, host, port, *c.argv]

    slot = front.slot_of(serve_plan)
    spawned = {c.node: ctx.runtime.spawn(ctx.cluster.nodes[c.node], ctx.places[c.node], argv(rank, c),
                                         log_path(attempt, slot), env=c.env,
                                         secrets=secret if rank == 0 or alone else None)
               for rank, c in enumerate(serve_plan.commands)}
    return Launch(serve_plan, attempt, spawned, t0, _router(ctx, serve_plan, attempt, key))


def _router(ctx: Context, serve_plan: ServePlan, attempt: int, key: str | None) -> Spawned | None:
    """The plan's router: the standing front as it is, else spawned now in its place (the front's, with its record
    of what it routes to); with the API key `key` as router.KEYED reads it (a secret, as the servers get theirs)."""
    r = serve_plan.router
    if r is None:
        return None
    found = standing_front(ctx, serve_plan)
    if found is not None:
        return found
    spawned = ctx.runtime.spawn(ctx.head, front.place(ctx, serve_plan), r.argv, router_log(serve_plan, attempt),
                                env=r.env, secrets={KEY_ENV: key} if key else None)
    if serve_plan.settings.front == "router":
        front.record(ctx, r.argv)
    return spawned


def stop_serving(ctx: Context, launched: Launch) -> None:
    """End the serve processes of `launched` (their process groups), the router's first unless it is the front
    (it stays for the next attempt); the containers and Ray stay."""
    if launched.router is not None and launched.plan.settings.front != "router":
        ctx.runtime.kill(ctx.head, front.place(ctx, launched.plan), launched.router)
    ctx.cluster.fan_out(lambda n: ctx.runtime.kill(n, ctx.places[n.name], launched.spawned[n.name]),
                        [ctx.cluster.nodes[name] for name in launched.spawned])


@dataclass(frozen=True)
class Readiness:
    """How a launch ended: ready (with timings) or failed (with the classified cause and log tails)."""

    ok: bool
    seconds: float
    health_s: float | None
    models: list[str]
    tails: dict[str, str]
    cause: FailureCause | None = None


def get(client: httpx.Client, url: str) -> httpx.Response | None:
    try:
        return client.get(url)
    except httpx.HTTPError:
        return None


def listed(client: httpx.Client, base: str) -> list[str]:
    """The models a server's /v1/models lists (none while it does not answer)."""
    r = get(client, f"{base}/v1/models")
    return [m["id"] for m in r.json().get("data", [])] if r is not None and r.status_code == 200 else []


def tails(ctx: Context, launched: Launch) -> dict[str, str]:
    """Each node's log tail, and the router's under ROUTER."""
    def read(node: Node) -> str:
        return ctx.runtime.read(node, ctx.places[node.name], launched.spawned[node.name].log, tail_bytes=TAIL_BYTES)

    outcomes = ctx.cluster.fan_out(read, [ctx.cluster.nodes[n] for n in launched.spawned], timeout=60)
    found = {n: o.value if o.ok and o.value is not None else f"(log unreadable: {o.error})"
             for n, o in outcomes.items()}
    if launched.router is not None:
        found[ROUTER] = ctx.runtime.read(ctx.head, front.place(ctx, launched.plan), launched.router.log,
                                         tail_bytes=TAIL_BYTES)
    return found


def _dead(ctx: Context, launched: Launch) -> dict[str, str]:
    """Nodes whose container (any node's: Ray lives there too) or serve process is gone, with what was seen; the
    router under ROUTER where its process is."""
    def check(node: Node) -> str:
        place = ctx.places[node.name]
        if not ctx.runtime.alive(node, place):
            return f"container {place.name} is not running"
        if node.name in launched.spawned and not ctx.runtime.running(node, place, launched.spawned[node.name]):
            return "its `vllm serve` process exited"
        return ""

    outcomes = ctx.cluster.fan_out(check, [ctx.cluster.nodes[n] for n in ctx.places], timeout=60)
    dead = {n: o.value if o.ok and o.value else f"unreachable: {o.error}" for n, o in outcomes.items()
            if not o.ok or o.value}
    r = launched.router
    if r is not None and r.node not in dead and not ctx.runtime.running(ctx.head, front.place(ctx, launched.plan), r):
        dead[ROUTER] = f"the router's process on {r.node} ({r.place}) exited"
    return dead


def stop_earlier(ctx: Context, attempts: int, drain_s: int = 0, slots: tuple[int, ...] = (0, 1)) -> None:
    """End serve processes (and routers, not the front) an earlier run of this stage left in the containers (by
    their recorded IDs), in the slots named; with `drain_s`, each server first finishes what it runs (at most that
    long)."""
    def kill_all(node: Node) -> None:
        place = ctx.places[node.name]
        routers = [router_log_path(a) for a in range(1, attempts + 1)] if node.name == ctx.head.name else []
        for log in routers:
            ctx.runtime.kill(node, place, Spawned(node.name, place.name, log))
        for log in [log_path(a, slot) for slot in slots for a in range(1, attempts + 1)]:
            ctx.runtime.kill(node, place, Spawned(node.name, place.name, log), drain_s=drain_s)

    ctx.cluster.fan_out(kill_all, [ctx.cluster.nodes[n] for n in ctx.places])


def wait_ready(ctx: Context, launched: Launch, timeout_s: float,
               on_round: Callable[[float, str], None] = lambda s, note: None) -> Readiness:
    """Poll /health then /v1/models from here (with replicas, each replica's /v1/models first, then the
    router's); every round also check each node's container and process, so a dead node ends the wait at once with
    its classified log tail."""
    base, model = launched.plan.base_url, launched.plan.model
    health_s = None
    pending = replica_urls(launched.plan)

    def round_(client: httpx.Client) -> Readiness | None:
        """One look: Readiness once ready, dead or past `timeout_s` (counted from the launch); None to go on."""
        nonlocal health_s
        elapsed = time.monotonic() - launched.started_at
        for node in [n for n, url in pending.items() if model in listed(client, url)]:
            del pending[node]
        if not pending and health_s is None:
            r = get(client, f"{base}/health")
            health_s = elapsed if r is not None and r.status_code == 200 else None
        if health_s is not None:
            models = listed(client, base)
            if model in models:
                return Readiness(True, time.monotonic() - launched.started_at, health_s, models,
                                 tails(ctx, launched))
        dead = _dead(ctx, launched)
        if dead or elapsed > timeout_s:
            logs = tails(ctx, launched)
            if dead:  # a server the kernel killed shows only there: its OOM-kill line names the process
                kernel = kernel_lines(ctx, [n for n, why in dead.items() if n in logs and n != ROUTER
                                            and not why.startswith("unreachable")], elapsed + 10)
                logs = {n: t + (f"\n--- kernel (dmesg) ---\n{kernel[n]}" if kernel.get(n) else "")
                        for n, t in logs.items()}
            cause = classify(logs, dead) if dead else not_ready(logs, launched.plan.commands[0].node, elapsed)
            return Readiness(False, elapsed, health_s, [], logs, cause)
        on_round(elapsed, f"waiting for the replicas on {', '.join(pending)}" if pending
                 else "health OK, waiting for /v1/models" if health_s else _last_line(ctx, launched))
        return None

    with httpx.Client(timeout=httpx.Timeout(3.0, connect=2.0), headers=launched.plan.settings.headers()) as client:
        ready = Retrying(wait=wait_fixed(POLL_S), retry=retry_if_result(lambda r: r is None))(round_, client)
    assert ready is not None  # asked again until a round returns one
    return ready


def _last_line(ctx: Context, launched: Launch) -> str:
    head = launched.plan.commands[0].node
    text = ctx.runtime.read(ctx.cluster.nodes[head], ctx.places[head], launched.spawned[head].log, tail_bytes=400)
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return lines[-1][-120:] if lines else "(no output yet)"


@dataclass(frozen=True)
class Kept:
    """A server an earlier run started and this one kept: how that run got it ready."""

    attempt: int  # the attempt that is serving (its log is serve-ATTEMPT.log)
    attempts: int
    ready_s: float


@dataclass
class BringUp:
    """Every attempt of the serve stage, the remediations between them, and the one that is serving."""

    attempts: list[tuple[Launch, Readiness]] = field(default_factory=list)
    remedies: list[Remedy] = field(default_factory=list)
    reuse: Decision | None = None  # whether a server already running was kept
    reused_from: Kept | None = None  # what its record (reuse.SERVING) says of it when it was
    settles: list[Settle] = field(default_factory=list)  # after each failed attempt: memory back (or not)
    router_install: RouterInstall | None = None  # the router found or installed in its place on the head
    front_opened: bool = False  # the front's own place was started by this bring-up (none stood)
    stopped_at: float | None = None  # monotonic time the servers of earlier runs were stopped (from then none serves)

    @property
    def ok(self) -> bool:
        return bool(self.attempts) and self.attempts[-1][1].ok

    @property
    def launched(self) -> Launch:
        return self.attempts[-1][0]

    @property
    def readiness(self) -> Readiness:
        return self.attempts[-1][1]

    @property
    def dark_s(self) -> float | None:
        """Seconds without service of a replacement: from the stop of the server that answered until the new one
        answered /health (None: nothing was serving, or nothing new answered)."""
        if self.stopped_at is None or not self.ok:
            return None
        return round(self.launched.started_at + self.readiness.seconds - self.stopped_at, 1)

    def decisions(self) -> list[Decision]:
        retries = [Decision(f"How to retry after {r.cause}?", ", ".join(f"{k}={v}" for k, v in r.change.items()),
                            r.reason, [Alternative(o, why) for o, why in r.alternatives],
                            [f"attempt {i + 1}: {cause.summary()}" for cause in [self.attempts[i][1].cause] if cause])
                   for i, r in enumerate(self.remedies)]
        return ([self.reuse] if self.reuse else []) + retries

    def table(self) -> list[dict[str, object]]:
        return [{"attempt": launch_.attempt, "ready": r.ok, "seconds": round(r.seconds, 1),
                 "health after s": None if r.health_s is None else round(r.health_s, 1),
                 "cause": r.cause.cause if r.cause else "", "node": r.cause.node if r.cause else "",
                 "evidence": r.cause.evidence[-160:] if r.cause else ""} for launch_, r in self.attempts]

