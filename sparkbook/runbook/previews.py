"""`sparkbook plan PARAMS`: every stage's preview in the stage list's order, before anything is touched. Only
read-only probes run (each stage's `preview`); each preview is handed what the ones before it would hand off
(`assumed`), so 04's `docker run` and 05's `vllm serve` are shown before any run too, for the image the cluster's last
good deployment serves, else the one its newest run's 03 chose, else the candidate 03 would try first (its facts
and platform asked of a throwaway container of it, as 03's probes do). What a preview cannot tell before a run acts
is shown as unknown; only a preview that fails (a node it cannot reach) fails the plan. Env by name only."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..core.cluster.context import Context
from ..core.values.errors import SparkbookError
from ..core.values.evidence import NotKnownYet, Shown
from ..core.values.handoff import ImageChoice
from ..core.values.params import Params
from ..core.values.stagelist import IMAGES, STAGES, Stage
from ..core.values.state import MissingState
from .carry import newest
from .frontdoors import FRONT_DOORS
from .operate import NothingDeployed, last_good


@dataclass(frozen=True)
class StagePlan:
    """One stage's part of `sparkbook plan`: what its preview shows, else why it is not known before a run acts
    (`unknown`: a hand-off only a run makes, an image not on the head yet) or why its preview failed (`failed`: a
    node it cannot reach, a probe's broken reply)."""

    stage: Stage
    shown: list[Shown]
    unknown: str | None = None  # None: previewed, or failed
    failed: str | None = None  # None: previewed, or not known yet

    @property
    def why(self) -> str | None:
        """Why it shows nothing (not known yet, or failed); None: previewed."""
        return self.unknown or self.failed


def preview(ctx: Context, outputs: Path) -> list[StagePlan]:
    """Each stage's preview in run order; one that cannot be told says why (not known before a run acts, or its
    preview failed), and the stages after it are still previewed on what is known."""
    chosen = shown_for(ctx.params, outputs)
    plans = []
    for stage in STAGES:
        try:
            seen = FRONT_DOORS[stage].preview(ctx)
        except (MissingState, NotKnownYet) as exc:
            plans.append(StagePlan(stage, [], unknown=f"not known before a run acts: {exc}"[:400]))
            continue
        except (SparkbookError, OSError) as exc:
            plans.append(StagePlan(stage, [], failed=f"its preview failed: {exc}"[:400]))
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


def showed_what_it_could(plans: list[StagePlan]) -> bool:
    """Whether no stage's preview failed (`sparkbook plan` exits 0): what is not known before a run acts is shown
    as unknown and fails nothing."""
    return all(p.failed is None for p in plans)


def shown_for(params: Params, outputs: Path) -> tuple[ImageChoice, str] | None:
    """The image the stages after 03 are shown for, with whose it is: the last good deployment's, else the one the
    newest run's 03 chose (`run --to 04` deploys nothing); None: 03's first candidate."""
    try:
        return last_good(params, outputs).image, "the last good deployment serves"
    except NothingDeployed:
        found = newest(outputs / params.cluster, ImageChoice)
    return (found[0], f"run {found[1]}'s {IMAGES.id} chose") if found else None
