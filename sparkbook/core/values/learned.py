"""What the runbook learned about an image, kept by the image's ID so that a later run reads it back instead of
asking the image again: 03's probes of a candidate (for one model), 05's argv check of the image's parser.

    memo_key(kind, image_id, parts) -> str     the key: what the answer depends on, hashed
    Learned                                    an answer to keep (a stage returns it; the session writes it)
    Recalled                                   an answer read back, with the run that learned it

Why: on an H100 03 took 51.8 s and 05's argv check 22.9 s of a redeploy whose image had not changed; the answers
depend only on the image's bytes (its ID), the model's identity and the probe's own code, so a run where none of
them changed learns nothing new by asking again. The store itself: core.cluster.imagememo.
"""
from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")
T_co = TypeVar("T_co", covariant=True)

PROBES = "image-probes"  # 03: a candidate's facts, registry and inspection probes (and its GPU operation)
SERVE_ARGS = "serve-args"  # 05: the image's `vllm serve` parser asked about the plan's argvs


def memo_key(kind: str, image_id: str, parts: Mapping[str, str]) -> str:
    """sha256 over the kind, the image ID and every other input of the answer (`parts`: the model's identity, the
    probe's source, ...): any change of one of them is another key, so a miss."""
    text = json.dumps({"kind": kind, "image_id": image_id, "parts": dict(parts)}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()


@dataclass(frozen=True)
class Learned(Generic[T_co]):
    """An answer a stage got from an image, to keep under `key` (memo_key of kind, image ID and parts)."""

    kind: str
    image_id: str
    key: str
    value: T_co


@dataclass(frozen=True)
class Recalled(Generic[T]):
    """An answer read back from the store: the value as it was learned, by which run and when."""

    kind: str
    image_id: str
    value: T
    run: str  # the run id (or dir name) that learned it
    at: str  # ISO time it was kept

    def line(self, what: str) -> str:
        return (f"{what}: probe results from an earlier run ({self.at[:16].replace('T', ' ')} UTC, run {self.run}, "
                f"image {self.image_id[:19]}) — not run again")
