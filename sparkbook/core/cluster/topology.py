"""The cluster as the stages lay it out on the nodes: one place (container) per node with the fabric env,
the Ray address, and whether 04's Ray cluster still stands (04 forms it, 05 and 06 rely on it)."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import PurePosixPath

import httpx

from ..values.params import FRONT_NODE, NodeSpec, Params, bearer
from .nodes import Cluster, Node
from .runtime import Place, Runtime, Spawned

# The place's own files as the stages name them: a container's own /tmp (no host path is mounted there); the Python
# runtime, whose places share the node, maps them into the node's state dir (core.cluster.nodestate), never the
# node's /tmp, where anyone could have made them first.
PLACE_ROOT = "/tmp/sparkbook"
LOG_DIR = f"{PLACE_ROOT}/logs"  # every process the stages spawn in a place logs here
RAY_TEMP_DIR = f"{PLACE_ROOT}/ray"
RAY_LOG = f"{LOG_DIR}/ray.log"
SERVING = f"{LOG_DIR}/serving.json"  # in the head's place: what 05 serves there now (05 keeps it, 04 would end it)
FRONT_LOG = f"{LOG_DIR}/front.log"  # in the front's own place: the front's log (and PID file), one per cluster
HEALTH_TIMEOUT_S = 5.0
NODE_RESOURCE = "sparkbook_node_{}"


def container_name(params: Params, node: str) -> str:
    return f"sparkbook-{params.cluster}-{node}"


def fabric_env(params: Params, spec: NodeSpec) -> dict[str, str]:
    """Per-node env of the anchors: this node's fabric IP and netdev for vLLM, Ray, NCCL, Gloo, TP, UCX, MPI."""
    dev = spec.fabric_netdev
    env = {"VLLM_HOST_IP": str(spec.fabric_ip), "RAY_NODE_IP_ADDRESS": str(spec.fabric_ip),
           "NCCL_SOCKET_IFNAME": dev, "GLOO_SOCKET_IFNAME": dev, "TP_SOCKET_IFNAME": dev, "UCX_NET_DEVICES": dev,
           "OMPI_MCA_btl_tcp_if_include": dev}
    if spec.roce_hcas:
        env["NCCL_IB_HCA"] = ",".join(spec.roce_hcas)
    return env


def ray_env(params: Params) -> dict[str, str]:
    """Ray's caps as eugr's launch script sets them: the object store capped (ray.object_store_gib), no Python
    workers started ahead of need (each holds memory the model wants on a unified-memory node)."""
    return {"RAY_object_store_memory": str(int(params.ray.object_store_gib * 2**30)),
            "RAY_num_prestart_python_workers": "0"}


def cache_dir(params: Params) -> str:
    """The compile caches' directory on every node: runtime.cache_dir, else sparkbook-cache/CLUSTER beside the model
    cache, on both runtimes, so that a replacement, `up` and a new container start warm (on by default: a cold
    vLLM start on an H200 compiles for minutes) and clusters sharing a node do not share caches."""
    return params.runtime.cache_dir or str(PurePosixPath(params.model.cache_dir).parent / "sparkbook-cache"
                                           / params.cluster)


def cache_env(params: Params) -> dict[str, str]:
    """Where vLLM, Triton, TorchInductor and FlashInfer keep what they compile: inside the mounted cache dir."""
    root = cache_dir(params)
    return {"VLLM_CACHE_ROOT": f"{root}/vllm", "TRITON_CACHE_DIR": f"{root}/triton",
            "TORCHINDUCTOR_CACHE_DIR": f"{root}/inductor", "FLASHINFER_WORKSPACE_BASE": f"{root}/flashinfer"}


def node_env(params: Params, spec: NodeSpec) -> dict[str, str]:
    """Everything params give one node's processes, set on its container so that every process there has it:
    `vllm serve`, and the Ray workers the raylet forks, which see the container's env and never the env of the
    command that asked for them (a serve.node_env of a worker set on the head's command reaches no worker).
    Later sources win: fabric, Ray's caps, ray.env, caches, serve.env, serve.node_env."""
    return {**fabric_env(params, spec), **ray_env(params), **params.ray.env, **cache_env(params), **params.serve.env,
            **params.serve.node_env.get(spec.name, {})}


def places(params: Params, image: str) -> dict[str, Place]:
    """The node containers of this stage (05 serves in the same ones)."""
    return {n.name: Place(n.name, container_name(params, n.name), image, node_env(params, n)) for n in params.nodes}


def front_place(params: Params, image: str) -> Place:
    """The front's own place on the head (serve.front: router), beside the head's: 04 replaces the node places for a
    new image or env, and the front outlives that, holding clients' requests meanwhile. It needs no fabric or GPU:
    only a Python for vllm-router (the image's, as it was when the front first started) and the caches' mount."""
    return Place(params.head.name, container_name(params, FRONT_NODE), image, cache_env(params))


def container_names(params: Params) -> dict[str, list[str]]:
    """Every place the stages may leave on each node, the front's on the head included: what a teardown removes."""
    return {n.name: [container_name(params, n.name), *([container_name(params, FRONT_NODE)]
                                                      if n.role == "head" else [])] for n in params.nodes}


def address(params: Params) -> str:
    return f"{params.head.fabric_ip}:{params.ray.port}"


def without_ray(params: Params, image_ray: str | None) -> str | None:
    """Why 04 forms no Ray cluster (None: it forms one). vLLM launches its own ranks across the nodes (`--nnodes`,
    `--headless`), so Ray is needed only by the Ray executor: it is left out where serve.executor is mp, and where it
    is unset on an image without Ray (`image_ray`: 03's ImageChoice.ray_version; stock vLLM images since 0.19 carry
    none, issue 45). An image with Ray and no executor set keeps Ray, as 05 may choose it."""
    if params.serve.layout == "replicas":
        return "serve.layout is replicas: each node serves a whole copy on its own, and no rank joins another node's"
    if params.serve.executor == "mp":
        return "serve.executor is mp: vLLM starts its own ranks on every node (--nnodes, --node-rank, --headless)"
    if params.serve.executor is None and image_ray is None:
        return ("the chosen image has no Ray (the module and the ray CLI) and serve.executor is unset: 05 serves with "
                "vLLM's own multi-node launch")
    return None


def lost(params: Params, cluster: Cluster, runtime: Runtime, timeout_s: float = 45, *,
         ray: bool = True) -> dict[str, str]:
    """Nodes whose part of 04's cluster is gone, with what was seen: its container is not running, or (`ray`:
    04 formed Ray, see without_ray) its `ray start` (the head's: the GCS) exited. Empty when every node's part still
    runs."""
    where = places(params, "")

    def check(node: Node) -> str:
        place = where[node.name]
        if not runtime.alive(node, place):
            return f"container {place.name} is not running"
        if not ray or runtime.running(node, place, Spawned(node.name, place.name, RAY_LOG)):
            return ""
        what = f"the Ray head (GCS at {address(params)})" if node.spec.role == "head" else "its Ray worker"
        tail = runtime.read(node, place, RAY_LOG, tail_bytes=400).strip().splitlines()
        return f"{what} is not running" + (f" (last log line: {tail[-1][-200:]})" if tail else "")

    outcomes = cluster.fan_out(check, timeout=timeout_s)
    return {n: o.value if o.ok and o.value else f"unreachable: {o.error}" for n, o in outcomes.items()
            if not o.ok or o.value}


@dataclass(frozen=True)
class LiveServer:
    """The server 05 recorded in the head's place and that still answers /health: what replacing the places ends."""

    run: str | None  # the run whose plan it serves (None in records older than that field)
    base_url: str
    model: str
    held: dict[str, int]  # bytes per serving node it took from what 02 counts free (05 measured it once ready)


def live_server(params: Params, cluster: Cluster, runtime: Runtime) -> LiveServer | None:
    """Read-only: the head's place's record of what serves, where /health answers; None where nothing does."""
    head, place = cluster.head, places(params, "")[params.head.name]
    if not runtime.alive(head, place):
        return None
    try:
        record = json.loads(runtime.read(head, place, SERVING))
        base_url, model, record_run = str(record["running"]["base_url"]), str(record["running"]["model"]), \
            record.get("run")
        held = {str(n): int(b) for n, b in (record.get("held") or {}).items()}
    except (ValueError, KeyError, TypeError, AttributeError):
        return None
    try:
        answers = httpx.get(f"{base_url.removesuffix('/v1')}/health", timeout=HEALTH_TIMEOUT_S,
                            headers=bearer(params.serve.api_key_env)).status_code == 200
    except httpx.HTTPError:
        answers = False
    return LiveServer(record_run, base_url, model, held) if answers else None
