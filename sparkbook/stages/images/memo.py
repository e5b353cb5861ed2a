"""03's probes kept by image ID and model (core.cluster.imagememo), read back instead of run again.

    evaluate(ctx, ref, target, caps, machines) -> Evaluated   the candidate, from the store where it holds this
                                                              image and model, else probed (and kept when settled)
    recall(ctx, ref, target) -> Recalled[Probes] | None       the kept answers alone (the preview's first facts)

Why: the probes (a container each, the inspection importing vLLM) are most of 03's time (109 s of a 285-s lab run,
51.8 s on an H100), and their answers depend only on the image's bytes, the model's architecture and type as 03
tests them, whether the head gives the probes GPUs and the probes' own code: all of them are in the key, so a change
of any is a miss. The verdict is judged again every run from the answers, by this run's params and nodes, so 03's
candidates and decision are the same values whether the answers were kept or asked.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass

from ...core.cluster import imagememo, probes
from ...core.cluster.context import Context
from ...core.values.learned import PROBES, Learned, Recalled, memo_key
from . import choice
from .choice import Candidate, ModelTarget, Probes

PROBE_SOURCES = ("facts", "registry", "inspect_model", "gpu_op")


@dataclass(frozen=True)
class Evaluated:
    """One candidate and where its answers came from: kept by an earlier run (`recalled`), or asked now (`learned`:
    to keep, where they are settled); `refused`: why a kept file was not trusted (the image was asked again)."""

    candidate: Candidate
    recalled: Recalled[Probes] | None
    learned: Learned[Probes] | None
    refused: str | None

    def line(self) -> str | None:
        """What the record says of a candidate whose answers were not asked now (None: they were)."""
        return self.recalled.line(self.candidate.image) if self.recalled else None


def parts(ctx: Context, ref: str, target: ModelTarget) -> dict[str, str]:
    """Everything besides the image ID that the probes' answers depend on."""
    code = hashlib.sha256("".join(probes.source(name) for name in PROBE_SOURCES).encode()).hexdigest()[:16]
    return {"ref": ref, "architecture": target.architecture, "model_type": target.model_type,
            "model_dir": target.directory, "gpus": str(bool(ctx.params.node(ctx.head.name).gpus)), "probes": code}


def _image_id(ctx: Context, ref: str) -> str | None:
    held = ctx.images.image(ctx.head, ref)
    return held[0] if held else None


def recall(ctx: Context, ref: str, target: ModelTarget) -> tuple[Recalled[Probes] | None, str | None]:
    """The probes' answers an earlier run kept for `ref`'s image ID on the head and this model, or why a kept file
    was refused; (None, None) where none is kept."""
    return imagememo.recall(ctx.run_dir, PROBES, _image_id(ctx, ref), parts(ctx, ref, target), Probes)


def evaluate(ctx: Context, ref: str, target: ModelTarget, capabilities: dict[str, list[str]],
             machines: dict[str, str]) -> Evaluated:
    """choice.evaluate with the kept answers where the store holds them; the answers asked now, to keep where they
    are settled (choice.Probes.settled) and the image has an ID."""
    recalled, refused = recall(ctx, ref, target)
    known = recalled.value if recalled else None
    candidate = choice.evaluate(ctx, ref, target, capabilities, machines, known)
    probed = Probes.of(candidate)
    image_id = candidate.facts.image_id
    asked = known is None or probed.gpu_op != known.gpu_op  # a GPU operation run now, on another node
    keep = image_id is not None and asked and probed.settled
    learned = Learned(PROBES, image_id, memo_key(PROBES, image_id, parts(ctx, ref, target)), probed) \
        if keep and image_id is not None else None
    return Evaluated(candidate, recalled, learned, refused)
