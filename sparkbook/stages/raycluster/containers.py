"""04's node containers: one per node from the chosen image, with the fabric env and the addresses its fabric
netdev has inside it; and their removal (Ray and anything served in them go with them)."""
from __future__ import annotations

import time
from dataclasses import dataclass

from ...core.cluster import probes
from ...core.cluster.context import Context
from ...core.cluster.nodes import Node
from ...core.cluster.nodestate import NodeStateError
from ...core.cluster.runtime import Place, Runtime, Spawned, StartSpec
from ...core.cluster.topology import FRONT_LOG, LOG_DIR, RAY_LOG, places
from ...core.values.errors import SparkbookError
from ...core.values.stagelist import RAYCLUSTER


class RayStageError(SparkbookError):
    """The Ray stage could not go on; the message names the node(s)."""

    stage = RAYCLUSTER.name



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
    mounts: tuple[str, ...] = ()
    limits: tuple[str, ...] = ()

    @property
    def fabric_ip_present(self) -> bool:
        return self.fabric_ip in self.netdev_ips

    def row(self) -> dict[str, str]:
        return {"node": self.node, "container": self.name, "id": self.id, "image": self.image,
                "GPUs": "all" if self.gpus else "none", "devices": ", ".join(self.devices) or "-",
                f"addresses of {self.netdev}": ", ".join(self.netdev_ips) or "none",
                "mounts": ", ".join(self.mounts) or "-", "limits": ", ".join(self.limits) or "-",
                "env": " ".join(f"{k}={v}" for k, v in self.env.items())}


def netdev_ips(runtime: Runtime, node: Node, place: Place, netdev: str) -> list[str]:
    """IPv4 addresses of `netdev` as the container (host network) sees them (probes/netdev_ips.py)."""
    out = runtime.exec(node, place, ["python3", "-c", probes.source("netdev_ips"), netdev], timeout=30)
    addresses: list[str] = probes.parse(out, node=node.name, probe=f"addresses of {netdev}")["addresses"]
    return addresses


def start_specs(ctx: Context) -> dict[str, StartSpec]:
    """Each node's container start as one value (its devices probed: read-only), what 04's preview shows and
    `start_containers` is handed."""
    runtime, where = ctx.runtime, ctx.places
    outcomes = ctx.cluster.fan_out(lambda n: runtime.start_spec(n, where[n.name], gpus=bool(n.spec.gpus),
                                                                devices=runtime.devices(n)))
    return dict(zip(outcomes, outcomes.values_or_raise(RayStageError), strict=True))


def start_containers(ctx: Context, specs: dict[str, StartSpec], image_id: str | None = None) -> list[NodeContainer]:
    """Remove and recreate every node's container (in parallel) as `specs` say (start_specs: what the preview
    showed is what starts), from the context's image, which every node must already hold (with `image_id` where
    given: 03 put it there); raise naming each node that failed. Every node's Docker daemon must answer first
    (nothing is started otherwise); a failed start removes the containers the others got."""
    cluster, runtime, where, image = ctx.cluster, ctx.runtime, ctx.places, ctx.image or ""
    runtime.preflight(cluster).values_or_raise(RayStageError)

    def one(node: Node) -> NodeContainer:
        spec, place, start = node.spec, where[node.name], specs[node.name]
        lacking = runtime.lacks(node, image, image_id)
        if lacking:
            raise RayStageError(lacking, node=node.name, remediation="run 03 to distribute it")
        cid = runtime.start(node, start)
        found = runtime.existing(node, place)  # read back: the table shows what the daemon applied
        return NodeContainer(node.name, place.name, cid[:12], image, start.gpus, list(start.devices), place.env,
                             str(spec.fabric_ip), spec.fabric_netdev,
                             netdev_ips(ctx.runtime, node, place, spec.fabric_netdev),
                             found.mounts if found else (), found.limits if found else ())

    outcomes = cluster.fan_out(one)
    if outcomes.failed:
        cluster.fan_out(lambda n: runtime.stop(n, where[n.name]), [cluster.nodes[name] for name in outcomes.succeeded])
    return outcomes.values_or_raise(RayStageError)


def drain_head(ctx: Context, drain_s: int) -> dict[str, object]:
    """Before the node places are set aside: every process spawned in the head's place but Ray (which the Ray
    executor's ranks need to the end) and the front (whose own place stays: on the Python runtime every place's files
    share the node's log dir) gets SIGTERM and up to `drain_s` to end, one by one, then its group is ended. A vLLM
    with --shutdown-timeout takes no new request and finishes those it runs (the front holds what arrives meanwhile),
    and its worker ranks follow the head's API out; so a new image or env cuts no request in flight. What was
    signalled and the seconds it took."""
    t0, head = time.monotonic(), ctx.head
    place = ctx.place(head.name)
    listed = ctx.runtime.exec(head, place, ["sh", "-c", 'cd "$0" 2>/dev/null && ls -- *.pid 2>/dev/null || true',
                                            LOG_DIR], timeout=30)
    logs = [log for name in listed.stdout.split() if name.endswith(".pid")
            and (log := f"{LOG_DIR}/{name.removesuffix('.pid')}") not in (RAY_LOG, FRONT_LOG)]
    refused: dict[str, str] = {}
    for log in logs:
        try:
            ctx.runtime.kill(head, place, Spawned(head.name, place.name, log), drain_s=drain_s)
        except NodeStateError as exc:  # its PID file names a process the runbook did not start: left alone (the
            refused[log] = str(exc)  # container's stop ends what is the runbook's own)
    return {"node": head.name, "signalled": [log for log in logs if log not in refused], "not signalled": refused,
            "drain_timeout_s": drain_s, "seconds": round(time.monotonic() - t0, 1)}


def set_aside(ctx: Context) -> list[str]:
    """Stop every node's container and keep it aside (runtime.aside's name) until the server 05 starts in their
    successors answers; a failure in 04 or 05 brings them back (runbook.fallback). Names of the nodes that had one."""
    outcomes = ctx.cluster.fan_out(lambda n: ctx.runtime.set_aside(n, ctx.places[n.name]))
    return [name for name, found in zip(outcomes, outcomes.values_or_raise(RayStageError), strict=True) if found]


def stop(ctx: Context) -> list[str]:
    """Remove every node's container (Ray and anything served in it); names of the nodes that had one."""
    where = places(ctx.params, "")  # by name: whatever image they run
    outcomes = ctx.cluster.fan_out(lambda n: ctx.runtime.stop(n, where[n.name]))
    return [name for name, o in outcomes.items() if o.ok and o.value]
