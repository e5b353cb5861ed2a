"""05's commands for serve.layout replicas: one `vllm serve` per node holding a whole copy of the model (TP = that
node's GPUs, one node's ranks only: no Ray, no --nnodes), on serve.replica_port, and vLLM's router (vllm-router,
vllm-project/router) in the head's place on serve.port in front of them, so clients see one endpoint."""
from __future__ import annotations

import ipaddress

from ...core.values.evidence import Alternative, Decision
from ...core.values.modelinfo import ModelFacts, utilization_floor
from ...core.values.params import NodeSpec, Params, ServeSettings
from . import front, router
from .commands import DEFAULT, QUESTION, Platform, ServeCommand, ServePlan, serve_argv, served_model_path


def ranks(spec: NodeSpec) -> int:
    """A replica's tensor-parallel size: the node's listed GPUs (none listed: one rank, as serving_nodes counts)."""
    return len(spec.gpus) or 1


def executor(params: Params, platform: Platform) -> tuple[str, Decision]:
    """Each replica runs on one node only: vLLM's in-process default for one rank, `mp` for a node's several GPUs;
    Ray (serve.executor: ray) would only add a cluster that spans nothing. The params' tensor_parallel_size is the
    tp layout's split, not a replica's."""
    most = max(ranks(s) for s in params.nodes)
    chosen = DEFAULT if most == 1 else "mp"
    evidence = [*platform.evidence, "serve.layout = replicas",
                *(f"{s.name}: {ranks(s)} rank(s)" for s in params.nodes)]
    why = ("one rank per replica: no --distributed-executor-backend, vLLM runs the model in its engine process"
           if chosen == DEFAULT else f"up to {most} GPUs on one node per replica: vLLM's own workers on that node")
    return chosen, Decision(QUESTION, "vLLM's default" if chosen == DEFAULT else "mp", why + "; every replica "
                            "serves on its own node, so no Ray and no multi-node launch",
                            [Alternative("ray", "a replica spans one node: Ray would join nothing")], evidence,
                            key="executor")


def replica_settings(settings: ServeSettings, spec: NodeSpec, slot: int = 0) -> ServeSettings:
    """The settings one node's replica serves with: its own port (serve.replica_port, one above it in the front's
    other slot, where a blue-green replacement stands up beside the serving replicas), its node's GPUs as the split,
    and its own node's fabric address where serve.host names one address (the head's: a worker cannot bind it) rather
    than every interface (where the router reaches it: worker_url)."""
    host = settings.host if ipaddress.IPv4Address(str(settings.host)).is_unspecified else ipaddress.IPv4Address(
        spec.fabric_ip)
    return settings.model_copy(update={"port": settings.replica_port + slot, "tensor_parallel_size": ranks(spec),
                                       "pipeline_parallel_size": 1, "host": host})


def worker_url(spec: NodeSpec, settings: ServeSettings, slot: int = 0) -> str:
    """Where the router reaches a node's replica: its fabric address (the link the nodes share)."""
    return f"http://{spec.fabric_ip}:{settings.replica_port + slot}"


def router_argv(params: Params, settings: ServeSettings, slot: int = 0) -> list[str]:
    """The router on the head, in front of every node's replica, started with them (front.argv: it waits for them
    as long as 05 does and holds a request none answers); readiness is each replica's own, then the router's."""
    return front.argv(settings, [worker_url(s, settings, slot) for s in params.nodes])


def plan(params: Params, chosen: str, settings: ServeSettings | None = None, model_dir: str = "", slot: int = 0,
         drains: bool = False) -> ServePlan:
    """Every node's replica (head first), then the router on the head; the plan's base URL is the router's. `slot`:
    behind the front, which of its two slots the replicas stand in; `drains`: behind the front, each replica stops
    drained (the image's vLLM has --shutdown-timeout), each being a server of its own."""
    settings = settings or params.serve
    _, model_env = served_model_path(params, model_dir)

    def argv(spec: NodeSpec) -> list[str]:
        own = serve_argv(params, replica_settings(settings, spec, slot), chosen, spec, 0, 1, model_dir)
        return front.drained(own, settings) if drains and settings.front == "router" else own

    commands = [ServeCommand(spec.name, argv(spec), {**model_env, **settings.env, **settings.node_env.get(spec.name,
                                                                                                          {})})
                for spec in params.nodes]
    return ServePlan(chosen, settings, commands, f"http://{params.head.fabric_ip}:{settings.port}",
                     params.model.served_name, model_dir,
                     router=ServeCommand(params.head.name, router_argv(params, settings, slot),
                                         {"PYTHONPATH": router.site(params)}))


def floor(facts: ModelFacts, params: Params, memory_bytes: dict[str, int]) -> float | None:
    """The OOM ladder's floor for replicas: the highest of each node's own (its whole copy on its ranks, the full
    load's KV cache); None where any node's is unknown."""
    floors = [utilization_floor(facts, alone(params, s), memory_bytes) for s in params.nodes]
    return None if any(f is None for f in floors) else max(f for f in floors if f is not None)


def alone(params: Params, spec: NodeSpec) -> Params:
    """params as one node's replica sees them: that node alone, as the head, with the replica's settings."""
    return params.model_copy(update={"nodes": [spec.model_copy(update={"role": "head"})],
                                     "serve": replica_settings(params.serve, spec)})
