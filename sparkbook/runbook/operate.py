"""The operator's commands over a deployed cluster: `status` (what serves, from which run, healthy?), `logs` (a
node's vLLM server log: PID 1 of the node containers is `sleep infinity`, so `docker logs` is empty), `stop`
(recorded in the run whose deployment it stops) and `up` (the last good deployment again after a reboot: 04 + 05
from that run's recorded image and plan, no cleanup, no copies). Each reads the cluster's run dirs for what it
deployed; nothing here decides how to deploy."""
from __future__ import annotations

import dataclasses
import hashlib
import json
import time
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import httpx

from ..core.cluster.context import Context
from ..core.cluster.nodes import Node, NodeError
from ..core.cluster.runtime import Place, Runtime, Spawned
from ..core.cluster.topology import LOG_DIR, lost, without_ray
from ..core.values import state
from ..core.values.errors import SparkbookError
from ..core.values.evidence import now, read_events
from ..core.values.handoff import AbBaseline, Endpoint, ImageChoice, OldDeployment
from ..core.values.handoffbounds import endpoint_problems, image_problems
from ..core.values.params import Params, bearer, load_params
from ..core.values.rundir import RUN_ID, STATE, is_run_dir
from ..core.values.stagelist import RAYCLUSTER, SERVE
from ..stages.serve.endpoints import ClientAddress, client_addresses
from . import driver, lock, logfollow, stoprecord
from .driver import RunOptions, Say, silent
from .manifest import Manifest
from .session import Run, open_run

HEALTH_TIMEOUT_S = 5.0
FOLLOW_POLL_S = 2.0
PROBE_TIMEOUT_S = 60.0


class NothingDeployed(SparkbookError):
    """No run of this cluster left a serving deployment to operate on."""


class UntrustedDeployment(SparkbookError):
    """The newest deployment's record names what its params could not have deployed, or cannot be read."""

    exit_kind = "invalid"


@dataclass(frozen=True)
class Deployment:
    """What a run deployed (05 ended ok): the run, its image and its serving plan."""

    run_dir: Path
    image: ImageChoice
    endpoint: Endpoint
    rolled_back_by: str | None = None  # the later run whose failed 05 relaunched this plan (None: its own 05 did)

    @property
    def run_id(self) -> str:
        return self.run_dir.name

    @property
    def plan_hash(self) -> str:
        """The serving plan's fingerprint: the `vllm serve` argv per node (env by name only)."""
        plan: dict[str, object] = {n: [argv, sorted(self.endpoint.env.get(n, {}))]
                                   for n, argv in sorted(self.endpoint.commands.items())}
        if self.endpoint.router:  # serve.layout replicas: the router is part of what serves
            plan["router"] = self.endpoint.router
        return hashlib.sha256(json.dumps(plan).encode()).hexdigest()[:12]

    def started_by(self) -> str:
        """The run that started the server this run kept (a reuse names an earlier run of the same plan)."""
        if not self.endpoint.reused:
            return self.run_id
        earlier = [d for d in deployments(self.run_dir.parent) if d.run_id < self.run_id and not d.endpoint.reused
                   and d.plan_hash == self.plan_hash]
        return earlier[0].run_id if earlier else f"before {self.run_id} (reused)"


def _served(run_dir: Path) -> Deployment | None:
    """What serves since the run: its own deployment when its 05 ended ok and its state holds the image and the
    endpoint; where its 05 failed and rolled back, the deployment of the run whose plan it relaunched (issue 40: the
    deployment follows what serves, so status, logs, stop and up find it after a failure). None where the run
    deployed nothing; a SparkbookError naming the file where its record is torn, foreign or unsealed."""
    try:
        manifest = Manifest.read(run_dir)
    except FileNotFoundError:
        return None  # a run cut short before its first notebook: it deployed nothing
    if manifest.served():
        return _deployment(run_dir)
    back = rolled_back_to(run_dir)
    if back is None:
        return None
    return dataclasses.replace(_deployment(run_dir.parent / back), rolled_back_by=run_dir.name)


def _deployment(run_dir: Path) -> Deployment:
    return Deployment(run_dir, state.load(run_dir, ImageChoice, "status"), state.load(run_dir, Endpoint, "status"))


def rolled_back_to(run_dir: Path) -> str | None:
    """The run whose plan the run's last rollback brought back serving; None where it rolled back nothing (or the
    rollback failed too). A run id only: never a path out of the cluster's outputs."""
    rollbacks = read_events(run_dir, "serve_rollback")
    last = rollbacks[-1]["data"] if rollbacks else {}
    run = str(last.get("rolled_back_to_run")) if isinstance(last, dict) and last.get("ok") else ""
    return run if RUN_ID.match(run) else None


def deployments(cluster_dir: Path) -> list[Deployment]:
    """Every run of the cluster that deployed a server, newest first (a run whose record cannot be read is left
    out: for naming the run that started a server, never for choosing what to act on)."""
    if not cluster_dir.is_dir():
        return []
    found = []
    for d in sorted(cluster_dir.iterdir(), reverse=True):
        try:
            found.append(_served(d) if is_run_dir(d) else None)
        except (OSError, SparkbookError):
            continue
    return [d for d in found if d is not None]


def last_good(params: Params, outputs: Path) -> Deployment:
    """The newest run's deployment, checked against the params (core.values.handoffbounds); a run dir newer than it
    whose record is torn, foreign or unsealed stops the command naming its file, never passed over in silence."""
    cluster_dir = outputs / params.cluster
    runs = sorted((d for d in cluster_dir.iterdir() if is_run_dir(d)), reverse=True) if cluster_dir.is_dir() else []
    for run_dir in runs:
        try:
            d = _served(run_dir)
        except OSError as exc:
            raise UntrustedDeployment(f"{run_dir}: its record cannot be read ({exc.strerror})",
                                      remediation=f"move {run_dir} aside") from None
        if d is not None:
            return _bounded(d, params)
    raise NothingDeployed(f"no run under {cluster_dir} deployed a server ({SERVE.id} ended ok)",
                          remediation="run the runbook first: sparkbook run PARAMS -p confirm_cleanup=true")


def _bounded(d: Deployment, params: Params) -> Deployment:
    """`d` where its image and endpoint are ones these params could have deployed (or an image A/B kept, the image
    that served before it); UntrustedDeployment otherwise."""
    handoffs = state.Handoffs(d.run_dir, stage="status")
    old, ab = handoffs.get(OldDeployment), handoffs.get(AbBaseline)
    kept = (ab.image.ref,) if ab and ab.image else ()  # the image A/B's baseline: the image that served before it
    problems = [*image_problems(d.image, params, (*(old.images if old else ()), *kept)),
                *endpoint_problems(d.endpoint, params, LOG_DIR)]
    if problems:
        raise UntrustedDeployment(f"{d.run_dir / STATE}: {'; '.join(problems)[:400]}; nothing was acted on",
                                  remediation="check who wrote that run dir; start a new run (`sparkbook run PARAMS`)")
    return d


def opened(params_file: Path, outputs: Path) -> tuple[Run, Deployment]:
    """The cluster's last good deployment and a Run on its dir (what the operator commands act on and record in);
    the caller closes the Run."""
    d = last_good(load_params(params_file), outputs)
    return open_run(params_file, d.run_dir, stage="operator"), d


def operator_lock(session: Run, what: str, say: Say) -> AbstractContextManager[lock.RunLock]:
    """The cluster's run lock for an operator command on `session`: a restore or a stop racing a run (or each other)
    would act on a cluster another command is changing."""
    return lock.held(session.params, session.cluster.head, lock.me(what, session.params_file),
                     params_file=str(session.params_file), say=say)


# status
@dataclass(frozen=True)
class NodeStatus:
    """One node as `sparkbook status` shows it."""

    node: str
    container: str  # running since ..., exited, none, unreachable: ...
    ray: str
    server: str  # running | not running | unknown
    uptime_s: float | None  # since the node container started

    def row(self, d: Deployment) -> dict[str, str]:
        return {"node": self.node, "container": self.container, "Ray": self.ray, "vllm serve": self.server,
                "uptime": "-" if self.uptime_s is None else f"{self.uptime_s / 60:.0f} min",
                "model": d.endpoint.model, "image": d.image.ref, "plan": d.plan_hash}


@dataclass(frozen=True)
class RouterStatus:
    """serve.layout replicas: the router's process on the head and each replica's own /health (the router answers
    while one replica does, so its /health alone does not say that every copy serves)."""

    node: str
    process: str  # running | not running | unknown: ...
    replicas: dict[str, str | None]  # node -> None where its replica's /health answers 200, else what was seen

    @property
    def ok(self) -> bool:
        return self.process == "running" and all(v is None for v in self.replicas.values())

    def lines(self, d: Deployment) -> list[str]:
        return [f"router on {self.node}: {self.process} ({d.endpoint.router_log})",
                *(f"replica on {n} {d.endpoint.replicas[n]}: " + ("/health answers 200" if seen is None
                                                                  else f"/health NOT answering ({seen})")
                  for n, seen in self.replicas.items())]


@dataclass(frozen=True)
class Status:
    deployment: Deployment
    nodes: list[NodeStatus]
    health: str | None  # None: /health answers 200; else what was seen
    addresses: list[ClientAddress] = field(default_factory=list)  # the URL clients use on each network
    router: RouterStatus | None = None  # None: one server, no router before it

    @property
    def serving(self) -> bool:
        return (self.health is None and all(n.server == "running" for n in self.nodes)
                and (self.router is None or self.router.ok))

    def problems(self) -> list[str]:
        """Where the processes and the API disagree: each is a problem to look at, never a verdict to trust."""
        quiet = [n.node for n in self.nodes if n.server != "running"]
        if self.health is None and quiet:
            return [f"PROBLEM: /health answers, yet no recorded vllm serve is seen running on {', '.join(quiet)}: "
                    "another process holds the port, or the server runs outside what 05 recorded"]
        return []

    def lines(self) -> list[str]:
        d = self.deployment
        back = f"; rolled back to by run {d.rolled_back_by}, whose new plan failed" if d.rolled_back_by else ""
        return [f"cluster deployment of run {d.run_id} (server started by run {d.started_by()}{back}): model "
                f"{d.endpoint.model}, image {d.image.ref}, plan {d.plan_hash}, executor {d.endpoint.executor}",
                f"endpoint {d.endpoint.base_url}: " + ("/health answers 200" if self.health is None
                                                      else f"/health NOT answering ({self.health})"),
                *self.problems(),
                *(self.router.lines(d) if self.router else []),
                *(f"clients on the {a.network} network: {a.url}" + (f" (not listening: {a.not_listening})"
                                                                      if a.not_listening else "")
                  for a in self.addresses)]


def _since(started_at: str) -> float | None:
    """Seconds since Docker's StartedAt (RFC 3339 with nanoseconds: read to the second)."""
    try:
        return (datetime.now(UTC) - datetime.fromisoformat(started_at[:19] + "+00:00")).total_seconds()
    except ValueError:
        return None


def _node_status(runtime: Runtime, node: Node, place: Place, log: str, ray: str) -> NodeStatus:
    try:
        found = runtime.existing(node, place)
    except (NodeError, OSError) as exc:
        return NodeStatus(node.name, f"unreachable: {exc}"[:160], "unknown", "unknown", None)
    server = "running" if runtime.running(node, place, Spawned(node.name, place.name, log)) else "not running"
    if found is None and runtime.alive(node, place):  # a place without a container: the Python runtime's sessions
        return NodeStatus(node.name, f"no container: the sessions of {place.name} run", ray, server, None)
    if found is None or found.status != "running":
        return NodeStatus(node.name, found.status if found else f"none ({place.name})", "not running", "not running",
                          None)
    what = f"no container: the sessions of {place.name} run" if found.id == place.name \
        else f"running {found.id[:12]}"  # the Python runtime's place is its own name, a container has an ID
    return NodeStatus(node.name, what, ray, server, _since(found.started_at))


def health(base_url: str, api_key_env: str | None) -> str | None:
    """None when the API's /health answers 200 (asked with the key, which a keyed front asks on every route); else
    what came back."""
    try:
        r = httpx.get(f"{base_url.removesuffix('/v1')}/health", timeout=HEALTH_TIMEOUT_S, headers=bearer(api_key_env))
    except httpx.HTTPError as exc:
        return f"{type(exc).__name__}: {exc}"[:200]
    return None if r.status_code == 200 else f"HTTP {r.status_code}"


def status(session: Run, d: Deployment) -> Status:
    """Every node's container, Ray and server, read-only, and the endpoint's /health."""
    ctx = session.context(d.image.on_nodes)
    no_ray = without_ray(ctx.params, d.image.ray_version)  # vLLM's own multi-node launch: no Ray to look for
    gone = {} if no_ray else lost(ctx.params, ctx.cluster, ctx.runtime)
    ray = "not used (serve.executor mp, serve.layout replicas or an image without Ray)" if no_ray else "running"
    outcomes = ctx.cluster.fan_out(
        lambda n: _node_status(ctx.runtime, n, ctx.places[n.name], server_log(d, n.name), gone.get(n.name, ray)),
        timeout=PROBE_TIMEOUT_S)
    nodes = [o.value if o.ok and o.value else NodeStatus(n, f"unreachable: {o.error}"[:160], "unknown", "unknown",
                                                         None) for n, o in outcomes.items()]
    return Status(d, nodes, health(d.endpoint.base_url, d.endpoint.api_key_env), client_addresses(ctx.params),
                  _router(session, d))


def _router(session: Run, d: Deployment) -> RouterStatus | None:
    """The router's process on the head and every replica's /health (None where the deployment has no router)."""
    log = d.endpoint.router_log
    if log is None:
        return None
    ctx, head = session.context(d.image.on_nodes), session.params.head.name
    node, place = ctx.cluster.nodes[head], router_place(ctx, d)
    try:
        process = "running" if ctx.runtime.running(node, place, Spawned(head, place.name, log)) else "not running"
    except (NodeError, OSError) as exc:
        process = f"unknown: {exc}"[:160]
    key = d.endpoint.api_key_env
    return RouterStatus(head, process, {n: health(url, key) for n, url in d.endpoint.replicas.items()})


def router_place(ctx: Context, d: Deployment) -> Place:
    """Where the deployment's router runs: the front's own place on the head, or (replicas without a front, and
    records older than that place) the head's."""
    return ctx.front if d.endpoint.front else ctx.places[ctx.head.name]


def server_log(d: Deployment, node: str) -> str:
    """The file the node's `vllm serve` writes (05 recorded it; the first attempt's where an older record lacks it)."""
    return d.endpoint.logs.get(node, f"{LOG_DIR}/serve-1.log")


# logs
def logs(session: Run, d: Deployment, node: str, *, follow: bool, say: Say, tail_bytes: int = 20000,
         router: bool = False) -> None:
    """The node's vLLM server log (the file 05 spawned it with), or with `router` the router's on the head; with
    `follow`, new lines until interrupted, each poll reading only what was appended (runbook.logfollow)."""
    if router and d.endpoint.router_log is None:
        raise NothingDeployed(f"run {d.run_id} serves without a router (serve.layout tp)",
                              remediation="leave out --router")
    if not router and node not in d.endpoint.commands:
        raise NothingDeployed(f"node {node!r} serves nothing in run {d.run_id}: it serves on "
                              f"{', '.join(d.endpoint.commands)}", remediation="pass --node with one of those")
    ctx = session.context(d.image.on_nodes)
    node = session.params.head.name if router else node
    path = (d.endpoint.router_log or server_log(d, node)) if router else server_log(d, node)
    n, place = ctx.cluster.nodes[node], router_place(ctx, d) if router else ctx.places[node]
    if not ctx.runtime.alive(n, place):
        raise NothingDeployed(f"{node}: container {place.name} is not running, so its log {path} is gone with it",
                              remediation="`sparkbook up PARAMS` brings the deployment back")
    got = logfollow.appended(ctx.runtime, n, place, path, 0, limit=tail_bytes)
    say(got.text)
    while follow:
        time.sleep(FOLLOW_POLL_S)
        got = logfollow.appended(ctx.runtime, n, place, path, got.offset)
        if got.restarted:
            say(f"--- {path} was written anew (the server started again): from its start ---")
        if got.skipped:
            say(f"--- {got.skipped} bytes skipped (more than {logfollow.FOLLOW_LIMIT_BYTES} came at once) ---")
        if got.text:
            say(got.text.rstrip("\n"))


# stop
@dataclass(frozen=True)
class NodeStopped:
    """What `sparkbook stop` did on one node: its server, its node container."""

    node: str
    server: str
    container: str
    front: str | None = None  # on the head, behind the front: what became of the front's own place


def stop(session: Run, d: Deployment, *, keep_ray: bool) -> list[NodeStopped]:
    """End every node's `vllm serve` (its whole session), and unless `keep_ray` the node containers with their
    Ray; recorded in the deployment's run dir, so `sparkbook up` knows what to bring back. A stop that cannot reach
    every node stops the others, records that (a partial stop the watch respects) and raises StopIncomplete."""
    ctx = session.context(d.image.on_nodes)

    def one(node: Node) -> NodeStopped:
        front = _stop_router(ctx, d, keep_ray) if node.name == ctx.head.name else None  # first: it is the door
        place = ctx.places[node.name]
        if not ctx.runtime.alive(node, place):
            return NodeStopped(node.name, "not running", "not running", front)
        ctx.runtime.kill(node, place, Spawned(node.name, place.name, server_log(d, node.name)))
        if keep_ray:
            return NodeStopped(node.name, "stopped", "kept (Ray still runs)", front)
        return NodeStopped(node.name, "stopped", "removed" if ctx.runtime.stop(node, place) else "none", front)

    outcomes = ctx.cluster.fan_out(one, timeout=PROBE_TIMEOUT_S + 30)
    done = [o.value for o in outcomes.succeeded.values() if o.value is not None]
    unreached = {n: str(o.error) for n, o in outcomes.failed.items()}
    session.record(stoprecord.KIND, stoprecord.payload(now(), keep_ray, done, unreached))  # a partial one too
    if unreached:
        raise StopIncomplete(d, done, outcomes.errors())
    return done


def _stop_router(ctx: Context, d: Deployment, keep_ray: bool) -> str | None:
    """End the deployment's router (no door answers while nothing serves behind it), and unless `keep_ray` the
    front's own place with it; what became of that place (None: the deployment has no front)."""
    head, place = ctx.head, router_place(ctx, d)
    if d.endpoint.router_log and ctx.runtime.alive(head, place):
        ctx.runtime.kill(head, place, Spawned(head.name, place.name, d.endpoint.router_log))
    if not d.endpoint.front:
        return None
    if keep_ray:
        return "router stopped, place kept"
    return "removed" if ctx.runtime.stop(head, place) else "none"


class StopIncomplete(SparkbookError):
    """`sparkbook stop` reached some nodes, not all: what it stopped is recorded with what it could not reach, so the
    watch leaves the deployment stopped, and the message names both."""

    def __init__(self, d: Deployment, stopped: list[NodeStopped], errors: str):
        self.stopped = stopped
        done = ", ".join(s.node for s in stopped) or "no node"
        super().__init__(f"stop of the deployment of run {d.run_id} did not reach every node: stopped on {done}; "
                         f"not reached: {errors}; recorded in that run as a partial stop (the watch leaves it stopped)",
                         remediation="make the node reachable and run `sparkbook stop` again")


# up
def up(params_file: Path, outputs: Path, *, say: Say = silent) -> tuple[Path, Manifest, Deployment]:
    """The cluster's last good deployment again (after a reboot, or `sparkbook stop`): a new run of 04 and 05 that
    starts from that run's hand-offs (image, model, diagnosis), so 01-03 are skipped: nothing cleaned up or copied.
    Where that run's A/B kept its baseline, 05 serves the baseline again (the driver: arms.serving_again)."""
    params = load_params(params_file)
    d = last_good(params, outputs)
    say(f"up: the deployment of run {d.run_id} (image {d.image.ref}, model {d.endpoint.model}, plan {d.plan_hash})")
    run_dir, manifest = driver.execute(params_file, RunOptions(out_root=outputs, seed=d.run_dir, start=RAYCLUSTER.id,
                                                               upto=SERVE.id), say)
    return run_dir, manifest, d
