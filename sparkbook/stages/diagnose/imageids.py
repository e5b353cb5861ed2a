"""02's check of the image names against the cluster's last run: a tag that names another image than then.

    moved_tags(ctx, before) -> list[Finding]   one warning per params' image whose ID on the head is not the one the
                                               last run recorded under its name

Why: a moving tag (`…:latest`) is re-pushed between runs; 03 would probe and choose the new image under the old name,
and the run's record would say the same tag as last time. 02 says it first, from the last run's sealed record
(records.earlier.images_before: 03's ImageChoice in its state.json), with the IDs on both sides, so the change is a
finding before anything is chosen; a digest pin (`name@sha256:...`) cannot move.
"""
from __future__ import annotations

from collections.abc import Mapping

from ...core.cluster.context import Context
from ...core.values.evidence import Finding, ProbedBefore


def named(ctx: Context) -> list[str]:
    """The image refs params name (the candidates, then the installed image), once each."""
    installed = ctx.images.installed()
    return list(dict.fromkeys([*ctx.images.candidates(), *([installed] if installed else [])]))


def moved_tags(ctx: Context, before: Mapping[str, ProbedBefore]) -> list[Finding]:
    """A warning for each ref params name that the last run recorded under another image ID than the head holds
    now (a ref the head lacks, or the last run did not record, says nothing)."""
    findings = []
    for ref in named(ctx):
        then = before.get(ref)
        held = ctx.images.image(ctx.head, ref) if then is not None and then.image_id else None
        if then is not None and then.image_id and held is not None and held[0] != then.image_id:
            findings.append(Finding("warning", "image", moved(ref, then, held[0])))
    return findings


def moved(ref: str, then: ProbedBefore, now: str) -> str:
    return (f"`{ref}` now points at another image: `{_short(then.image_id)}` -> `{_short(now)}` (run {then.run} "
            "recorded the first); 03 probes the image it names now: pin it as name@sha256:... to keep one image")


def _short(image_id: str | None) -> str:
    return (image_id or "none")[:19]
