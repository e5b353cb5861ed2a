"""The A/B's arms (benchmark.ab), named by what they serve, for the driver (which notebooks run as which arm), the
session (which params each arm opens), 05's and 06's open cells, and 06 (which arm decides).

"baseline" runs 05 and 06 first on the params' plan changed by one thing (without serve.speculative for
`ab: speculative`; serve.layout tp for `ab: layout`; for `ab: image` the same plan in the image that serves now, so
04 runs in the arms too), the second arm is the params' own plan, named by what it serves ("speculative", "replicas",
"candidate": 03's choice of image): its 05 replaces the baseline's server and its 06 decides. "kept" is 05 (and for
the image, 04) serving the baseline again where the A/B keeps it.
"""
from __future__ import annotations

from typing import Literal, get_args

AbKind = Literal["speculative", "layout", "image"]
AbArm = Literal["baseline", "speculative", "replicas", "candidate", "kept"]
AB_ARMS: tuple[AbArm, ...] = get_args(AbArm)
BASELINE: AbArm = "baseline"
KEPT: AbArm = "kept"

_SECOND: dict[AbKind, AbArm] = {"speculative": "speculative", "layout": "replicas", "image": "candidate"}
# what the baseline (and kept) arm serves, and what the second arm serves, in words
_SERVES: dict[AbKind, tuple[str, str]] = {
    "speculative": ("without serve.speculative", "with serve.speculative"),
    "layout": ("serve.layout tp: one model split across the nodes",
               "serve.layout replicas: a whole copy on each node behind the router"),
    "image": ("the image that serves now (on a first run, runtime.installed_image)", "03's choice of image")}


def second_arm(ab: AbKind) -> AbArm:
    """The arm that serves the params' own plan and decides the A/B."""
    return _SECOND[ab]


def replaces_own_arm(ab_arm: str | None) -> bool:
    """Whether this arm of an A/B replaces what its arm before left serving (the A/B's own doing: no
    confirm_replace needed; that guards the servers other runs left): the second arm and the kept one."""
    return ab_arm is not None and ab_arm != BASELINE


def changes_image(ab: AbKind | None) -> bool:
    """Whether the A/B's arms serve different images, so 04 (the nodes' containers) runs in every arm too."""
    return ab == "image"


def arms_of(ab: AbKind) -> tuple[AbArm, ...]:
    return BASELINE, _SECOND[ab], KEPT


def serves(ab: AbKind, arm: str) -> str:
    """What an arm of the A/B `ab` serves, in words (the kept arm serves the baseline)."""
    return _SERVES[ab][1 if arm == _SECOND[ab] else 0]


def note(ab: AbKind | None, arm: str | None) -> str:
    """What an arm of this run's A/B serves, as 05's and 06's open cells show it."""
    if ab is None or arm is None:
        return "none (no A/B in this run)"
    return f"{arm}: " + ("the params' own plan, " if arm == _SECOND[ab] else "") + serves(ab, arm)
