"""Each stage's front door, by a real import: what `sparkbook plan` previews each stage with. The stage list
(core.values.stagelist) stands below the stages and cannot import them; this registry stands above them, so mypy,
the layer test and any import graph see every stage the runbook reaches (papermill registers its engines alike)."""
from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from ..core.cluster.context import Context
from ..core.values.evidence import Preview, StageOutcome
from ..core.values.stagelist import BENCH, CLEANUP, DIAGNOSE, IMAGES, RAYCLUSTER, SERVE, Stage
from ..stages import bench, cleanup, diagnose, images, raycluster, serve


class FrontDoor(Protocol):
    """A stage package's two functions: `preview(ctx)` (read-only) and `run(ctx, preview, ...)` with the stage's
    own keyword options (its notebook's parameters)."""

    def preview(self, ctx: Context) -> Preview: ...

    @property
    def run(self) -> Callable[..., StageOutcome]: ...


FRONT_DOORS: dict[Stage, FrontDoor] = {CLEANUP: cleanup, DIAGNOSE: diagnose, IMAGES: images,
                                       RAYCLUSTER: raycluster, SERVE: serve, BENCH: bench}
