"""What a probe of a candidate image found, as a value the hand-offs can hold without loading SSH or Docker."""
from __future__ import annotations

from dataclasses import dataclass


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
    image_id: str | None = None  # where 02 probed the installed image: its ID on the head (None: not read)
    repo_digests: tuple[str, ...] = ()  # ... and its repo digests (name@sha256:...)
