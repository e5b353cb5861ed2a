"""Probes that run inside an image (or the Python environment): one JSON document each (`probes.parse`).

Shared by 02 (is the model registered in the installed image?) and 03 (every candidate).
    run_probe(ctx, image, name, args) -> (document, error)   a probe script in a fresh container of the image
    probe_registry(ctx, image, architecture) -> RegistryProbe   static parse of the registry, no vLLM import
    probe_installed(ctx, architecture, found) -> RegistryProbe | None  the old deployment's image (params', else
                                                      the first image 01 found running that holds vLLM)
"""
from __future__ import annotations

import dataclasses
import time
from typing import Any

from ..values.errors import ProbeOutputError
from ..values.imagefacts import RegistryProbe
from . import probes
from .context import Context
from .nodes import Node, NodeError, Result

REGISTRY_TIMEOUT_S = 30


def run_probe(ctx: Context, image: str, name: str, args: list[str], *, node: Node | None = None,
              env: dict[str, str] | None = None, timeout: float) -> tuple[dict[str, Any], str]:
    """Run probe script `name` in a fresh container of `image`; (its JSON document, or an error)."""
    node = node or ctx.head
    try:
        result = in_image(ctx, node, image, ["python3", "-c", probes.source(name), *args], env or {}, timeout)
    except NodeError as exc:
        return {}, _first_line(str(exc))
    if result.timed_out:
        return {}, f"timed out after {timeout:g} s"
    try:
        return probes.parse(result, node=node.name, probe=name), ""
    except ProbeOutputError as exc:
        return {}, f"{exc}; exit {result.exit_code}: {(result.stderr or result.stdout).strip()[-400:]}"


def in_image(ctx: Context, node: Node, image: str | None, argv: list[str], env: dict[str, str], timeout: float
             ) -> Result:
    """argv in a fresh container of `image` (or the Python env): no network, model cache read-only, removed
    (the runtime's `one_off`: for Docker the node's own `docker run --rm`, in one SSH call), with the node's GPUs
    where params list any for it: a CUDA image probed without them cannot load libcuda."""
    return ctx.runtime.one_off(node, image, argv, env=env, timeout=timeout, gpus=bool(ctx.params.node(node.name).gpus))


def probe_registry(ctx: Context, image: str, architecture: str, node: Node | None = None) -> RegistryProbe:
    """Is `architecture` registered in `image`'s vLLM? Parses registry.py in the image (no vLLM import)."""
    t0 = time.monotonic()
    doc, error = run_probe(ctx, image, "registry", [architecture], node=node, timeout=REGISTRY_TIMEOUT_S)
    return RegistryProbe(
        image=image, architecture=architecture, vllm_version=doc.get("vllm_version"),
        registered=bool(doc.get("registered")), module=doc.get("module"), class_name=doc.get("class_name"),
        table=doc.get("table"), module_present=doc.get("module_present"),
        transformers_backend=bool(doc.get("transformers_backend")), n_architectures=doc.get("n_architectures", 0),
        duration_s=round(time.monotonic() - t0, 2), error=error or doc.get("error", ""))


def probe_installed(ctx: Context, architecture: str, found: dict[str, list[str]] | None = None
                    ) -> RegistryProbe | None:
    """The registry probe of the old deployment's image: runtime.installed_image, else the first of the images
    01 found running (`found`: image -> where; candidates of params first, then the most used) whose probe reads
    a vLLM version; None where there is none (a Python runtime has no installed image)."""
    installed = ctx.images.installed()
    if installed:
        return identified(ctx, probe_registry(ctx, installed, architecture))
    if not ctx.images.runs_images:
        return None
    listed = ctx.images.candidates()
    for image in sorted(found or {}, key=lambda i: (i not in listed, -len((found or {})[i]))):
        probe = probe_registry(ctx, image, architecture)
        if probe.vllm_version:
            return identified(ctx, probe)
    return None


def identified(ctx: Context, probe: RegistryProbe) -> RegistryProbe:
    """The probe naming its image by ID and repo digests on the head as well as by its ref."""
    held = ctx.images.image(ctx.head, probe.image)
    return dataclasses.replace(probe, image_id=held[0] if held else None,
                               repo_digests=ctx.images.digests(ctx.head, probe.image))


def no_installed_reason(ctx: Context, found: dict[str, list[str]] | None = None) -> str:
    if ctx.images.installed() or not ctx.images.runs_images or found is None:
        return ctx.images.no_installed_reason()
    seen = ", ".join(f"{image} ({', '.join(where)})" for image, where in found.items()) or "none"
    return (f"runtime.installed_image is not set, and no image 01 found running holds vLLM (images: {seen}); "
            "03 probes the candidates")


def installed_source(ctx: Context, probe: RegistryProbe | None) -> str:
    """Where the installed image probed came from, for the notebooks to say."""
    if probe is None:
        return "none"
    return "runtime.installed_image" if ctx.images.installed() else \
        "not in params: the image of the old deployment's running containers that 01 found, holding vLLM"


def _first_line(text: str) -> str:
    return text.strip().splitlines()[0][:400] if text.strip() else ""
