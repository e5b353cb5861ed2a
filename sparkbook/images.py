"""Image selection: probe each candidate image for the model (facts, registry, inspection), classify, decide.

    model_target(run) -> ModelTarget                   the model's architecture, model_type and directory
    probe_registry(run, image, architecture, node=None) -> RegistryProbe   static parse, no vLLM import
    probe_facts(run, image, node=None) -> ImageFacts   vLLM, torch, CUDA, Python, Ray, CUDA architectures
    probe_inspection(run, image, target, node=None) -> InspectionProbe     the image's own vLLM inspects
    classify(...) -> Verdict;  choose(verdicts) -> Decision
"""
from __future__ import annotations

import json
import time
import weakref
from dataclasses import dataclass

import docker.errors

from . import probes
from .nodes import Node, NodeError, Result
from .record import Run
from .runtime import Runtime, runtime_for

REGISTRY_TIMEOUT_S = 30

_RUNTIMES: weakref.WeakKeyDictionary[Run, Runtime] = weakref.WeakKeyDictionary()


@dataclass(frozen=True)
class ModelTarget:
    """What the probes test: the model's first architecture, its model_type and its directory on the nodes."""

    architecture: str
    model_type: str
    directory: str
    source: str  # "state (02-diagnosis)" | "config.json on <head>"


@dataclass(frozen=True)
class RegistryProbe:
    """Whether an image's vLLM registers an architecture, read from its registry.py without importing vLLM."""

    image: str
    architecture: str
    vllm_version: str | None
    registered: bool
    module: str | None
    class_name: str | None
    table: str | None
    module_present: bool | None
    transformers_backend: bool
    n_architectures: int
    duration_s: float
    error: str = ""


def runtime(run: Run) -> Runtime:
    """The run's runtime (Docker or Python env), made once per run."""
    if run not in _RUNTIMES:
        _RUNTIMES[run] = runtime_for(run.params)
    return _RUNTIMES[run]


def model_target(run: Run) -> ModelTarget:
    """The model as 02-diagnosis recorded it; when the state lacks it, read config.json on the head."""
    try:
        model = run.recall("model")
        return ModelTarget(model["architectures"][0], model.get("model_type", ""),
                           model.get("dir_on_nodes") or _model_dir(run), "state (02-diagnosis)")
    except KeyError:
        head = run.cluster.head
        config = json.loads(head.read_text(f"{_model_dir(run)}/config.json"))
        return ModelTarget(config["architectures"][0], config.get("model_type", ""), _model_dir(run),
                           f"config.json on {head.name}")


def _model_dir(run: Run) -> str:
    if run.params.model.path is None:
        raise KeyError("model.path is not set and 02-diagnosis has not recorded the model's directory: run 02 first")
    return run.params.model.path


def run_probe(run: Run, image: str, name: str, args: list[str], *, node: Node | None = None,
              env: dict[str, str] | None = None, timeout: float) -> tuple[dict, Result | None, str]:
    """Run probe script `name` in a fresh container of `image`; (its JSON document, the result, an error)."""
    node = node or run.cluster.head
    try:
        result = runtime(run).one_off(node, image, ["python3", "-c", probes.source(name), *args],
                                      env=env, timeout=timeout)
    except (docker.errors.DockerException, NodeError) as exc:
        return {}, None, _first_line(str(exc))
    if result.timed_out:
        return {}, result, f"timed out after {timeout:g} s"
    try:
        return json.loads(result.stdout.strip().splitlines()[-1]), result, ""
    except (json.JSONDecodeError, IndexError):
        return {}, result, f"exit {result.exit_code}: {(result.stderr or result.stdout).strip()[-400:]}"


def probe_registry(run: Run, image: str, architecture: str, node: Node | None = None) -> RegistryProbe:
    """Is `architecture` registered in `image`'s vLLM? Parses registry.py in the image (no vLLM import)."""
    t0 = time.monotonic()
    doc, _, error = run_probe(run, image, "registry", [architecture], node=node, timeout=REGISTRY_TIMEOUT_S)
    return RegistryProbe(
        image=image, architecture=architecture, vllm_version=doc.get("vllm_version"),
        registered=bool(doc.get("registered")), module=doc.get("module"), class_name=doc.get("class_name"),
        table=doc.get("table"), module_present=doc.get("module_present"),
        transformers_backend=bool(doc.get("transformers_backend")), n_architectures=doc.get("n_architectures", 0),
        duration_s=round(time.monotonic() - t0, 2), error=error or doc.get("error", ""))


def _first_line(text: str) -> str:
    return text.strip().splitlines()[0][:400] if text.strip() else ""
