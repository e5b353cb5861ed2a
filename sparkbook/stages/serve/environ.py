"""05's proof that every serving process has the env params give its node: read `/proc/<pid>/environ` of the
`vllm serve` and Ray worker processes on each serving node (names only; values never leave the node).

    expected(params, node) -> set[str]           runtime.env, the fabric env, Ray's caps, caches, serve.env, node_env
    read(ctx, plan) -> list[NodeEnviron]          each serving node's processes and the names each lacks
    check(found) -> None                          ServeError naming each node and its missing names

Why: with the Ray executor the head's command line is the only one sparkbook writes; the worker's vLLM runs in
Ray worker processes the raylet forks with the container's env. A variable given only to the head's command, or
set after 04 started the containers, never reaches them, and nothing says so until the model misbehaves.
"""
from __future__ import annotations

from dataclasses import dataclass

from ...core.cluster import probes
from ...core.cluster.context import Context
from ...core.cluster.topology import node_env
from ...core.values.errors import ProbeOutputError
from ...core.values.params import Params
from .commands import ServeError, ServePlan

READ_TIMEOUT_S = 30
READS = 2  # a read-only look: a reply lost on a loaded node (0 bytes, seen on the lab) is asked again once


@dataclass(frozen=True)
class ServingProcess:
    pid: int
    cmd: str
    missing: tuple[str, ...]


@dataclass(frozen=True)
class NodeEnviron:
    """One serving node: the names params give it, and each serving process found with what it lacks."""

    node: str
    expected: tuple[str, ...]
    processes: tuple[ServingProcess, ...]
    error: str | None = None  # the probe's own failure: nothing could be read

    @property
    def missing(self) -> tuple[str, ...]:
        return tuple(sorted({name for p in self.processes for name in p.missing}))

    def row(self) -> dict[str, object]:
        return {"node": self.node, "names expected": len(self.expected), "serving processes": len(self.processes),
                "missing": ", ".join(self.missing) or self.error or "none"}


def expected(params: Params, node: str) -> set[str]:
    """Every variable name params give `node`'s processes (the container carries them all: topology.node_env)."""
    return set(params.runtime.env) | set(node_env(params, params.node(node)))


def read(ctx: Context, plan: ServePlan) -> list[NodeEnviron]:
    """Each serving node's serving processes and the expected names each lacks, read in parallel. Only in node
    containers: the Python runtime's processes share the node with others (none read, the list is empty)."""
    if not ctx.runtime.own_place:
        return []
    nodes = [ctx.cluster.nodes[c.node] for c in plan.commands]

    def one(name: str) -> NodeEnviron:
        want = expected(ctx.params, name)
        for _ in range(READS):
            r = ctx.runtime.exec(ctx.cluster.nodes[name], ctx.places[name],
                                 ["python3", "-c", probes.source("serving_environ")], timeout=READ_TIMEOUT_S)
            try:
                doc = probes.parse(r, node=name, probe="serving processes' env names")
            except ProbeOutputError as exc:
                error = f"{exc} (exit {r.exit_code}{', timed out' if r.timed_out else ''}: {r.stderr[-200:]!r})"
                continue
            return NodeEnviron(name, tuple(sorted(want)), tuple(
                ServingProcess(p["pid"], p["cmd"], tuple(sorted(want - set(p["names"])))) for p in doc["processes"]))
        return NodeEnviron(name, tuple(sorted(want)), (), error)

    outcomes = ctx.cluster.fan_out(lambda n: one(n.name), nodes, timeout=READS * READ_TIMEOUT_S + 30)
    return [o.value if o.ok and o.value else NodeEnviron(name, (), (), f"unreachable: {o.error}")
            for name, o in outcomes.items()]


def check(found: list[NodeEnviron]) -> None:
    """ServeError naming every node whose serving processes lack a name params give it, or where none was found."""
    problems = [f"{e.node}: {', '.join(e.missing)} not in the env of its serving processes" for e in found if e.missing]
    none = "no vllm or ray::RayWorkerWrapper process in its container"
    problems += [f"{e.node}: no serving process found ({e.error or none})" for e in found if not e.processes]
    if problems:
        raise ServeError("the serving processes lack env that params give their node: " + "; ".join(problems),
                         node=next(e.node for e in found if e.missing or not e.processes),
                         remediation="run 04 again so that the node containers are started with the params' env "
                                     "(serve.env and serve.node_env are set on the containers, which Ray's workers "
                                     "inherit), then 05")
