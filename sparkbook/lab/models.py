"""The lab's tiny models, made offline inside the new vLLM image on the builder daemon.

``LAB_HOME/models/hyv4-tiny`` (HYV4ForCausalLM: only vllm 0.32 serves it) and
``LAB_HOME/models/qwen3-tiny`` (Qwen3ForCausalLM: what the old deployment serves). A model dir counts
as complete when its marker file (written last) names the current recipe.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from pathlib import Path

from sparkbook.lab.builder import LAB_HOME, Progress, default_progress, docker_cmd, stream
from sparkbook.lab.images import NEW, RECIPES_DIR, ensure_images

MODELS_DIR = LAB_HOME / "models"
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
