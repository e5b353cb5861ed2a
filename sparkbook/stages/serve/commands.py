"""05's commands: the platform the image runs on, the executor that follows from it, and each serving node's exact
`vllm serve` argv and env, every value from params."""
from __future__ import annotations

import shlex
from dataclasses import dataclass

from ...core.cluster import imageprobes, probes
from ...core.cluster.context import Context
from ...core.cluster.nodes import Node, Result
from ...core.cluster.runtime import Place
from ...core.cluster.topology import address
from ...core.values.errors import ProbeOutputError, SparkbookError
from ...core.values.evidence import Alternative, Decision, NotKnownYet
from ...core.values.params import NodeSpec, Params, ServeSettings
from ...core.values.stagelist import SERVE

PLATFORM_TIMEOUT_S = 120


class ServeError(SparkbookError):
    """Serving could not start; the message names the node and the classified cause."""

    stage = SERVE.name


@dataclass(frozen=True)
class Platform:
    """What the image runs on: `cuda` or `cpu`, with the versions that show it."""

    device: str
    vllm: str
    torch: str | None
    gpus: int
    ray: str | None  # Ray's version where the image has its module and CLI (stock vLLM images since 0.19: None)
    asked: str | None = None  # where the image was asked (detect_platform); None: not asked here
    drains: bool = False  # its `vllm serve` has --shutdown-timeout (finishes running requests when stopped)

    @property
    def evidence(self) -> list[str]:
        return [f"vllm {self.vllm}", f"torch {self.torch}", f"torch.cuda.is_available() = {self.device == 'cuda'}",
                f"visible GPUs: {self.gpus}", f"Ray {self.ray or 'absent'}"]


def detect_platform(ctx: Context) -> Platform:
    """Ask the image itself (a `+cpu` vLLM build or no CUDA in torch means the CPU platform): in the head's place
    where 04 started it, else in a throwaway container of the image on the head, as 03's probes ask (`sparkbook
    plan` before a first run: nothing on the node changes); NotKnownYet where the head does not hold the image yet."""
    node, place = ctx.head, ctx.place(ctx.head.name)
    argv = ["python3", "-c", probes.source("vllm_platform")]
    if ctx.runtime.alive(node, place):
        out, asked = ctx.runtime.exec(node, place, argv, timeout=PLATFORM_TIMEOUT_S), f"in {place.name}"
    else:
        out = _throwaway(ctx, node, place, argv)
        asked = f"in a throwaway container of {place.image} on {node.name} ({place.name} does not run yet)"
    try:
        data = probes.parse(out, node=node.name, probe="the image's platform")
    except ProbeOutputError as exc:
        raise ServeError(f"{node.name}: cannot tell the image's platform, asked {asked} (the probe's output has no "
                         f"{exc.missing}, {exc.received_bytes} bytes received): {(out.stderr or out.stdout)[-800:]}",
                         node=node.name) from exc
    cpu = data["vllm"].endswith("+cpu") or not data["cuda"]
    return Platform("cpu" if cpu else "cuda", data["vllm"], data["torch"], data["gpus"], data.get("ray"), asked,
                    bool(data.get("drain")))


def _throwaway(ctx: Context, node: Node, place: Place, argv: list[str]) -> Result:
    """The platform probe in a fresh container of the place's image on the node (imageprobes.in_image, as 03
    probes), where the node holds the image."""
    lacking = ctx.runtime.lacks(node, place.image) if place.image else None
    if lacking is not None:
        raise NotKnownYet(f"{node.name} {lacking}: 05's command depends on the image's platform, asked inside it "
                          "once 03 has put the image on the nodes", node=node.name, stage=SERVE.name)
    return imageprobes.in_image(ctx, node, place.image, argv, {}, PLATFORM_TIMEOUT_S)


DEFAULT = "default"  # no --distributed-executor-backend: vLLM's own choice (one rank: its in-process executor)


def single_rank(settings: ServeSettings) -> bool:
    return settings.tensor_parallel_size * settings.pipeline_parallel_size == 1


def choose_executor(ctx: Context, platform: Platform) -> tuple[str, Decision]:
    """An explicit serve.executor is what serves (Ray on vLLM's CPU build is refused before anything starts); an
    unset one is chosen: vLLM's default with one rank in all, else Ray where the platform supports it and the image
    has Ray, `mp` multi-node on the CPU build and on an image without Ray (04 formed none: issue 45)."""
    wanted = ctx.params.serve.executor
    if wanted is None:
        return _chosen(ctx.params, platform)
    if platform.device == "cpu" and wanted == "ray":
        raise ServeError(f"serve.executor is ray, and vLLM's CPU build refuses Ray as executor (`current platform "
                         f"cpu does not support ray`; the image is vLLM {platform.vllm})",
                         remediation="set serve.executor: mp in the params, or leave it out for 05 to choose")
    single = single_rank(ctx.params.serve)
    return wanted, Decision(QUESTION, wanted, f"params set serve.executor: {wanted}, and an explicit setting is what "
                            f"serves" + (" (with one rank in all, leaving it out gives vLLM's in-process default, "
                                         "which starts 31-48 s sooner on an H200)" if single else ""),
                            [Alternative("chosen by 05", "params set it")],
                            platform.evidence + [f"params serve.executor = {wanted}"], key="executor")


QUESTION = "Which distributed executor serves the model?"


def _chosen(params: Params, platform: Platform) -> tuple[str, Decision]:
    """serve.executor left out: the executor by the ranks and the platform."""
    evidence = [*platform.evidence, "params leave serve.executor out"]
    if single_rank(params.serve):
        return DEFAULT, Decision(
            QUESTION, "vLLM's default",
            "one rank in all (tensor_parallel_size x pipeline_parallel_size = 1): no --distributed-executor-backend, "
            "so vLLM runs the model in its engine process instead of spawning a worker that imports everything again "
            "(measured on one H200, issue 33: `mp` started 31-48 s slower)",
            [Alternative("mp", "a separate worker process for a single rank only costs start-up time")],
            [*evidence, "TP x PP = 1"], key="executor")
    multi = " multi-node" if len(serving_nodes(params)) > 1 else ""
    if platform.device == "cpu":
        return "mp", Decision(
            QUESTION, "mp" + multi, f"vLLM's CPU build refuses Ray as executor (`current platform cpu does not support "
            f"ray`); the image is vLLM {platform.vllm}" + (". Ray still runs in the node containers (04)."
                                                           if platform.ray else ", without Ray."),
            [Alternative("ray", "the image's platform is cpu: vLLM would refuse it at start-up")], evidence,
            key="executor")
    if platform.ray is None:
        return "mp", Decision(
            QUESTION, "mp" + multi, f"the image has no Ray (the module and the ray CLI; stock vLLM images carry none "
            f"since 0.19): vLLM {platform.vllm} starts its own ranks on every node and 04 formed no Ray",
            [Alternative("ray", "the image has no Ray")], evidence, key="executor")
    return "ray", Decision(QUESTION, "ray", f"more than one rank on the {platform.device} platform: Ray places them "
                           "across the nodes 04 joined",
                           [Alternative("mp" + multi, "Ray is the default where it runs")], evidence, key="executor")


# --- the commands ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class ServeCommand:
    node: str
    argv: list[str]
    env: dict[str, str]


@dataclass(frozen=True)
class ServePlan:
    """The exact commands per node, and where the API will answer."""

    executor: str
    settings: ServeSettings
    commands: list[ServeCommand]
    base_url: str
    model: str
    model_dir: str = ""  # where the nodes load the model from (02's snapshot of model.hf_id); '' = from params
    router: ServeCommand | None = None  # serve.layout replicas: the router before the replicas (base_url is its)

    def table(self) -> list[dict[str, str]]:
        return [{"node": c.node, "env": " ".join(f"{k}={v}" for k, v in c.env.items()),
                 "command": shlex.join(c.argv)} for c in [*self.commands, *filter(None, [self.router])]]


def serving_nodes(params: Params) -> list[NodeSpec]:
    """Head first, then workers, as many as the world size needs (a node without listed GPUs is one rank)."""
    world = params.serve.tensor_parallel_size * params.serve.pipeline_parallel_size
    chosen, slots = [], 0
    for spec in [params.head, *params.workers]:
        if slots >= world:
            break
        chosen.append(spec)
        slots += len(spec.gpus) or 1
    return chosen


def served_model_path(params: Params, model_dir: str = "") -> tuple[str, dict[str, str]]:
    """What `vllm serve` loads, and the env that keeps it there. model.path as is; model.hf_id from the
    snapshot 02 found in the node's cache (else by its id), with HF_HUB_CACHE naming that cache, which is
    mounted at the same path in the containers (not the containers' own ~/.cache), and HF_HUB_OFFLINE=1
    unless model.offline is false: a worker without internet then loads what is on its disk instead of
    asking the Hub."""
    model = params.model
    if model.path:
        return str(model.path), {}
    hub = model_dir.split("/models--")[0] if "/models--" in model_dir else (
        model.cache_dir if model.cache_dir.rstrip("/").endswith("/hub") else f"{model.cache_dir.rstrip('/')}/hub")
    env = {"HF_HUB_CACHE": hub, **({"HF_HUB_OFFLINE": "1"} if model.offline else {})}
    return model_dir or str(model.hf_id), env


def serve_argv(params: Params, settings: ServeSettings, executor: str, spec: NodeSpec, rank: int,
               nnodes: int, model_dir: str = "") -> list[str]:
    """One node's `vllm serve` argv, every value from params (the model as `served_model_path` has it)."""
    model, _ = served_model_path(params, model_dir)
    argv = ["vllm", "serve", model, "--served-model-name", params.model.served_name,
            "--host", str(settings.host), "--port", str(settings.port),
            "--tensor-parallel-size", str(settings.tensor_parallel_size),
            "--pipeline-parallel-size", str(settings.pipeline_parallel_size), "--dtype", settings.dtype]
    if executor != DEFAULT:
        argv += ["--distributed-executor-backend", executor]
    if executor == "mp" and nnodes > 1:
        argv += ["--nnodes", str(nnodes), "--node-rank", str(rank), "--master-addr", str(params.head.fabric_ip),
                 "--master-port", str(settings.master_port)]
        if rank > 0:
            argv.append("--headless")
    for flag, value in (("--max-model-len", settings.max_model_len), ("--max-num-seqs", settings.max_num_seqs),
                        ("--gpu-memory-utilization", settings.gpu_memory_utilization),
                        ("--kv-cache-memory-bytes", settings.kv_cache_memory_bytes),
                        ("--reasoning-parser", settings.reasoning_parser),
                        ("--tool-call-parser", settings.tool_call_parser), ("--chat-template", settings.chat_template)):
        if value is not None:
            argv += [flag, str(value)]
    if settings.tool_call_parser:
        argv.append("--enable-auto-tool-choice")
    if settings.enforce_eager:
        argv.append("--enforce-eager")
    if settings.speculative:
        argv += ["--speculative-config", settings.speculative.config_json()]
    return argv + list(settings.extra_args)


def plan(ctx: Context, executor: str, settings: ServeSettings | None = None, model_dir: str = "") -> ServePlan:
    """Commands for every node that serves: the head alone for `ray`, one rank per node for `mp`; `model_dir`
    is where 02 found model.hf_id on the nodes (ModelFacts.dir_on_nodes)."""
    params = ctx.params
    settings = settings or params.serve
    _, model_env = served_model_path(params, model_dir)
    nodes = serving_nodes(params) if executor == "mp" else [params.head]
    # the ray executor joins the cluster 04 formed; without RAY_ADDRESS, ray.init() looks for the last
    # cluster in the default temp dir (not 04's --temp-dir) and may start a private local instance instead
    joins = {"RAY_ADDRESS": address(params)} if executor == "ray" else {}
    commands = [ServeCommand(spec.name, serve_argv(params, settings, executor, spec, rank, len(nodes), model_dir),
                             {**joins, **model_env, **settings.env, **settings.node_env.get(spec.name, {})})
                for rank, spec in enumerate(nodes)]
    return ServePlan(executor, settings, commands, f"http://{params.head.fabric_ip}:{settings.port}",
                     params.model.served_name, model_dir)

