"""The Ray stage: one container per node with the fabric env, Ray head and workers inside, a join wait, a gate."""
from __future__ import annotations

import json
import shlex
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from tenacity import RetryCallState, Retrying, retry_if_result, stop_after_delay, stop_before_delay, wait_fixed

from ..core import fabric, probes
from ..core.errors import ProbeOutputError, SparkbookError
from ..core.handoff import JoinedNode, RayCluster
from ..core.nodes import Cluster, Node, Result
from ..core.params import NodeSpec, Params
from ..core.record import Alternative, Decision
from ..core.runtime import Place, Runtime, Spawned
from ..core.topology import NODE_RESOURCE, RAY_LOG, RAY_TEMP_DIR, address, lost, places

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


# --- containers ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class NodeContainer:
    """One node's container as started: the flags that matter and the fabric addresses seen inside it."""

    node: str
    name: str
    id: str
    image: str
    gpus: bool
    devices: list[str]
    env: dict[str, str]
    fabric_ip: str
    netdev: str
    netdev_ips: list[str]

    @property
    def fabric_ip_present(self) -> bool:
        return self.fabric_ip in self.netdev_ips

    def row(self) -> dict[str, str]:
        return {"node": self.node, "container": self.name, "id": self.id, "image": self.image,
                "GPUs": "all" if self.gpus else "none", "devices": ", ".join(self.devices) or "-",
                f"addresses of {self.netdev}": ", ".join(self.netdev_ips) or "none",
                "env": " ".join(f"{k}={v}" for k, v in self.env.items())}


def _netdev_ips(runtime: Runtime, node: Node, place: Place, netdev: str) -> list[str]:
    """IPv4 addresses of `netdev` as the container (host network) sees them (probes/netdev_ips.py)."""
    out = runtime.exec(node, place, ["python3", "-c", probes.source("netdev_ips"), netdev], timeout=30)
    return probes.parse(out, node=node.name, probe=f"addresses of {netdev}")["addresses"]


def start_containers(params: Params, cluster: Cluster, runtime: Runtime, image: str,
                     image_id: str | None = None) -> list[NodeContainer]:
    """Remove and recreate every node's container (in parallel) from `image`, which every node must already
    hold (with `image_id` where given: 03 put it there); raise naming each node that failed. Every node's
    Docker daemon must answer first (nothing is started otherwise); a failed start removes the containers
    the others got."""
    where = places(params, image)
    runtime.preflight(cluster).values_or_raise(RayStageError)

    def one(node: Node) -> NodeContainer:
        spec, place = node.spec, where[node.name]
        lacking = runtime.lacks(node, image, image_id)
        if lacking:
            raise RayStageError(lacking, node=node.name, remediation="run 03 to distribute it")
        devices = runtime.devices(node)
        cid = runtime.start(node, place, gpus=bool(spec.gpus), devices=devices)
        return NodeContainer(node.name, place.name, cid[:12], image, bool(spec.gpus), devices, place.env,
                             str(spec.fabric_ip), spec.fabric_netdev,
                             _netdev_ips(runtime, node, place, spec.fabric_netdev))

    outcomes = cluster.fan_out(one)
    if outcomes.failed:
        cluster.fan_out(lambda n: runtime.stop(n, where[n.name]), [cluster.nodes[name] for name in outcomes.succeeded])
    return outcomes.values_or_raise(RayStageError)


class RayStageError(SparkbookError):
    """The Ray stage could not go on; the message names the node(s)."""

    stage = "04-ray-cluster"


# --- Ray -------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RayStart:
    node: str
    argv: list[str]
    spawned: Spawned

    def row(self) -> dict[str, str]:
        return {"node": self.node, "command": shlex.join(self.argv), "log (in the container)": self.spawned.log}


def start_ray(params: Params, cluster: Cluster, runtime: Runtime, image: str) -> list[RayStart]:
    """`ray start --block` in each container: the head first, workers once its GCS answers."""
    where = places(params, image)
    head = cluster.head
    started = [RayStart(head.name, ray_argv(params, head.spec),
                        runtime.spawn(head, where[head.name], ray_argv(params, head.spec), RAY_LOG))]
    _wait_head(params, runtime, head, where[head.name], started[0].spawned)
    for node in cluster.workers:
        argv = ray_argv(params, node.spec)
        started.append(RayStart(node.name, argv, runtime.spawn(node, where[node.name], argv, RAY_LOG)))
    return started


def _wait_head(params: Params, runtime: Runtime, head: Node, place: Place, spawned: Spawned) -> None:
    """Until the head's GCS port accepts connections (or its `ray start` exits, or the join timeout)."""
    probe = ["python3", "-c", probes.source("port_open"), str(params.head.fabric_ip), str(params.ray.port)]

    def answers() -> bool:
        try:
            if probes.parse(runtime.exec(head, place, probe, timeout=15), node=head.name, probe="GCS port")["open"]:
                return True
        except ProbeOutputError:
            pass  # no whole answer yet: asked again
        if not runtime.running(head, place, spawned):
            raise RayStageError(f"{head.name}: the Ray head exited: {runtime.read(head, place, RAY_LOG, tail_bytes=2000)}")
        return False

    if not Retrying(stop=stop_before_delay(params.ray.join_timeout_s), wait=wait_fixed(POLL_S),
                    retry=retry_if_result(lambda ok: not ok), retry_error_callback=lambda state: False)(answers):
        raise RayStageError(f"{head.name}: the Ray head did not answer within {params.ray.join_timeout_s:g} s")


def status(params: Params, runtime: Runtime, head: Node, place: Place, settle_s: float = 20.0) -> Result:
    """`ray status` inside the head's container, against this cluster's address only. Its report comes from the
    autoscaler, which lags the node table the gate reads by a few seconds: asked again (for up to `settle_s`)
    until it lists every params node as active, so the evidence agrees with the gate."""
    return Retrying(stop=stop_after_delay(settle_s), wait=wait_fixed(POLL_S),
                    retry=retry_if_result(lambda result: active_nodes(result.stdout) < len(params.nodes)),
                    retry_error_callback=lambda state: state.outcome.result())(
        runtime.exec, head, place, ["ray", "status", "--address", address(params)], timeout=60)


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
        return {n.name(): n for n in self.nodes if n.alive and n.name()}


def snapshot(params: Params, runtime: Runtime, head: Node, place: Place) -> Snapshot:
    out = runtime.exec(head, place, ["python3", "-c", probes.source("ray_nodes"), address(params)], timeout=60)
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
    stopped_because: str = ""

    @property
    def ok(self) -> bool:
        return not self.missing


def wait_for_join(params: Params, cluster: Cluster, runtime: Runtime, image: str, containers: list[NodeContainer],
                  started: list[RayStart], on_round: Callable[[int, str], None] = lambda n, note: None) -> Join:
    """Poll Ray until every params node has joined, or the timeout, or a node that can never join:
    its fabric IP is not on its netdev, or its `ray start` exited."""
    where, t0 = places(params, image), time.monotonic()
    hopeless = {c.node: f"{c.fabric_ip} is not an address of {c.netdev} (it has {', '.join(c.netdev_ips) or 'none'})"
                for c in containers if not c.fabric_ip_present}

    def round_() -> Join:
        """One look at Ray: a Join that is ok, stopped (a hopeless node), or still waiting."""
        for s in started:
            node = cluster.nodes[s.node]
            if s.node not in hopeless and not runtime.running(node, where[s.node], s.spawned):
                hopeless[s.node] = "its `ray start` exited: " + runtime.read(node, where[s.node], RAY_LOG,
                                                                              tail_bytes=600).strip()[-400:]
        snap = snapshot(params, runtime, cluster.head, where[cluster.head.name])
        seen = snap.by_name()
        joined = [n.name for n in params.nodes if n.name in seen]
        missing = [n.name for n in params.nodes if n.name not in seen]
        on_round(len(joined), f"joined: {', '.join(joined) or 'none'}")
        why = "; ".join(f"{k}: {v}" for k, v in hopeless.items()) if missing else ""
        return Join(joined, missing, time.monotonic() - t0, snap, why)

    def timed_out(state: RetryCallState) -> Join:
        return replace(state.outcome.result(), stopped_because=f"not joined within {params.ray.join_timeout_s:g} s")

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


def gate(params: Params, containers: list[NodeContainer], join: Join) -> Gate:
    """Ray's node IPs equal the fabric IPs (and the netdev has them), each node offers its resources,
    no placement group is pending. Every failure names its node."""
    seen = join.snapshot.by_name() if join.snapshot else {}
    netdev = {c.node: c for c in containers}
    rows = []
    for spec in params.nodes:
        kind, want = expected_resources(params, spec)
        ray_node, c = seen.get(spec.name), netdev.get(spec.name)
        have = ray_node.resources.get(kind, 0.0) if ray_node else 0.0
        problems = []
        if c is not None and not c.fabric_ip_present:
            problems.append(f"fabric IP {spec.fabric_ip} is not on {c.netdev} (it has {', '.join(c.netdev_ips) or 'none'})")
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


def summary(params: Params, containers: list[NodeContainer], join: Join, reused: bool = False) -> RayCluster:
    """What later stages need: the Ray address, each node's container, and what Ray reports per node."""
    seen = join.snapshot.by_name() if join.snapshot else {}
    return RayCluster(address=address(params), containers={c.node: c.name for c in containers}, reused=reused,
                      container_ids={c.node: c.id for c in containers},
                      nodes=[JoinedNode(name=n, ip=seen[n].ip, resources={k: v for k, v in seen[n].resources.items()
                                                                         if k in ("CPU", "GPU", "memory")})
                             for n in join.joined if n in seen])


# --- the fabric under the collectives ---------------------------------------------------------------
def prove_fabric(params: Params, cluster: Cluster, runtime: Runtime, image: str) -> fabric.AllReduceTest:
    """04's all_reduce test in the Ray containers, with 05's env (core.fabric runs it and removes its processes);
    `fabric.check(fabric.verdict(params, test))` stops 04 on a fallback, a slow link or a failed test."""
    return fabric.run_allreduce(params, cluster, runtime, places(params, image))


# --- reuse on a second run --------------------------------------------------------------------------
@dataclass(frozen=True)
class Reuse:
    """The Ray cluster found running, and whether it is the one this stage would form: then it is kept."""

    containers: list[NodeContainer]
    started: dict[str, str]
    join: Join | None
    reason: str = ""  # why it cannot be reused ('' when it can)

    @property
    def ok(self) -> bool:
        return not self.reason

    def decision(self, image_id: str) -> Decision:
        question = "Reuse the running Ray cluster or start a new one?"
        evidence = [f"{c.node}: container {c.id} of image {image_id[:19]}, running since {self.started[c.node]}"
                    for c in self.containers]
        if self.ok:
            return Decision(question, "reused: the running cluster", "every node's container runs the chosen image "
                            "with this stage's environment, every node is in Ray and the gate passes: nothing is "
                            "restarted", [Alternative("start new containers and Ray", "would tear down a healthy "
                                                      "cluster of the same image only to form it again")], evidence)
        return Decision(question, "start new containers and Ray", self.reason,
                        [Alternative("reuse the running cluster", self.reason)], evidence)


def _existing(params: Params, runtime: Runtime, node: Node, place: Place, image_id: str) -> tuple[NodeContainer, str]:
    """This node's container as it runs now, checked against what start_containers would make."""
    found = runtime.existing(node, place)
    if found is None:
        raise RayStageError(f"has no container {place.name}")
    if found.status != "running":
        raise RayStageError(f"container {place.name} is {found.status}")
    if found.image_id != image_id:
        raise RayStageError(f"container {place.name} runs image {found.image_id[:19]}, not {image_id[:19]}")
    wanted = {**params.runtime.env, **place.env, **params.secret_values()}
    differ = sorted(k for k, v in wanted.items() if found.env.get(k) != v)
    if differ:
        raise RayStageError(f"container {place.name} has another environment ({', '.join(differ)})")
    spec = node.spec
    return NodeContainer(node.name, place.name, found.id[:12], place.image or "", bool(spec.gpus), found.devices,
                         place.env, str(spec.fabric_ip), spec.fabric_netdev,
                         _netdev_ips(runtime, node, place, spec.fabric_netdev)), found.started_at


def reusable(params: Params, cluster: Cluster, runtime: Runtime, image: str, image_id: str) -> Reuse:
    """Whether the cluster a previous run formed is still right: every node's container runs `image_id` with
    this stage's environment, its Ray runs, every node is in Ray and the gate passes on it."""
    if runtime.not_reusable:
        return Reuse([], {}, None, runtime.not_reusable)
    daemons = runtime.preflight(cluster)
    if daemons.failed:
        return Reuse([], {}, None, daemons.errors())
    where = places(params, image)
    outcomes = cluster.fan_out(lambda n: _existing(params, runtime, n, where[n.name], image_id))
    bad = [f"{name}: {o.error}" for name, o in outcomes.items() if not o.ok]
    found = [o.value for o in outcomes.values() if o.ok]
    containers, started = [c for c, _ in found], {c.node: at for c, at in found}
    gone = {} if bad else lost(params, cluster, runtime)
    bad += [f"{name}: {why}" for name, why in gone.items()]
    if bad:
        return Reuse(containers, started, None, "no running cluster to reuse: " + "; ".join(bad))
    snap = snapshot(params, runtime, cluster.head, where[cluster.head.name])
    seen = snap.by_name()
    join = Join([n.name for n in params.nodes if n.name in seen],
                [n.name for n in params.nodes if n.name not in seen], 0.0, snap)
    verdict = gate(params, containers, join)
    if not verdict.ok:
        return Reuse(containers, started, join, "the running cluster fails the gate: " + "; ".join(verdict.failures))
    return Reuse(containers, started, join)


def stop(params: Params, cluster: Cluster, runtime: Runtime) -> list[str]:
    """Remove every node's container (Ray and anything served in it); names of the nodes that had one."""
    where = places(params, "")
    outcomes = cluster.fan_out(lambda n: runtime.stop(n, where[n.name]))
    return [name for name, o in outcomes.items() if o.ok and o.value]
