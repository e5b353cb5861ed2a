"""`sparkbook plan PARAMS`: every stage's preview in the stage list's order, before anything is touched. Only
read-only probes run (each stage's `preview`); each preview is handed what the ones before it would hand off
(`assumed`), so 04's `docker run` and 05's `vllm serve` are shown before any run too, for the image the cluster's last
good deployment serves, else the one its newest run's 03 chose, else the candidate 03 would try first.
Env by name only."""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, cast

from ..core.cluster.context import Context
from ..core.values.errors import SparkbookError
from ..core.values.evidence import Preview, Shown
from ..core.values.handoff import ImageChoice
from ..core.values.params import Params
from ..core.values.stagelist import IMAGES, STAGES, Stage
from .carry import newest
from .operate import NothingDeployed, last_good


class FrontDoor(Protocol):
    def preview(self, ctx: Context) -> Preview: ...


@dataclass(frozen=True)
class StagePlan:
    """One stage's part of `sparkbook plan`: what its preview shows, or why it cannot be told without acting."""

    stage: Stage
    shown: list[Shown]
    unknown: str | None = None  # None: previewed


def preview(ctx: Context, outputs: Path) -> list[StagePlan]:
    """Each stage's preview in run order; one that cannot be told (a node down, a hand-off only a run makes) says
    why, and the stages after it are still previewed on what is known."""
    chosen = shown_for(ctx.params, outputs)
    plans = []
    for stage in STAGES:
        front = cast(FrontDoor, importlib.import_module(f"sparkbook.stages.{stage.package}"))
        try:
            seen = front.preview(ctx)
        except (SparkbookError, OSError) as exc:
            plans.append(StagePlan(stage, [], f"cannot tell without acting: {exc}"[:400]))
            continue
        shown = seen.shown()
        ctx = ctx.with_handoffs(*seen.assumed)
        if stage is IMAGES and chosen is not None:  # what a redeploy keeps unless 03's probes choose another
            image, whose = chosen
            ctx = ctx.with_handoffs(image)
            shown.append(Shown("the stages below are shown for", f"{image.ref}, the image {whose} "
                               f"({IMAGES.id} may choose another by probing the candidates)"))
        plans.append(StagePlan(stage, shown))
    return plans


def shown_for(params: Params, outputs: Path) -> tuple[ImageChoice, str] | None:
    """The image the stages after 03 are shown for, with whose it is: the last good deployment's, else the one the
    newest run's 03 chose (`run --to 04` deploys nothing); None: 03's first candidate."""
    try:
        return last_good(params, outputs).image, "the last good deployment serves"
    except NothingDeployed:
        found = newest(outputs / params.cluster, ImageChoice)
    return (found[0], f"run {found[1]}'s {IMAGES.id} chose") if found else None
