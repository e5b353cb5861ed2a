"""The lab's tiny models, made offline inside the new vLLM image on the builder daemon.

``LAB_HOME/models/hyv4-tiny`` (HYV4ForCausalLM: only vllm 0.32 serves it) and
``LAB_HOME/models/qwen3-tiny`` (Qwen3ForCausalLM: what the old deployment serves). A model dir counts
as complete when its marker file (written last) names the current recipe.

``LAB_HOME/hf/hub`` holds hyv4-tiny again as the Hugging Face hub cache lays a downloaded model out
(``models--sparkbook-lab--hyv4-tiny/{blobs,snapshots/<rev>,refs/main}``), for params/lab-hf.yaml: the
model by ``hf_id`` out of a cache that is not root's.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from pathlib import Path

from sparkbook.lab.builder import LAB_HOME, Progress, default_progress, docker_cmd, stream
from sparkbook.lab.imagebuild import NEW, RECIPES_DIR, ensure_images

MODELS_DIR = LAB_HOME / "models"
HF_HUB = LAB_HOME / "hf" / "hub"
HF_REPO = "sparkbook-lab/hyv4-tiny"
LFS_SUFFIXES = (".safetensors", ".bin", ".gguf")
MODEL_NAMES = ("hyv4-tiny", "qwen3-tiny")
MARKER = ".sparkbook-complete"
SCRIPT = RECIPES_DIR / "make_models.py"


def recipe() -> str:
    """A short hash of the generator script: a changed script makes the models again."""
    return hashlib.sha256(SCRIPT.read_bytes()).hexdigest()[:16]


def is_complete(path: Path) -> bool:
    """Whether ``path`` holds a finished model of the current recipe (every file its marker lists)."""
    try:
        marker = json.loads((path / MARKER).read_text())
    except (OSError, ValueError):
        return False
    return marker.get("recipe") == recipe() and all((path / f).is_file() for f in marker.get("files", []))


def generate(names: list[str], emit: Progress) -> None:
    """Run make_models.py in the new image, then move the wanted models into place, marker last."""
    image = ensure_images(emit)[NEW]
    scratch = MODELS_DIR / f".tmp-{os.getpid()}"
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir(parents=True)
    try:
        stream(docker_cmd("run", "--rm", "--name", f"sparkbook-lab-make-models-{os.getpid()}", "--network", "none",
                          "-e", "HF_HUB_OFFLINE=1", "-v", f"{SCRIPT}:/make_models.py:ro", "-v", f"{scratch}:/out",
                          image, "python", "/make_models.py", "/out"), emit)
        for name in names:
            final = MODELS_DIR / name
            shutil.rmtree(final, ignore_errors=True)
            (scratch / name).rename(final)
            files = sorted(p.name for p in final.iterdir())
            (final / MARKER).write_text(json.dumps({"recipe": recipe(), "image": image, "files": files,
                                                    "made": time.strftime("%Y-%m-%dT%H:%M:%S%z")}))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def ensure_models(progress: Progress | None = None) -> dict[str, Path]:
    """Make the lab models that are missing or incomplete; return name → host dir."""
    emit = default_progress(progress)
    missing = [n for n in MODEL_NAMES if not is_complete(MODELS_DIR / n)]
    if missing:
        emit(f"[models] making {' '.join(missing)} in {MODELS_DIR}")
        t0 = time.monotonic()
        generate(missing, emit)
        emit(f"[models] done in {time.monotonic() - t0:.0f}s")
    else:
        emit(f"[models] cached in {MODELS_DIR}")
    return {n: MODELS_DIR / n for n in MODEL_NAMES}


def blob_name(path: Path) -> str:
    """The name the hub cache gives a file's blob: its sha256 for an LFS file (the weights), else git's blob
    hash (`git hash-object`), as huggingface_hub names them."""
    if path.suffix in LFS_SUFFIXES:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    data = path.read_bytes()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def hf_cache(src: Path, repo_id: str, hub: Path) -> Path:
    """Lay the model dir `src` out in the hub cache `hub` as a download of `repo_id` would: blobs by hash,
    snapshots/<rev>/ with relative symlinks to them, refs/main naming rev. Returns the snapshot dir."""
    files = sorted(p for p in src.iterdir() if p.is_file() and p.name != MARKER)
    blobs = {p.name: blob_name(p) for p in files}
    rev = hashlib.sha1(json.dumps(blobs, sort_keys=True).encode()).hexdigest()
    repo = hub / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / rev
    if (repo / "refs" / "main").is_file() and (repo / "refs" / "main").read_text() == rev:
        return snapshot
    tmp = hub / f".tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    for sub in ("blobs", f"snapshots/{rev}", "refs"):
        (tmp / sub).mkdir(parents=True)
    for p in files:
        shutil.copy2(p, tmp / "blobs" / blobs[p.name])
        (tmp / "snapshots" / rev / p.name).symlink_to(f"../../blobs/{blobs[p.name]}")
    (tmp / "refs" / "main").write_text(rev)  # written last: a complete layout
    shutil.rmtree(repo, ignore_errors=True)
    tmp.rename(repo)
    return snapshot


def ensure_hf_cache(models: dict[str, Path], progress: Progress | None = None) -> Path:
    """The lab's hub cache (HF_HUB) holding hyv4-tiny as HF_REPO; returns the hub dir."""
    snapshot = hf_cache(models["hyv4-tiny"], HF_REPO, HF_HUB)
    default_progress(progress)(f"[models] {HF_REPO} in the hub cache: {snapshot}")
    return HF_HUB
