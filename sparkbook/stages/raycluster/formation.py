"""04's Ray cluster: `ray start` in each container (the head first), the join wait, what Ray reports (`ray status`,
its node table), the gate on it (fabric IPs, resources, no pending placement group) and what 05 is handed."""
from __future__ import annotations

import json
import shlex
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from tenacity import RetryCallState, Retrying, retry_if_result, stop_after_delay, stop_before_delay, wait_fixed

from ...core.cluster import probes
from ...core.cluster.context import Context
from ...core.cluster.nodes import Node, Result
from ...core.cluster.runtime import Place, Runtime, Spawned
from ...core.cluster.topology import NODE_RESOURCE, RAY_LOG, RAY_TEMP_DIR, address
from ...core.values.errors import ProbeOutputError
from ...core.values.handoff import JoinedNode, RayCluster
from ...core.values.params import NodeSpec, Params
from .containers import NodeContainer, RayStageError

POLL_S = 2.0


def ray_argv(params: Params, spec: NodeSpec) -> list[str]:
    """`ray start --block` for the head or a worker, pinned to the node's fabric IP, tagged with its name."""
    argv = ["ray", "start", "--block", "--node-ip-address", str(spec.fabric_ip), "--num-gpus", str(len(spec.gpus)),
            "--resources", json.dumps({NODE_RESOURCE.format(spec.name): 1}), "--disable-usage-stats"]
    if params.ray.num_cpus:
        argv += ["--num-cpus", str(params.ray.num_cpus)]
    if spec.role == "head":
        return argv + ["--head", "--port", str(params.ray.port), "--include-dashboard=false",
                       "--temp-dir", RAY_TEMP_DIR]
    return argv + ["--address", address(params)]



@dataclass(frozen=True)
class RayStart:
    node: str
    argv: list[str]
    spawned: Spawned

    def row(self) -> dict[str, str]:
        return {"node": self.node, "command": shlex.join(self.argv), "log (in the container)": self.spawned.log}


def start_ray(ctx: Context) -> list[RayStart]:
    """`ray start --block` in each container: the head first, workers once its GCS answers. Refused before
    anything starts where something already listens on the head's Ray port: the wait for the head would take its
    answer for this run's GCS and the workers would join whatever it is (another cluster's Ray on these nodes)."""
    params, cluster, runtime, where = ctx.params, ctx.cluster, ctx.runtime, ctx.places
    head = cluster.head
    if _gcs_answers(params, runtime, head, where[head.name]):
        raise RayStageError(f"{head.name}: {params.head.fabric_ip}:{params.ray.port} (ray.port) already accepts "
                            f"connections before this run's Ray head starts; {port_holder(head, params.ray.port)}",
                            node=head.name, remediation="stop what holds it (another cluster's Ray on this node?) or "
                                                        "give this cluster another ray.port in the params")
    started = [RayStart(head.name, ray_argv(params, head.spec),
                        runtime.spawn(head, where[head.name], ray_argv(params, head.spec), RAY_LOG))]
    _wait_head(params, runtime, head, where[head.name], started[0].spawned)
    for node in cluster.workers:
        argv = ray_argv(params, node.spec)
        started.append(RayStart(node.name, argv, runtime.spawn(node, where[node.name], argv, RAY_LOG)))
    return started


def _gcs_answers(params: Params, runtime: Runtime, head: Node, place: Place) -> bool:
    """Does the head's Ray port accept a connection, seen from its container? No whole answer counts as no."""
    probe = ["python3", "-c", probes.source("port_open"), str(params.head.fabric_ip), str(params.ray.port)]
    try:
        reply = probes.parse(runtime.exec(head, place, probe, timeout=15), node=head.name, probe="GCS port")
    except ProbeOutputError:
        return False
    return bool(reply["open"])


def port_holder(node: Node, port: int) -> str:
    """Who listens on `port` of the node, as `ss -ltnp` on the node tells it (the process only where the SSH user
    may see it)."""
    out = node.run(["ss", "-Hltnp", "sport", "=", f":{port}"], timeout=15)
    lines = [" ".join(line.split()) for line in out.stdout.splitlines() if line.strip()]
    if not out.ok or not lines:
        return f"`ss -ltnp` on {node.name} could not tell what holds it ({(out.stderr or 'no socket listed').strip()})"
    if not any("users:" in line for line in lines):
        return (f"`ss -ltnp` lists {' | '.join(lines)} but not its process: run `sudo ss -ltnp 'sport = :{port}'` "
                f"on {node.name}")
    return f"held by: {' | '.join(lines)}"


def _wait_head(params: Params, runtime: Runtime, head: Node, place: Place, spawned: Spawned) -> None:
    """Until the head's GCS port accepts connections (or its `ray start` exits, or the join timeout)."""

    def answers() -> bool:
        if _gcs_answers(params, runtime, head, place):
            return True
        if not runtime.running(head, place, spawned):
            log = runtime.read(head, place, RAY_LOG, tail_bytes=2000)
            raise RayStageError(f"{head.name}: the Ray head exited: {log}")
        return False

    if not Retrying(stop=stop_before_delay(params.ray.join_timeout_s), wait=wait_fixed(POLL_S),
                    retry=retry_if_result(lambda ok: not ok), retry_error_callback=lambda state: False)(answers):
        raise RayStageError(f"{head.name}: the Ray head did not answer within {params.ray.join_timeout_s:g} s")


def status(ctx: Context, settle_s: float = 20.0) -> Result:
    """`ray status` inside the head's container, against this cluster's address only. Its report comes from the
    autoscaler, which lags the node table the gate reads by a few seconds: asked again (for up to `settle_s`)
    until it lists every params node as active, so the evidence agrees with the gate."""
    params, head = ctx.params, ctx.head
    return Retrying(stop=stop_after_delay(settle_s), wait=wait_fixed(POLL_S),
                    retry=retry_if_result(lambda result: active_nodes(result.stdout) < len(params.nodes)),
                    retry_error_callback=lambda state: state.outcome.result() if state.outcome else None)(
        ctx.runtime.exec, head, ctx.place(head.name), ["ray", "status", "--address", address(params)], timeout=60)


def active_nodes(report: str) -> int:
    """How many nodes `ray status` lists under "Active:"."""
    lines = report.splitlines()
    start = next((i + 1 for i, line in enumerate(lines) if line.strip() == "Active:"), len(lines))
    end = next((i for i in range(start, len(lines)) if not lines[i].startswith(" ")), len(lines))
    return sum("node_" in line for line in lines[start:end])


# --- join wait and gate ----------------------------------------------------------------------------
@dataclass(frozen=True)
class RayNode:
    ip: str
    alive: bool
    hostname: str
    resources: dict[str, float]

    def name(self) -> str | None:
        """The params node this Ray node was started for (from its sparkbook resource)."""
        prefix = NODE_RESOURCE.format("")
        return next((k[len(prefix):] for k in self.resources if k.startswith(prefix)), None)


@dataclass(frozen=True)
class Snapshot:
    """What Ray's GCS reports: nodes and placement groups."""

    nodes: list[RayNode]
    placement_groups: list[dict[str, str]]

    def by_name(self) -> dict[str, RayNode]:
        return {name: n for n in self.nodes if n.alive and (name := n.name())}


def snapshot(ctx: Context) -> Snapshot:
    """Ray's node table and placement groups, as the head's GCS reports them."""
    head = ctx.head
    probe = ["python3", "-c", probes.source("ray_nodes"), address(ctx.params)]
    out = ctx.runtime.exec(head, ctx.place(head.name), probe, timeout=60)
    try:
        data = probes.parse(out, node=head.name, probe="Ray's node table")
    except ProbeOutputError as exc:
        raise RayStageError(f"{head.name}: cannot read Ray's node table (the probe's output has no {exc.missing}, "
                            f"{exc.received_bytes} bytes received): {(out.stderr or out.stdout)[-800:]}") from exc
    return Snapshot([RayNode(**n) for n in data["nodes"]], data["placement_groups"])


@dataclass(frozen=True)
class Join:
    """The join wait: who joined, how long it took, and why it stopped early if it did."""

    joined: list[str]
    missing: list[str]
    seconds: float
    snapshot: Snapshot | None
    stopped_because: str | None = None  # why the wait stopped before every node joined

    @property
    def ok(self) -> bool:
        return not self.missing


def wait_for_join(ctx: Context, containers: list[NodeContainer], started: list[RayStart],
                  on_round: Callable[[int, str], None] = lambda n, note: None) -> Join:
    """Poll Ray until every params node has joined, or the timeout, or a node that can never join:
    its fabric IP is not on its netdev, or its `ray start` exited."""
    params, cluster, runtime = ctx.params, ctx.cluster, ctx.runtime
    where, t0 = ctx.places, time.monotonic()
    hopeless = {c.node: f"{c.fabric_ip} is not an address of {c.netdev} (it has {', '.join(c.netdev_ips) or 'none'})"
                for c in containers if not c.fabric_ip_present}

    def round_() -> Join:
        """One look at Ray: a Join that is ok, stopped (a hopeless node), or still waiting."""
        for s in started:
            node = cluster.nodes[s.node]
            if s.node not in hopeless and not runtime.running(node, where[s.node], s.spawned):
                hopeless[s.node] = "its `ray start` exited: " + runtime.read(node, where[s.node], RAY_LOG,
                                                                              tail_bytes=600).strip()[-400:]
        snap = snapshot(ctx)
        seen = snap.by_name()
        joined = [n.name for n in params.nodes if n.name in seen]
        missing = [n.name for n in params.nodes if n.name not in seen]
        on_round(len(joined), f"joined: {', '.join(joined) or 'none'}")
        why = "; ".join(f"{k}: {v}" for k, v in hopeless.items()) if missing and hopeless else None
        return Join(joined, missing, time.monotonic() - t0, snap, why)

    def timed_out(state: RetryCallState) -> Join:
        assert state.outcome is not None  # called after a round returned
        last: Join = state.outcome.result()
        return replace(last, stopped_because=f"not joined within {params.ray.join_timeout_s:g} s")

    return Retrying(stop=stop_after_delay(params.ray.join_timeout_s), wait=wait_fixed(POLL_S),
                    retry=retry_if_result(lambda join: not join.ok and not join.stopped_because),
                    retry_error_callback=timed_out)(round_)


@dataclass(frozen=True)
class GateRow:
    node: str
    fabric_ip: str
    netdev_ips: str
    ray_ip: str
    expected: str
    offered: str
    verdict: str


@dataclass(frozen=True)
class Gate:
    rows: list[GateRow]
    pending_placement_groups: list[str] = field(default_factory=list)

    @property
    def failures(self) -> list[str]:
        bad = [f"{r.node}: {r.verdict}" for r in self.rows if r.verdict != "ok"]
        return bad + [f"placement group {pg} is pending" for pg in self.pending_placement_groups]

    @property
    def ok(self) -> bool:
        return not self.failures


def expected_resources(params: Params, spec: NodeSpec) -> tuple[str, float]:
    """What each node must offer Ray: its listed GPUs, or (no GPUs, e.g. the lab) at least params' CPUs."""
    if spec.gpus:
        return "GPU", float(len(spec.gpus))
    return "CPU", float(params.ray.num_cpus or 1)


def gate(ctx: Context, containers: list[NodeContainer], join: Join) -> Gate:
    """Ray's node IPs equal the fabric IPs (and the netdev has them), each node offers its resources,
    no placement group is pending. Every failure names its node."""
    params = ctx.params
    seen = join.snapshot.by_name() if join.snapshot else {}
    netdev = {c.node: c for c in containers}
    rows = []
    for spec in params.nodes:
        kind, want = expected_resources(params, spec)
        ray_node, c = seen.get(spec.name), netdev.get(spec.name)
        have = ray_node.resources.get(kind, 0.0) if ray_node else 0.0
        problems = []
        if c is not None and not c.fabric_ip_present:
            problems.append(f"fabric IP {spec.fabric_ip} is not on {c.netdev} "
                            f"(it has {', '.join(c.netdev_ips) or 'none'})")
        if ray_node is None:
            problems.append("not in the Ray cluster")
        else:
            if ray_node.ip != str(spec.fabric_ip):
                problems.append(f"Ray reports IP {ray_node.ip}, params say {spec.fabric_ip}")
            if have < want:
                problems.append(f"offers {have:g} {kind}, needs {want:g}")
        rows.append(GateRow(spec.name, str(spec.fabric_ip), ", ".join(c.netdev_ips) if c else "?",
                            ray_node.ip if ray_node else "-", f"{want:g} {kind}", f"{have:g} {kind}",
                            "; ".join(problems) or "ok"))
    extra = [n for n in (join.snapshot.nodes if join.snapshot else []) if n.alive and n.name() is None]
    rows += [GateRow(f"? ({n.hostname})", "-", "-", n.ip, "-", "-", "a Ray node that no params node started")
             for n in extra]
    pending = [pg["id"] for pg in (join.snapshot.placement_groups if join.snapshot else [])
               if pg["state"] in ("PENDING", "RESCHEDULING")]
    return Gate(rows, pending)


class GateFailed(RayStageError):
    def __init__(self, result: Gate):
        self.gate = result
        super().__init__("Ray gate failed: " + "; ".join(result.failures))


def check(result: Gate) -> Gate:
    if not result.ok:
        raise GateFailed(result)
    return result


def summary(ctx: Context, containers: list[NodeContainer], join: Join | None, reused: bool = False) -> RayCluster:
    """What later stages need: the Ray address, each node's container, and what Ray reports per node (`join`
    None: no Ray was formed, the containers alone)."""
    seen = join.snapshot.by_name() if join and join.snapshot else {}
    return RayCluster(address=address(ctx.params) if join else None, containers={c.node: c.name for c in containers},
                      reused=reused, container_ids={c.node: c.id for c in containers},
                      nodes=[JoinedNode(name=n, ip=seen[n].ip, resources={k: v for k, v in seen[n].resources.items()
                                                                         if k in ("CPU", "GPU", "memory")})
                             for n in (join.joined if join else []) if n in seen])

