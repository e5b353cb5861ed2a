"""04's running cluster kept when still right: a Ray cluster a previous run formed is kept when it is still exactly
what this stage would form (every node's container runs the chosen image with this stage's environment, every node in
Ray, the gate passes); containers that are right with Ray in none of them (brought back from aside) are kept and Ray
starts in them. Where 04 forms no Ray (topology.without_ray) the containers alone are kept when right. Read-only: it
asks the daemons and Ray, and starts or removes nothing."""
from __future__ import annotations

from dataclasses import dataclass

from ...core.cluster.context import Context
from ...core.cluster.nodes import Node
from ...core.cluster.runtime import Place, Runtime
from ...core.cluster.topology import lost
from ...core.values.evidence import Alternative, Decision
from ...core.values.params import Params
from .containers import NodeContainer, RayStageError, netdev_ips
from .formation import Join, gate, snapshot


@dataclass(frozen=True)
class Reuse:
    """The Ray cluster found running, and whether it is the one this stage would form: then it is kept."""

    containers: list[NodeContainer]
    started: dict[str, str]
    join: Join | None
    reason: str | None = None  # why it cannot be reused (None when it can)
    starts_ray: bool = False  # the containers are right but Ray runs in none (brought back from aside): started there
    with_ray: bool = True  # False: 04 forms no Ray (topology.without_ray), the containers alone

    @property
    def ok(self) -> bool:
        return self.reason is None

    def decision(self, image_id: str) -> Decision:
        question = "Reuse the running Ray cluster or start a new one?"
        evidence = [f"{c.node}: container {c.id} of image {image_id[:19]}, running since {self.started[c.node]}"
                    for c in self.containers]
        if self.starts_ray:
            return Decision(question, "keep the containers, start Ray in them", "every node's container runs the "
                            "chosen image with this stage's environment but Ray runs in none of them (containers "
                            "brought back, or restarted): Ray starts in them", [Alternative(
                                "start new containers and Ray", "would remove containers that are right")], evidence)
        if self.reason is None and not self.with_ray:
            return Decision(question, "reused: the running containers", "every node's container runs the chosen "
                            "image with this stage's environment, and no Ray runs on this path: nothing is restarted",
                            [Alternative("start new containers", "would stop containers that are right")], evidence)
        if self.reason is None:
            return Decision(question, "reused: the running cluster", "every node's container runs the chosen image "
                            "with this stage's environment, every node is in Ray and the gate passes: nothing is "
                            "restarted", [Alternative("start new containers and Ray", "would tear down a healthy "
                                                      "cluster of the same image only to form it again")], evidence)
        return Decision(question, "start new containers and Ray" if self.with_ray else "start new containers",
                        self.reason, [Alternative("reuse the running cluster", self.reason)], evidence)


def _existing(params: Params, runtime: Runtime, node: Node, place: Place, image_id: str) -> tuple[NodeContainer, str]:
    """This node's container as it runs now, checked against what start_containers would make."""
    found = runtime.existing(node, place)
    what = f"{runtime.place_word} {place.name}"
    if found is None:
        raise RayStageError(f"has no {what}")
    if found.status != "running":
        raise RayStageError(f"{what} is {found.status}")
    if found.image_id != image_id:
        raise RayStageError(f"{what} runs image {found.image_id[:19]}, not {image_id[:19]}")
    wanted = {**params.runtime.env, **place.env}  # no secret: those go to each spawned process, not the place
    differ = sorted(k for k, v in wanted.items() if found.env.get(k) != v)
    if differ:
        raise RayStageError(f"{what} has another environment ({', '.join(differ)})")
    spec = node.spec
    return NodeContainer(node.name, place.name, found.id[:12], place.image or "", bool(spec.gpus), found.devices,
                         place.env, str(spec.fabric_ip), spec.fabric_netdev,
                         netdev_ips(runtime, node, place, spec.fabric_netdev), found.mounts, found.limits), \
        found.started_at


def reusable(ctx: Context, image_id: str, *, ray: bool = True) -> Reuse:
    """Whether the cluster a previous run formed is still right: every node's container runs `image_id` with
    this stage's environment and (`ray`: 04 forms Ray) its Ray runs, every node is in Ray and the gate passes on it."""
    params, cluster, runtime = ctx.params, ctx.cluster, ctx.runtime
    if runtime.not_reusable:
        return Reuse([], {}, None, runtime.not_reusable, with_ray=ray)
    daemons = runtime.preflight(cluster)
    if daemons.failed:
        return Reuse([], {}, None, daemons.errors(), with_ray=ray)
    where = ctx.places
    outcomes = cluster.fan_out(lambda n: _existing(params, runtime, n, where[n.name], image_id))
    bad = [f"{name}: {o.error}" for name, o in outcomes.items() if not o.ok]
    found = [o.value for o in outcomes.values() if o.ok and o.value is not None]
    containers, started = [c for c, _ in found], {c.node: at for c, at in found}
    if not ray:
        return Reuse(containers, started, None, "no running containers to reuse: " + "; ".join(bad) if bad else None,
                     with_ray=False)
    gone = {} if bad else lost(params, cluster, runtime)
    if gone and len(gone) == len(params.nodes):  # every container right, Ray in none: start it there
        return Reuse(containers, started, None, starts_ray=True)
    bad += [f"{name}: {why}" for name, why in gone.items()]
    if bad:
        return Reuse(containers, started, None, "no running cluster to reuse: " + "; ".join(bad))
    snap = snapshot(ctx)
    seen = snap.by_name()
    join = Join([n.name for n in params.nodes if n.name in seen],
                [n.name for n in params.nodes if n.name not in seen], 0.0, snap)
    verdict = gate(ctx, containers, join)
    if not verdict.ok:
        return Reuse(containers, started, join, "the running cluster fails the gate: " + "; ".join(verdict.failures))
    return Reuse(containers, started, join)

