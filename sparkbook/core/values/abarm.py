"""The A/B's arms (benchmark.ab), named by what they serve, for the driver (which notebooks run as which arm), the
session (which params each arm opens), 05's and 06's open cells, and 06 (which arm decides).

"baseline" runs 05 and 06 first on the params' plan changed by one thing (without serve.speculative for
`ab: speculative`; serve.layout tp for `ab: layout`), the second arm is the params' own plan, named by what it serves
("speculative", "replicas"): its 05 replaces the baseline's server and its 06 decides. "kept" is 05 serving the
baseline again where the A/B keeps it.
"""
from __future__ import annotations

from typing import Literal, get_args

AbKind = Literal["speculative", "layout"]
AbArm = Literal["baseline", "speculative", "replicas", "kept"]
AB_ARMS: tuple[AbArm, ...] = get_args(AbArm)
BASELINE: AbArm = "baseline"
KEPT: AbArm = "kept"

_SECOND: dict[AbKind, AbArm] = {"speculative": "speculative", "layout": "replicas"}
# what the baseline (and kept) arm serves, and what the second arm serves, in words
_SERVES: dict[AbKind, tuple[str, str]] = {
    "speculative": ("without serve.speculative", "with serve.speculative"),
    "layout": ("serve.layout tp: one model split across the nodes",
               "serve.layout replicas: a whole copy on each node behind the router")}


def second_arm(ab: AbKind) -> AbArm:
    """The arm that serves the params' own plan and decides the A/B."""
    return _SECOND[ab]


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
