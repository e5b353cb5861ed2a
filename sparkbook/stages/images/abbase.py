"""03's baseline for `benchmark.ab: image`: the image the A/B compares its choice with.

    baseline(ctx, chosen, serving, installed, candidates, probe) -> Baseline   the image and why, or why none

The baseline is what serves now: the image of the cluster's deployment (the newest run whose 05 ended ok, sealed by
this controller; the session reads it), else on a first run runtime.installed_image. It must load the model as 03
probes every candidate (its probes kept by image ID are read back, images.memo), its tag must still name the image
that served, and it must differ from 03's choice by image ID: two tags of one image would measure the same bytes
twice. Where there is no such image, the A/B does not run and 03's choice serves as without one, the page saying why.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from ...core.cluster.context import Context
from ...core.values.evidence import Alternative, Decision
from ...core.values.handoff import AbBaseline, ImageChoice
from ...core.values.learned import Learned
from . import distribute
from .choice import Candidate, Probes, image_state
from .memo import Evaluated

QUESTION = "Which image does the A/B of images compare 03's choice with?"


@dataclass(frozen=True)
class Baseline:
    """The hand-off, the decision that records it, and what 03 learned probing an image no candidate named."""

    handoff: AbBaseline
    decision: Decision
    learned: list[Learned[Probes]] = field(default_factory=list)


def _none(reason: str, chosen: ImageChoice) -> Baseline:
    why = f"no A/B of images: {reason}; {chosen.ref} serves as without benchmark.ab"
    return Baseline(AbBaseline(image=None, reason=why),
                    Decision(QUESTION, "none", why, [],
                             ["03's decision above"], key="ab_baseline"))


def baseline(ctx: Context, chosen: ImageChoice, serving: ImageChoice | None, installed: str | None,
             candidates: list[Candidate], probe: Callable[[str], Evaluated]) -> Baseline:
    """The A/B's baseline image: `serving` (the deployment's, as its run recorded it) else `installed`; its probes
    from `candidates` where 03 probed it already, else `probe`d now (images.memo); put on every node as 03's choice
    is."""
    ref, source = (serving.ref, "serves now") if serving else (installed, "runtime.installed_image (a first run)") \
        if installed else (None, "")
    if ref is None:
        return _none("nothing serves on this cluster yet and there is no runtime.installed_image", chosen)
    found = next((c for c in candidates if c.image == ref), None)
    learned: list[Learned[Probes]] = []
    if found is None:
        evaluated = probe(ref)
        found, learned = evaluated.candidate, [evaluated.learned] if evaluated.learned else []
    image_id = found.facts.image_id
    if serving is not None and serving.id is not None and image_id != serving.id:
        return _none(f"{ref} now names {str(image_id)[:19]}, not the {serving.id[:19]} that served (pin it as "
                     "name@sha256:...)", chosen)
    if not found.verdict.usable:
        return _none(f"the image that {source}, {ref}, does not load the model ({found.verdict.summary})", chosen)
    if image_id is not None and image_id == chosen.id:
        return _none(f"03's choice {chosen.ref} is the image that {source} ({image_id[:19]}): nothing to compare",
                     chosen)
    copied = distribute.distribute(ctx, ref)
    if not copied.verified:
        return _none(f"{ref} could not be put on every node: {copied.message}", chosen)
    why = (f"{ref} {source} and loads the model (vLLM {found.facts.vllm_version}, {str(image_id)[:19]}): the "
           f"baseline arm serves the same plan in it, then 03's choice {chosen.ref} (vLLM {chosen.vllm_version}) "
           "is measured against it")
    image = image_state([found], ref, copied.ids)
    return Baseline(AbBaseline(image=image, reason=why),
                    Decision(QUESTION, ref, why,
                             [Alternative(chosen.ref, "03's choice: the A/B's second arm")],
                             ["candidates table above (events.jsonl: image_probe)", copied.message],
                             key="ab_baseline"),
                    learned)
