"""Image selection: probe each candidate image for the model (facts, registry, inspection), classify, decide.

    model_target(ctx, recorded) -> ModelTarget         the model's architecture, model_type and directory
    probe_registry(ctx, image, architecture, node=None) -> RegistryProbe   static parse, no vLLM import
    probe_facts(ctx, image, node=None) -> ImageFacts   vLLM, torch, CUDA, Python, Ray, CUDA architectures
    probe_inspection(ctx, image, target, node=None) -> InspectionProbe     the image's own vLLM inspects
    compute_capabilities(ctx) / node_machines(ctx)     what the nodes need
    classify(facts, registry, inspection, ...) -> ImageVerdict
    evaluate(ctx, image, target, caps, machines, known=None) -> Candidate   every probe of one candidate (or the
                                                       Probes an earlier run kept: memo.py), and its verdict
                                                       (with one GPU operation where it is usable: gpuop.py)
    rows / inspection_logs / failure_reports / choose(candidates, evidence, policy, installed, ids) -> Decision
    image_policy(ctx) / image_state / summary
"""
from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass
from typing import Any

from packaging.version import InvalidVersion, Version

from ...core.analysis.hostfacts import goarch
from ...core.cluster.context import Context
from ...core.cluster.imageprobes import probe_registry, run_probe
from ...core.cluster.nodes import Node
from ...core.values.errors import SparkbookError
from ...core.values.evidence import Alternative, Decision
from ...core.values.handoff import ImageChoice
from ...core.values.imagefacts import RegistryProbe
from ...core.values.modelinfo import ModelFacts, ranks_per_node
from ...core.values.stagelist import DIAGNOSE, IMAGES
from ...core.values.state import MissingState
from .gpuop import GpuOp, kernel_mismatch, probe_gpu_op
from .tags import TagHistory


@dataclass(frozen=True)
class ModelTarget:
    """What the probes test: the model's first architecture, its model_type and its directory on the nodes."""

    architecture: str
    model_type: str
    directory: str
    source: str  # "state (02-diagnosis)" | "config.json on <head>"


def model_target(ctx: Context, recorded: ModelFacts | None) -> ModelTarget:
    """The model as 02-diagnosis recorded it (`recorded`); where the state lacks it, read config.json on the head."""
    if recorded is not None:
        return ModelTarget(recorded.architectures[0], recorded.model_type, recorded.dir_on_nodes or _model_dir(ctx),
                           f"state ({DIAGNOSE.name})")
    config = json.loads(ctx.head.read_text(f"{_model_dir(ctx)}/config.json"))
    return ModelTarget(config["architectures"][0], config.get("model_type", ""), _model_dir(ctx),
                       f"config.json on {ctx.head.name}")


def _model_dir(ctx: Context) -> str:
    if ctx.params.model.path is None:
        raise MissingState(f"model.path is not set and {DIAGNOSE.name} has not recorded the model's directory",
                           stage=IMAGES.name, remediation=f"run {DIAGNOSE.id} first")
    return ctx.params.model.path


@dataclass(frozen=True)
class ImageFacts:
    """What an image holds (read from package metadata; only a CUDA torch is imported, for its arch list)."""

    image: str
    image_id: str | None
    size_bytes: int | None
    python: str | None
    vllm_version: str | None
    torch_version: str | None
    torch_cuda: str | None
    ray_version: str | None
    transformers_version: str | None
    cuda_archs: list[str]
    cuda_archs_source: str
    duration_s: float
    error: str = ""
    architecture: str | None = None  # the image's CPU architecture as Docker records it (amd64, arm64)
    ray_cli: str | None = None  # where the image's `ray` command is (None: not on its PATH)
    native_multinode: bool | None = None  # its `vllm serve` takes --nnodes (None: unread)
    repo_digests: tuple[str, ...] = ()  # name@sha256:... as the registries it came from know it (none: built here)

    @property
    def ray(self) -> str | None:
        """Ray's version where the image has both its module and the `ray` CLI 04 starts; None: no usable Ray
        (stock vLLM images since 0.19 carry none)."""
        return self.ray_version if self.ray_cli else None


@dataclass(frozen=True)
class InspectionProbe:
    """The image's own vLLM resolving and inspecting the architecture natively (model_impl="vllm")."""

    image: str
    architecture: str
    inspected: bool
    resolved: str | None
    error_line: str
    error: str
    cause: str
    cause_text: str
    transformers_knows: bool
    import_s: float | None
    duration_s: float
    probe_error: str = ""


@dataclass(frozen=True)
class ImageVerdict:
    """One candidate's classification, the findings that go with it, and whether it can be chosen."""

    image: str
    status: str  # STATUSES
    summary: str
    flags: list[str]
    blocking: list[str]

    @property
    def usable(self) -> bool:
        return self.status == LOADS and not self.blocking


@dataclass(frozen=True)
class Candidate:
    """Everything 03 learned about one candidate image."""

    facts: ImageFacts
    registry: RegistryProbe
    inspection: InspectionProbe
    verdict: ImageVerdict
    gpu_op: GpuOp | None = None  # None: no node lists GPUs, or the image was not usable before it

    @property
    def image(self) -> str:
        return self.facts.image


NOT_REGISTERED, FAILS_INSPECTION, LOADS, PROBE_FAILED = ("not registered", "registered, fails inspection", "loads",
                                                       "probe failed")
NODE_DRIVER, WRONG_CPU = "node driver problem", "wrong CPU architecture"
NOT_RUN = "not run: "  # the probe error of an image that was not run on the head (another CPU architecture)
# Errors of the node's NVIDIA driver or container runtime, not of the image: no image could use the GPU there, so they
# are a finding about the node, never a rejection of the image as a graft (real texts: tests/unit/data/
# cuda-driver-errors.txt). "libcuda.so" is the driver's library (mounted by the container toolkit); "libcudart.so"
# (the image's own CUDA runtime) is the image's and does not match.
DRIVER_ERRORS = ("libcuda.so", "CUDA driver version is insufficient", "no CUDA-capable device is detected",
                 "Found no NVIDIA driver", "No CUDA GPUs are available", "could not select device driver")
FACTS_TIMEOUT_S = 60
INSPECT_TIMEOUT_S = 600
GRAFT_EXPLANATION = (
    "The registry entry names a model module, and the module file is there, but importing it fails inside this "
    "vLLM: model files are written against the internals of the vLLM release they come from (base classes, "
    "layers, kernels, config helpers). Files grafted from a newer release import names that the older one does "
    "not have, so the name check passes and the inspection (what `vllm serve` does first) fails. The fix is an "
    "image whose own vLLM implements the architecture, not more grafting.")


def candidate_refs(ctx: Context) -> list[str]:
    """The candidate images from params (the Python runtime has one candidate: its interpreter's env)."""
    return ctx.images.candidates()


def probe_facts(ctx: Context, image: str, node: Node | None = None) -> ImageFacts:
    """Versions in `image` on `node` (default: the head), with its image ID and size there."""
    node = node or ctx.head
    t0 = time.monotonic()
    source = ctx.images
    image_id, size = source.image(node, image) or (None, None)
    doc, error = run_probe(ctx, image, "facts", [], node=node, timeout=FACTS_TIMEOUT_S)
    return _facts(image, image_id, size, doc, error, t0, source.architecture(node, image), source.digests(node, image))


def _facts(image: str, image_id: str | None, size: int | None, doc: dict[str, Any], error: str, t0: float,
           architecture: str | None, digests: tuple[str, ...]) -> ImageFacts:
    return ImageFacts(
        image=image, image_id=image_id, size_bytes=size, python=doc.get("python"),
        vllm_version=doc.get("vllm_version"), torch_version=doc.get("torch_version"),
        torch_cuda=doc.get("torch_cuda"), ray_version=doc.get("ray_version"),
        transformers_version=doc.get("transformers_version"), cuda_archs=doc.get("cuda_archs", []),
        cuda_archs_source=doc.get("cuda_archs_source", ""), duration_s=round(time.monotonic() - t0, 2), error=error,
        architecture=architecture, ray_cli=doc.get("ray_cli"), native_multinode=doc.get("native_multinode"),
        repo_digests=digests)


def probe_inspection(ctx: Context, image: str, target: ModelTarget, node: Node | None = None,
                     timeout: float = INSPECT_TIMEOUT_S) -> InspectionProbe:
    """The image's vLLM inspects the architecture as `vllm serve` does (fresh VLLM_CACHE_ROOT, offline)."""
    t0 = time.monotonic()
    doc, error = run_probe(ctx, image, "inspect_model", [target.architecture, target.model_type], node=node,
                              env={"HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"}, timeout=timeout)
    return InspectionProbe(
        image=image, architecture=target.architecture, inspected=bool(doc.get("inspected")),
        resolved=doc.get("resolved"), error_line=doc.get("error_line", ""), error=doc.get("error", ""),
        cause=doc.get("cause", ""), cause_text=doc.get("cause_text", ""),
        transformers_knows=bool(doc.get("transformers_knows")), import_s=doc.get("import_s"),
        duration_s=round(time.monotonic() - t0, 2),
        probe_error=error or ("" if "inspected" in doc else doc.get("error", "")))


def compute_capabilities(ctx: Context) -> dict[str, list[str]]:
    """Each GPU node's compute capabilities (nvidia-smi); nodes without GPUs in params are left out."""
    gpu_nodes = [ctx.cluster.nodes[s.name] for s in ctx.params.nodes if s.gpus]
    argv = ["nvidia-smi", "--query-gpu=compute_cap", "--format=csv,noheader"]
    outcomes = ctx.cluster.fan_out(lambda n: n.run(argv, timeout=30, check=True).stdout.split(), gpu_nodes)
    return {name: sorted(set(o.value or [])) for name, o in outcomes.items()}


def node_machines(ctx: Context) -> dict[str, str]:
    """Each node's CPU architecture (`uname -m`: x86_64, aarch64); a node that does not answer is left out."""
    outcomes = ctx.cluster.fan_out(lambda n: n.run(["uname", "-m"], timeout=30, check=True).stdout.strip())
    return {name: o.value for name, o in outcomes.items() if o.ok and o.value}


def arch_mismatch(architecture: str | None, machines: dict[str, str]) -> list[str]:
    """Why the image cannot run on each node whose CPU architecture differs from the image's."""
    if not architecture:
        return []
    return [f"the image is linux/{architecture}, {node} is {machine} ({goarch(machine)}): it does not run there "
            "(exec format error)" for node, machine in machines.items() if goarch(machine) != architecture]


def arch_covers(archs: list[str], capability: str) -> bool:
    """Whether a CUDA architecture list ("12.1a", "sm_90", "8.0+PTX", "compute_120", "12.0f") runs on `capability`.

    CUDA's compatibility: a plain cubin (sm_XY) runs on the same major at the same or a higher minor (sm_120 on GB10's
    12.1), a family cubin (sm_XYf) likewise; an arch-specific one (sm_XYa) only on exactly X.Y; PTX (compute_XY,
    +PTX) is compiled by the driver for any GPU at X.Y or above."""
    want = _cc(capability)
    if want is None:
        return False
    for entry in archs:
        ptx = entry.endswith("+PTX") or entry.startswith("compute_")
        bare = entry.removesuffix("+PTX").removeprefix("sm_").removeprefix("compute_").strip()
        have = _cc(bare)
        if have is None:
            continue
        if have == want or (ptx and have <= want):
            return True
        if not bare.lower().endswith("a") and have[0] == want[0] and have[1] <= want[1]:
            return True
    return False


def _cc(text: str) -> tuple[int, int] | None:
    text = text.strip().rstrip("afAF")
    if "." in text:
        major, minor = text.split(".", 1)
    elif text.isdigit() and len(text) >= 2:
        major, minor = text[:-1], text[-1]
    else:
        return None
    return (int(major), int(minor)) if major.isdigit() and minor.isdigit() else None


def driver_error(*texts: str) -> str | None:
    """The first line of `texts` that names a driver or container-runtime error of the node (None if none)."""
    return next((line.strip()[:300] for text in texts for line in text.splitlines()
                 if any(sig in line for sig in DRIVER_ERRORS)), None)


def _ray_missing(facts: ImageFacts) -> str:
    return "neither the ray module nor the ray CLI" if not facts.ray_version else \
        f"the ray module {facts.ray_version} without the ray CLI on its PATH"


def classify(facts: ImageFacts, registry: RegistryProbe, inspection: InspectionProbe, *, executor: str | None,
             capabilities: dict[str, list[str]], machines: dict[str, str] | None = None,
             multinode: bool = False) -> ImageVerdict:
    """not registered / registered but fails inspection / loads, a node's driver problem (not the image's), plus
    Ray, CPU-architecture and CUDA-architecture findings."""
    arch, image = registry.architecture, facts.image
    flags, blocking = [], arch_mismatch(facts.architecture, machines or {})
    native = registry.registered and not registry.transformers_backend
    driver = None if inspection.inspected else driver_error(
        inspection.error, inspection.cause_text, inspection.probe_error, registry.error, facts.error)
    if inspection.probe_error.startswith(NOT_RUN):
        status, summary = WRONG_CPU, "not probed: the image's CPU architecture is not the head's"
    elif driver:
        status, summary = NODE_DRIVER, (f"the node's NVIDIA driver or container runtime failed, not the image: "
                                        f"{driver}")
    elif inspection.probe_error and not inspection.error:
        status, summary = PROBE_FAILED, f"the inspection probe failed: {inspection.probe_error}"
    elif inspection.inspected:
        status, summary = LOADS, f"vLLM {facts.vllm_version} resolves {arch} natively and inspection passes"
    elif native or inspection.cause:
        status = FAILS_INSPECTION
        summary = (f"registers {arch} ({registry.module}) but fails inspection: "
                   f"{inspection.cause or inspection.error_line}")
    else:
        status, summary = NOT_REGISTERED, (
            f"vLLM {facts.vllm_version} does not register {arch}: {inspection.error_line}" if facts.vllm_version
            else f"vLLM not found in {image}: {registry.error or inspection.error_line or facts.error}")
    if registry.transformers_backend or (status != LOADS and inspection.transformers_knows):
        flags.append(f"Transformers fallback: with `--model-impl auto` vLLM would serve {arch} through its "
                     "Transformers backend (it may report ready and fail on the first request); not counted as support")
    if executor == "ray" and not facts.ray:  # unset: 04 forms no Ray and 05 serves with vLLM's own launch
        blocking.append(f"no Ray in the image ({_ray_missing(facts)}), and serve.executor is ray: set "
                        "serve.executor: mp (vLLM's own multi-node launch) or leave it out, or install Ray in it")
    if executor != "ray" and not facts.ray and facts.native_multinode is False and multinode:
        blocking.append(f"no Ray in the image and its vLLM {facts.vllm_version} has no --nnodes: it cannot serve "
                        "across the nodes (choose an image with Ray or a vLLM that launches its own ranks)")
    for node, caps in capabilities.items():
        missing = [c for c in caps if not arch_covers(facts.cuda_archs, c)]
        if missing and facts.cuda_archs:
            blocking.append(f"CUDA architectures {facts.cuda_archs} lack {node}'s compute capability "
                            f"{', '.join(missing)}")
        elif missing and facts.torch_cuda:
            flags.append(f"CUDA architecture list unreadable ({facts.cuda_archs_source or 'not set'}); "
                         f"{node} needs {', '.join(missing)}")
    return ImageVerdict(image, status, summary, flags, blocking)


def evaluate(ctx: Context, image: str, target: ModelTarget, capabilities: dict[str, list[str]],
             machines: dict[str, str], known: Probes | None = None) -> Candidate:
    """Every probe of one candidate on the head, and its verdict; `known`: the probes' answers an earlier run kept
    for this image ID and model (images.memo), used instead of asking again (the verdict is judged anew, by this
    run's params and nodes). An image of another CPU architecture than the head's is not run (it would fail with an
    exec format error, or crawl under emulation)."""
    facts, registry, inspection = (known.facts, known.registry, known.inspection) if known else \
        _probe(ctx, image, target, machines)
    verdict = classify(facts, registry, inspection, executor=ctx.params.serve.executor, capabilities=capabilities,
                       machines=machines, multinode=sum(1 for r in ranks_per_node(ctx.params).values() if r) > 1)
    gpu_node = _gpu_node(ctx)
    if not verdict.usable or gpu_node is None:
        return Candidate(facts, registry, inspection, verdict)
    kept = known.gpu_op if known and known.gpu_op and known.gpu_op.node == gpu_node.name else None
    op = kept or probe_gpu_op(ctx, image, gpu_node)
    return Candidate(facts, registry, inspection, with_gpu_op(verdict, op), op)


def _probe(ctx: Context, image: str, target: ModelTarget, machines: dict[str, str]
           ) -> tuple[ImageFacts, RegistryProbe, InspectionProbe]:
    head, source = ctx.head, ctx.images
    architecture = source.architecture(head, image)
    wrong = arch_mismatch(architecture, {head.name: machines[head.name]} if head.name in machines else {})
    if not wrong:
        return probe_facts(ctx, image), probe_registry(ctx, image, target.architecture), \
            probe_inspection(ctx, image, target)
    image_id, size = source.image(head, image) or (None, None)
    facts = _facts(image, image_id, size, {}, wrong[0], time.monotonic(), architecture, source.digests(head, image))
    return (facts, *_not_probed(image, target.architecture, wrong[0]))


@dataclass(frozen=True)
class Probes:
    """What 03's probes of one candidate answered for one model: what the store keeps by the image's ID."""

    facts: ImageFacts
    registry: RegistryProbe
    inspection: InspectionProbe
    gpu_op: GpuOp | None

    @classmethod
    def of(cls, c: Candidate) -> Probes:
        return cls(c.facts, c.registry, c.inspection, c.gpu_op)

    @property
    def settled(self) -> bool:
        """Whether the answers are the image's own, worth keeping: none timed out, none is the node's (its driver,
        a busy GPU) and the image ran on the head."""
        errors = (self.facts.error, self.registry.error, self.inspection.probe_error)
        node_fault = driver_error(*errors, self.inspection.error, self.inspection.cause_text) is not None
        gpu_fault = self.gpu_op is not None and self.gpu_op.failure is not None and kernel_mismatch(self.gpu_op) is None
        return not (node_fault or gpu_fault or any(e.startswith(("timed out", NOT_RUN)) for e in errors))


def _gpu_node(ctx: Context) -> Node | None:
    """Where the GPU operation runs: the head where params list GPUs for it, else the first node that lists any."""
    listed = [s.name for s in ctx.params.nodes if s.gpus]
    name = ctx.head.name if ctx.head.name in listed else next(iter(listed), None)
    return ctx.cluster.nodes[name] if name else None


def with_gpu_op(verdict: ImageVerdict, op: GpuOp) -> ImageVerdict:
    """The verdict after the GPU operation: kernels without code for the GPU block the image; another failure is
    a finding (the node's driver or a busy GPU fails every image alike, so it is not held against this one)."""
    mismatch = kernel_mismatch(op)
    if mismatch:
        return dataclasses.replace(verdict, blocking=[*verdict.blocking, mismatch])
    if op.failure is None:
        return verdict
    line = op.failure.strip().splitlines()[-1][:200]
    return dataclasses.replace(verdict, flags=[*verdict.flags, f"the GPU operation on {op.node} failed, not for want "
                                               f"of kernels: {line}"])


def _not_probed(image: str, architecture: str, why: str) -> tuple[RegistryProbe, InspectionProbe]:
    return (RegistryProbe(image, architecture, None, False, None, None, None, None, False, 0, 0.0, NOT_RUN + why),
            InspectionProbe(image, architecture, False, None, "", "", "", "", False, None, 0.0, NOT_RUN + why))


class NoUsableImage(SparkbookError):
    """No candidate loads the model natively without a blocking finding."""

    stage = IMAGES.name


def rows(candidates: list[Candidate], history: dict[str, TagHistory] | None = None) -> list[dict[str, object]]:
    """The candidates table: versions, each probe's result and time, the verdict, and (`history`) whether the
    name still means the image an earlier run of this cluster probed."""
    out = []
    for c in candidates:
        f, r, i, v = c.facts, c.registry, c.inspection, c.verdict
        out.append({
            "image": c.image, "id": (f.image_id or "absent")[:19],
            "digest": f.repo_digests[0].partition("@")[2][:19] if f.repo_digests else "-",
            "since last run": history[c.image].cell() if history and c.image in history else "-",
            "GB": round((f.size_bytes or 0) / 1e9, 2),
            "vLLM": f.vllm_version, "torch (CUDA)": f"{f.torch_version} ({f.torch_cuda or 'cpu'})",
            "Python": f.python, "Ray": f.ray or ("none" if not f.ray_version else f"{f.ray_version}, no CLI"),
            "--nnodes": {True: "yes", False: "no", None: "-"}[f.native_multinode], "CPU": f.architecture or "-",
            "CUDA archs": " ".join(f.cuda_archs) or "-",
            "registry": ("registered" if r.registered else "not registered") + (f" in {r.module}" if r.module else "")
                        + (f" ({r.error})" if r.error else ""),
            "registry s": r.duration_s,
            "inspection": "passes" if i.inspected else (i.cause or i.error_line or i.probe_error),
            "inspection s": i.duration_s, "facts s": f.duration_s,
            "GPU op": c.gpu_op.cell() if c.gpu_op else "-", "verdict": v.status,
            "findings": "; ".join(v.blocking + v.flags) or "-"})
    return out


def inspection_logs(candidates: list[Candidate]) -> dict[str, str]:
    """Each inspection's full text, by the name of the log the notebook writes it to (the table keeps one line)."""
    logs = {}
    for c in candidates:
        slug = c.image.replace("/", "_").replace(":", "_")
        logs[f"{IMAGES.id}-inspect-{slug}.txt"] = "\n\n".join(filter(None, [
            f"# {c.image}: {c.verdict.status}", c.inspection.error, c.inspection.cause_text, c.inspection.probe_error]))
    return logs


def failure_reports(candidates: list[Candidate]) -> str:
    """For each registered-but-failing image: the inspection error, its root cause, and why grafts fail."""
    failing = [c for c in candidates if c.verdict.status == FAILS_INSPECTION]
    if not failing:
        return "no candidate registers the architecture and then fails inspection"
    parts = [f"{c.image}: {c.inspection.error_line}\n"
             f"  root cause (vLLM's inspection subprocess): {c.inspection.cause or '-'}" for c in failing]
    return "\n\n".join([*parts, GRAFT_EXPLANATION])


def choose(candidates: list[Candidate], evidence: list[str], policy: str = "newest", installed: str | None = None,
           installed_ids: dict[str, str | None] | None = None) -> Decision:
    """The image that serves the model, by runtime.image_policy: `keep_installed` keeps `installed` where it loads
    the model natively with no blocking finding and every node holds it under one ID (`installed_ids`); else (and
    under `newest`) the newest vLLM among the candidates that load it natively with no blocking finding."""
    usable = [c for c in candidates if c.verdict.usable]
    if not usable:
        driver = any(c.verdict.status == NODE_DRIVER for c in candidates)
        raise NoUsableImage("no candidate image loads the model: "
                            + "; ".join(f"{c.image}: {_reason(c)}" for c in candidates),
                            remediation="fix the node's NVIDIA driver or container toolkit first (`nvidia-smi` on the "
                                        "node, then `docker run --rm --gpus all IMAGE nvidia-smi`) and run 03 again"
                            if driver else None)
    # on a tie of vLLM versions the image with Ray: it serves either way, with Ray or vLLM's own launch (issue 45)
    newest = max(usable, key=lambda c: (_version(c.facts.vllm_version), c.facts.ray is not None,
                                        -candidates.index(c)))
    kept, why_not = keep_installed(usable, installed, installed_ids or {}) if policy == "keep_installed" \
        else (None, None)
    chosen = kept or newest
    alternatives = [Alternative(c.image, _reason(c) if not c.verdict.usable else
                                f"also loads it; {chosen.image} is installed on every node as {_ids(installed_ids)} "
                                "and loads it natively: a newer image was not needed" if kept else
                                _older(c, chosen)) for c in candidates if c is not chosen]
    f, i = chosen.facts, chosen.inspection
    decided = ("image_policy keep_installed: the installed image loads the model on every node" if kept else
               f"image_policy {policy}: the newest usable candidate" + (f" ({why_not})" if why_not else ""))
    reason = (f"{decided}; its own vLLM {f.vllm_version} registers {i.architecture} natively "
              f"({chosen.registry.module}) and inspection resolves it to {i.resolved}; Ray {f.ray or 'absent'}"
              + (f"; {'; '.join(chosen.verdict.flags)}" if chosen.verdict.flags else ""))
    return Decision(f"Which image serves {i.architecture}?", chosen.image, reason, alternatives,
                    ["candidates table above (events.jsonl: image_probe)", *evidence], key="image")


def _older(c: Candidate, chosen: Candidate) -> str:
    """Why a usable candidate lost to the newest: an older vLLM, or the same one without Ray."""
    if _version(c.facts.vllm_version) == _version(chosen.facts.vllm_version) and c.facts.ray is None:
        return (f"also loads it, but has no Ray (the module and the ray CLI); {chosen.image} has the same vLLM "
                f"({chosen.facts.vllm_version}) and Ray {chosen.facts.ray}")
    return f"also loads it; {chosen.image} has the newer vLLM ({chosen.facts.vllm_version})"


def image_policy(ctx: Context, recorded: str | None = None) -> tuple[str, str | None]:
    """(runtime.image_policy, the installed image): runtime.installed_image, else the one 02 probed as the old
    deployment's (`recorded`, found running by 01) where the source runs images; the Python runtime has one
    candidate: `newest`, none."""
    source = ctx.images
    return source.policy, source.installed(recorded)


def keep_installed(usable: list[Candidate], installed: str | None,
                   ids: dict[str, str | None]) -> tuple[Candidate | None, str | None]:
    """The installed image's candidate where keep_installed keeps it, else (None, why it is not kept)."""
    if installed is None:
        return None, "no runtime.installed_image"
    found = next((c for c in usable if c.image == installed), None)
    if found is None:
        return None, f"the installed {installed} is not a usable candidate"
    held = set(ids.values())
    if not ids or None in held or len(held) != 1 or held != {found.facts.image_id}:
        return None, f"the installed {installed} is not on every node under one ID ({_ids(ids)})"
    return found, None


def _ids(ids: dict[str, str | None] | None) -> str:
    return ", ".join(f"{n}: {(i or 'absent')[:19]}" for n, i in (ids or {}).items()) or "no IDs read"


def _reason(c: Candidate) -> str:
    return "; ".join([c.verdict.summary, *c.verdict.blocking, *c.verdict.flags])


def _version(text: str | None) -> Version:
    try:
        return Version(text or "0")
    except InvalidVersion:
        return Version("0")


def image_state(candidates: list[Candidate], ref: str, ids: dict[str, str | None]) -> ImageChoice:
    """What 04/05 read from the run state of the candidate `ref`: the ref, its ID and digests, versions, every node's
    ID, and every candidate's ID on the head (the sealed record a later run's 02 sets its tags beside). An
    environment has no image ID (the Python runtime): its ID is the identity every node reports for it, where they
    agree, so that 04 can tell the places it started from it."""
    c = next(c for c in candidates if c.image == ref)
    shared = set(ids.values())
    agreed = shared.pop() if len(shared) == 1 else None
    return ImageChoice(ref=c.image, id=c.facts.image_id or agreed, vllm_version=c.facts.vllm_version,
                       ray_version=c.facts.ray, nodes=ids, digests=list(c.facts.repo_digests),
                       candidates={o.image: o.facts.image_id for o in candidates})


def summary(candidates: list[Candidate], decision: Decision, copied: str) -> str:
    """The closing findings, one line per candidate plus the choice and the copy."""
    lines = [f"- {c.image} (vLLM {c.facts.vllm_version}): {c.verdict.status}; "
             f"registry {c.registry.duration_s:.1f} s, inspection {c.inspection.duration_s:.1f} s"
             + (f", GPU op {c.gpu_op.cell()}" if c.gpu_op else "")
             + "".join(f"; {f}" for f in c.verdict.blocking + c.verdict.flags) for c in candidates]
    return "\n".join([*lines, f"- chosen: {decision.choice}", f"- distribution: {copied}"])
