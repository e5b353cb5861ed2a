"""The lab's Docker images, built on the builder daemon without any registry from the build contexts in
images/ beside this module.

base (debootstrap + ``docker import``) → torch (/opt/venv + the local CPU torch wheel) → one image per
vLLM version → the grafted image (old vLLM + the new one's hy_v4 package, multi-stage COPY), the new one
with a planted slowdown (the image A/B's worse newer image: one small layer, a vLLM plugin), and the new
one again with vLLM's official ENTRYPOINT (``vllm serve``: one metadata layer, no new files).
Each image carries a recipe label (a hash of its Dockerfile, inputs and parent image ID): a tag whose
label matches is reused as is, so a warm ``ensure_images`` takes seconds.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from sparkbook.lab.builder import (
    BUILDER_DIR,
    Progress,
    default_progress,
    docker_cmd,
    ensure_builder,
    image_id,
    image_label,
    lab_lock,
    stream,
)

RECIPES_DIR = Path(__file__).parent / "images"
TORCH_WHEEL = Path("/opt/wheels/torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl")
HOST_CA_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")
DEBIAN_MIRROR = "http://deb.debian.org/debian"
BASE_PACKAGES = ("python3", "python3-venv", "ca-certificates", "libnuma1", "g++", "libc6-dev", "python3-dev")
RAY_VERSION = "2.60.0"
OLD_VLLM, NEW_VLLM = "0.28.0", "0.32.0"

BASE = "sparkbook-lab/base:bookworm"
TORCH = "sparkbook-lab/torch:2.13.0-cpu"
OLD = f"sparkbook-lab/vllm-cpu:{OLD_VLLM}"
NEW = f"sparkbook-lab/vllm-cpu:{NEW_VLLM}"
GRAFT = f"sparkbook-lab/vllm-cpu:{OLD_VLLM}-hyv4-graft"
SLOW = f"{NEW}-slow"   # NEW with a planted slowdown: each engine step sleeps as long again (images/slow_step/)
OPENAI = f"sparkbook-lab/vllm-openai-cpu:{NEW_VLLM}"   # NEW with ENTRYPOINT ["vllm", "serve"]
NO_RAY = f"{OPENAI}-noray"   # OPENAI without Ray: the stock image's shape since vLLM 0.19 (issue 45)
LAB_IMAGES = (BASE, OLD, NEW, GRAFT, OPENAI, NO_RAY)
# Built with LAB_IMAGES (seconds: one small layer) but not among them, so `lab up` neither loads them onto the head
# nor counts them missing there: the test that needs one loads it onto its node, load_images(node.docker_host, [SLOW]).
# That load costs more than the layer: `docker save` streams every layer (3.2 GiB), ~34 s onto a daemon holding NEW.
ON_DEMAND_IMAGES = (SLOW,)
SLOW_STEP_PLUGIN = RECIPES_DIR / "slow_step"

LABEL = "org.sparkbook.lab"
RECIPE_LABEL = f"{LABEL}.recipe"
GIB = 1 << 30


@dataclass(frozen=True)
class ImageSpec:
    """How one lab image is made: a Dockerfile (or None for the debootstrap base) and its inputs."""

    tag: str
    role: str
    dockerfile: str | None = None
    parents: dict[str, str] = field(default_factory=dict)   # build-arg name -> parent tag
    args: dict[str, str] = field(default_factory=dict)
    files: tuple[Path, ...] = ()
    vllm: str | None = None
    extra_labels: dict[str, str] = field(default_factory=dict)
    min_free_gib: float = 3.0


def image_specs() -> list[ImageSpec]:
    """All lab images in build order (parents first)."""
    vllm = [ImageSpec(tag, role, "Dockerfile.vllm", {"BASE": TORCH},
                      {"VLLM_VERSION": ver, "RAY_VERSION": RAY_VERSION}, (RECIPES_DIR / "vllm_alias.py",),
                      vllm=ver, min_free_gib=8.0)
            for tag, role, ver in ((OLD, "old", OLD_VLLM), (NEW, "new", NEW_VLLM))]
    return [
        ImageSpec(BASE, "base", min_free_gib=2.0),
        ImageSpec(TORCH, "torch", "Dockerfile.torch", {"BASE": BASE}, files=(HOST_CA_BUNDLE, TORCH_WHEEL),
                  min_free_gib=4.0),
        *vllm,
        ImageSpec(GRAFT, "grafted", "Dockerfile.graft", {"OLD": OLD, "NEW": NEW}, vllm=OLD_VLLM,
                  extra_labels={f"{LABEL}.grafted": f"HYV4ForCausalLM from vllm {NEW_VLLM}"}),
        ImageSpec(SLOW, "slow", "Dockerfile.slow", {"BASE": NEW},
                  files=(SLOW_STEP_PLUGIN / "pyproject.toml", SLOW_STEP_PLUGIN / "sparkbook_slow_step.py"),
                  vllm=NEW_VLLM, min_free_gib=1.0,
                  extra_labels={f"{LABEL}.planted": "slowdown: each EngineCore step sleeps as long again as it "
                                                    "took (vLLM general plugin sparkbook_slow_step); greedy "
                                                    "tokens unchanged"}),
        ImageSpec(OPENAI, "entrypoint", "Dockerfile.entrypoint", {"BASE": NEW}, vllm=NEW_VLLM, min_free_gib=1.0),
        ImageSpec(NO_RAY, "no-ray", "Dockerfile.noray", {"BASE": OPENAI}, vllm=NEW_VLLM, min_free_gib=1.0),
    ]


def labels(spec: ImageSpec, recipe: str) -> dict[str, str]:
    """The labels an image gets: role, vLLM version (if any), recipe hash."""
    out = {f"{LABEL}.role": spec.role, RECIPE_LABEL: recipe, **spec.extra_labels}
    if spec.vllm:
        out[f"{LABEL}.vllm"] = spec.vllm
    return out


def recipe_hash(spec: ImageSpec, parent_ids: dict[str, str]) -> str:
    """A short hash of everything that determines the image's content."""
    text = (RECIPES_DIR / spec.dockerfile).read_text() if spec.dockerfile else " ".join(BASE_PACKAGES)
    # the recipes' own files by content, the large outside inputs (torch wheel, CA bundle) by size
    files = {p.name: (p.read_text() if p.suffix == ".py" or RECIPES_DIR in p.parents else p.stat().st_size)
             for p in spec.files}
    blob = json.dumps([spec.tag, text, spec.args, spec.extra_labels, files, parent_ids], sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def check_inputs(spec: ImageSpec) -> None:
    """Fail with a clear message when an input file of ``spec`` is missing."""
    for path in spec.files:
        if not path.is_file():
            raise FileNotFoundError(f"{spec.tag} needs {path}, which is missing"
                                    + (" (the local CPU torch wheel)" if path == TORCH_WHEEL else ""))


def check_disk(spec: ImageSpec) -> None:
    """Refuse to build when the builder's disk has less free space than the image needs."""
    BUILDER_DIR.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(BUILDER_DIR).free / GIB
    if free < spec.min_free_gib:
        raise OSError(f"building {spec.tag} needs {spec.min_free_gib:.0f} GiB free under {BUILDER_DIR}; "
                      f"{free:.1f} GiB left")


def build_base(spec: ImageSpec, lab_labels: dict[str, str], emit: Progress) -> None:
    """debootstrap a minbase bookworm and ``docker import`` it as ``spec.tag``."""
    rootfs = BUILDER_DIR / "rootfs-bookworm"
    shutil.rmtree(rootfs, ignore_errors=True)
    try:
        stream(["debootstrap", "--variant=minbase", f"--include={','.join(BASE_PACKAGES)}", "bookworm",
                str(rootfs), DEBIAN_MIRROR], emit)
        for cache in ("var/cache/apt/archives", "var/lib/apt/lists"):
            for item in (rootfs / cache).glob("*"):
                if item.is_file():
                    item.unlink()
        changes = [f"LABEL {k}={json.dumps(v)}" for k, v in lab_labels.items()]
        changes.append('CMD ["/bin/bash"]')
        tar = subprocess.Popen(["tar", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE)
        try:
            stream(docker_cmd("import", *[a for c in changes for a in ("--change", c)], "-", spec.tag),
                   emit, stdin=tar.stdout)
        finally:
            assert tar.stdout is not None
            tar.stdout.close()
            if tar.wait() != 0:
                raise RuntimeError(f"tar of {rootfs} failed with {tar.returncode}")
    finally:
        shutil.rmtree(rootfs, ignore_errors=True)


def build_layer(spec: ImageSpec, lab_labels: dict[str, str], emit: Progress) -> None:
    """``docker build`` ``spec`` from a fresh context dir (host network, legacy builder, no registry)."""
    assert spec.dockerfile is not None
    ctx = BUILDER_DIR / "ctx" / spec.tag.replace("/", "_").replace(":", "_")
    shutil.rmtree(ctx, ignore_errors=True)
    ctx.mkdir(parents=True)
    try:
        shutil.copy(RECIPES_DIR / spec.dockerfile, ctx / "Dockerfile")
        for path in spec.files:
            try:
                os.link(path, ctx / path.name)
            except OSError:
                shutil.copy(path, ctx / path.name)
        argv = docker_cmd("build", "--network", "host", "--force-rm", "-t", spec.tag)
        for key, value in {**spec.parents, **spec.args}.items():
            argv += ["--build-arg", f"{key}={value}"]
        for key, value in lab_labels.items():
            argv += ["--label", f"{key}={value}"]
        stream([*argv, str(ctx)], emit, env={**os.environ, "DOCKER_BUILDKIT": "0"})
    finally:
        shutil.rmtree(ctx, ignore_errors=True)


def ensure_image(spec: ImageSpec, built: dict[str, str], emit: Progress) -> str:
    """Build ``spec`` unless an image with its recipe label exists; return its image ID."""
    recipe = recipe_hash(spec, {arg: built[tag] for arg, tag in spec.parents.items()})
    old_id = image_id(spec.tag)
    if old_id and image_label(spec.tag, RECIPE_LABEL) == recipe:
        emit(f"[images] {spec.tag}: cached ({old_id[:19]})")
        return old_id
    check_inputs(spec)
    check_disk(spec)
    emit(f"[images] {spec.tag}: building (recipe {recipe})")
    t0 = time.monotonic()
    (build_layer if spec.dockerfile else build_base)(spec, labels(spec, recipe), emit)
    new_id = image_id(spec.tag)
    if new_id is None:
        raise RuntimeError(f"{spec.tag} was built but the builder does not list it")
    emit(f"[images] {spec.tag}: built {new_id[:19]} in {time.monotonic() - t0:.0f}s")
    if old_id and old_id != new_id:   # the replaced image is untagged now; free it if nothing uses it
        subprocess.run(docker_cmd("rmi", old_id), capture_output=True)
    return new_id


def ensure_images(progress: Progress | None = None) -> dict[str, str]:
    """Build the lab images that are missing or stale on the builder; return tag → image ID.

    The tags are LAB_IMAGES (base, old, new, grafted, entrypoint, no-ray); the intermediate torch image and the
    ON_DEMAND_IMAGES (slow) are built too, but left out of the answer (lab up loads what it names onto the head).
    """
    emit = default_progress(progress)
    ensure_builder()
    built: dict[str, str] = {}
    with lab_lock("images"):
        for spec in image_specs():
            built[spec.tag] = ensure_image(spec, built, emit)
    return {tag: built[tag] for tag in LAB_IMAGES}


def load_images(docker_host: str, tags: list[str], progress: Progress | None = None) -> None:
    """Copy ``tags`` from the builder into the daemon at ``docker_host`` (``unix://…`` or ``ssh://…``).

    One ``docker save | docker load`` stream for the tags whose image ID the target lacks (shared
    layers travel once); tags already there with the same ID are skipped.
    """
    emit = default_progress(progress)
    ensure_builder()
    missing = []
    for tag in tags:
        src = image_id(tag)
        if src is None:
            raise LookupError(f"{tag} is not on the builder; run ensure_images() first")
        if image_id(tag, host=docker_host) == src:
            emit(f"[load] {tag}: already in {docker_host}")
        else:
            missing.append(tag)
    if not missing:
        return
    emit(f"[load] {' '.join(missing)} -> {docker_host}")
    t0 = time.monotonic()
    save = subprocess.Popen(docker_cmd("save", *missing), stdout=subprocess.PIPE)
    try:
        stream(docker_cmd("load", host=docker_host), emit, stdin=save.stdout)
    finally:
        assert save.stdout is not None
        save.stdout.close()
        if save.wait() != 0:
            raise RuntimeError(f"docker save {' '.join(missing)} failed with {save.returncode}")
    wrong = [t for t in missing if image_id(t, host=docker_host) != image_id(t)]
    if wrong:
        raise RuntimeError(f"after loading, {docker_host} has different IDs for {wrong}")
    emit(f"[load] done in {time.monotonic() - t0:.0f}s")
