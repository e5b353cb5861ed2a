"""`sparkbook plan PARAMS`: what each stage would do on the cluster now, before anything is touched. Only read-only
probes run (the inventory, node facts, the model's files, image IDs, whether /dev/infiniband exists); the commands
are the exact argv 04 and 05 build (`docker run` rendered from what 04's container start passes the Docker API),
env by NAME only. The image is the last good deployment's (03 may choose another: it probes candidates)."""
from __future__ import annotations

import shlex
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..core.context import Context
from ..core.errors import SparkbookError
from ..core.modelinfo import human_params, memory_fit, model_facts
from ..core.params import DockerRuntime, NodeSpec, Params
from ..core.runtime import Place
from ..core.runtime_docker import LABEL
from ..core.stagelist import CLEANUP, DIAGNOSE, IMAGES, RAYCLUSTER, SERVE, Stage
from ..stages import diagnose
from ..stages.cleanup.inventory import inventory
from ..stages.cleanup.planning import plan as cleanup_plan
from ..stages.images import distribute
from ..stages.raycluster.formation import ray_argv
from ..stages.serve.commands import plan as serve_plan
from .operate import NothingDeployed, last_good

FANOUT_S = 120


@dataclass(frozen=True)
class StagePreview:
    """One stage's part of the plan: rows to show, or why it cannot be told without acting."""

    stage: Stage
    title: str
    rows: list[dict[str, str]]
    unknown: str | None = None  # None: previewed; else why not


def docker_run_argv(params: Params, spec: DockerRuntime, place: Place, *, gpus: bool, devices: list[str]) -> list[str]:
    """The `docker run` equivalent of the node container 04 starts through the Docker API (DockerNodes.start):
    the same name, entrypoint, network, init, shm, mounts, ulimit, devices and GPUs; env by name only (values
    and secrets stay out of the plan)."""
    cache = params.model.cache_dir
    env = sorted({*spec.env, *place.env, *params.secrets})
    argv = ["docker", "run", "-d", "--name", place.name, "--network", "host", "--init", "--shm-size",
            str(spec.shm_size), "--label", f"{LABEL}={place.name}", "-v", f"{cache}:{cache}:rw",
            *[a for name in env for a in ("-e", name)]]
    argv += ["--privileged"] if spec.privileged else []
    argv += ["--ulimit", f"nofile={spec.nofile}:{spec.nofile}"] if spec.nofile else []
    argv += [a for d in devices for a in ("--device", f"{d}:{d}")]
    argv += ["--ipc", "host"] if spec.ipc_host else []
    argv += ["--gpus", "all"] if gpus else []
    return [*argv, "--entrypoint", "sleep", str(place.image), "infinity"]


def _cleanup(ctx: Context) -> StagePreview:
    found = ctx.cluster.fan_out(lambda n: inventory(n, ctx.params.cleanup), timeout=FANOUT_S)
    invs = [o.value for o in found.values() if o.ok and o.value]
    rows = [{k: str(v) for k, v in r.items()} for r in cleanup_plan(invs, ctx.params.cleanup).rows()]
    rows += [{"node": n, "stop": f"UNREACHABLE: {o.error}"} for n, o in found.items() if not o.ok]
    return StagePreview(CLEANUP, "what cleanup would stop (with -p confirm_cleanup=true), in order", rows)


def _fit(ctx: Context) -> StagePreview:
    facts = diagnose.facts_all(ctx)
    source = diagnose.config_source(diagnose.model_files_all(ctx), ctx.params.head.name)
    model = model_facts(source.config or {}, source.index, source.file_sizes, source.dir)
    fit = memory_fit(model, ctx.params, {n: o.value.memory.for_fit(n) for n, o in facts.items() if o.ok and o.value})
    return StagePreview(DIAGNOSE, f"memory fit of {ctx.params.model.served_name} "
                        f"({human_params(model.total_params)} parameters)",
                        [{"node": f.node, "ranks": str(f.ranks), "planned GiB": f"{f.planned_gib:.1f}",
                          "allocatable GiB": f"{f.allocatable_gib:.1f}", "fits": "yes" if f.fits else "NO",
                          "why": f.why} for f in fit])


def _copies(ctx: Context, image: str) -> StagePreview:
    p = distribute.plan(ctx, image)
    return StagePreview(IMAGES, f"image copy of {image} ({p.size_bytes / 1e9:.2f} GB) from {p.source}",
                        [{"node": n, "holds": held or "nothing", "action": "copy from the head over the fabric"
                          if n in p.to_copy else "already held: nothing copied"} for n, held in p.held.items()])


def _containers(ctx: Context) -> StagePreview:
    spec = ctx.params.runtime
    rows = []
    for node in ctx.cluster:
        ns: NodeSpec = node.spec
        start = (shlex.join(docker_run_argv(ctx.params, spec, ctx.places[node.name], gpus=bool(ns.gpus),
                                            devices=ctx.runtime.devices(node)))
                 if isinstance(spec, DockerRuntime) else f"(python runtime: processes of {spec.python})")
        rows.append({"node": node.name, "node container": start, "ray start": shlex.join(ray_argv(ctx.params, ns)),
                     "env (names)": ", ".join(sorted(ctx.places[node.name].env))})
    return StagePreview(RAYCLUSTER, "node containers and Ray", rows)


def _serve(ctx: Context, executor: str, model_dir: str) -> StagePreview:
    p = serve_plan(ctx, executor, model_dir=model_dir)
    return StagePreview(SERVE, f"vllm serve ({executor} executor), the API at {p.base_url}",
                        [{"node": c.node, "vllm serve": shlex.join(c.argv), "env (names)": ", ".join(sorted(c.env))}
                         for c in p.commands])


def preview(ctx: Context, outputs: Path) -> list[StagePreview]:
    """Every stage's preview; one that cannot be told (no earlier deployment, a node down) says why."""
    try:
        d = last_good(ctx.params, outputs)
        image, executor, model_dir = d.image.ref, d.endpoint.executor, _model_dir(d.endpoint.commands)
    except NothingDeployed:
        d, image, executor, model_dir = None, "", ctx.params.serve.executor, ""
    steps: list[tuple[Stage, str, Callable[[], StagePreview]]] = [
        (CLEANUP, "cleanup", lambda: _cleanup(ctx)), (DIAGNOSE, "memory fit", lambda: _fit(ctx))]
    if d is None:
        why = f"no run of this cluster deployed a server yet: {IMAGES.id} chooses the image by probing the candidates"
        unknown = [StagePreview(stage, "", [], why) for stage in (IMAGES, RAYCLUSTER, SERVE)]
    else:
        at = ctx.with_image(image)
        unknown = []
        steps += [(IMAGES, "image copy", lambda: _copies(at, image)),
                  (RAYCLUSTER, "containers", lambda: _containers(at)),
                  (SERVE, "serve", lambda: _serve(at, executor, model_dir))]
    out = []
    for stage, what, step in steps:
        try:
            out.append(step())
        except (SparkbookError, OSError) as exc:
            out.append(StagePreview(stage, what, [], f"cannot tell without acting: {exc}"[:400]))
    return out + unknown


def _model_dir(commands: dict[str, list[str]]) -> str:
    """The model path the recorded `vllm serve` loaded (its third word), so the plan serves the same snapshot."""
    argv = next(iter(commands.values()), [])
    return argv[2] if len(argv) > 2 and argv[2].startswith("/") else ""
