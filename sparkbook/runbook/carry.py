"""A new run that starts past 01 (`--from NN`, `--only NN`): the hand-offs its notebooks read and no notebook of it
writes first, each from the cluster's newest run that recorded it, as `sparkbook up` starts from its deployment's.
A hand-off a notebook cannot run without (its stage's `needs`) and no run recorded refuses the run before anything
is touched; one it falls back without is only said to be missing."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from ..core.values import handoff, modelinfo, state  # noqa: F401  (handoff, modelinfo: where the Handoff classes live)
from ..core.values.errors import SparkbookError
from ..core.values.rundir import is_run_dir
from ..core.values.stagelist import Stage, stage_of
from ..core.values.state import Handoff

H = TypeVar("H", bound=Handoff)


class NothingToCarry(SparkbookError):
    """A notebook of the new run needs a hand-off no run of the cluster recorded."""


@dataclass(frozen=True)
class Carried:
    """What the new run starts from: each hand-off with the run it came from, and those no run recorded."""

    values: list[tuple[Handoff, str]]  # (the hand-off, the run id it came from)
    missing: list[str]  # hand-offs the notebooks fall back without

    def lines(self) -> list[str]:
        return [f"{type(v).__name__} ({v.key}) from run {run}" for v, run in self.values] + \
            [f"{name}: no run recorded it; its notebook goes on without it" for name in self.missing]


def kinds() -> dict[str, type[Handoff]]:
    """Every hand-off class by name (the stage list names them; core.values.handoff and core.values.modelinfo define
    them)."""
    found: dict[str, type[Handoff]] = {}
    todo = list(Handoff.__subclasses__())
    while todo:
        kind = todo.pop()
        found[kind.__name__] = kind
        todo += kind.__subclasses__()
    return found


def wanted(notebooks: list[str]) -> list[tuple[str, Stage]]:
    """The hand-offs the notebooks read that none of them writes before, each with the first stage reading it."""
    written: set[str] = set()
    out: list[tuple[str, Stage]] = []
    for name in notebooks:
        stage = stage_of(name)
        if stage is None:
            continue
        out += [(r, stage) for r in stage.reads if r not in written and r not in {w for w, _ in out}]
        written |= set(stage.writes)
    return out


def carry(cluster_dir: Path, notebooks: list[str]) -> Carried:
    """Each wanted hand-off from the newest run under `cluster_dir` that recorded it; NothingToCarry naming the
    first one a notebook needs and no run has."""
    by_name, values, missing = kinds(), [], []
    for name, stage in wanted(notebooks):
        found = newest(cluster_dir, by_name[name])
        if found is not None:
            values.append(found)
        elif name in stage.needs:
            kind = by_name[name]
            raise NothingToCarry(f"{stage.name} needs {name} ({kind.key!r}), and no run under {cluster_dir} "
                                 "recorded it", stage=stage.name,
                                 remediation=f"run from {kind.notebook} (it writes {kind.key!r}) or from the start")
        else:
            missing.append(name)
    return Carried(values, missing)


def newest(cluster_dir: Path, kind: type[H]) -> tuple[H, str] | None:
    """The hand-off of this kind from the newest run under `cluster_dir` that recorded it, with that run's id."""
    runs = sorted((d for d in cluster_dir.iterdir() if is_run_dir(d)), reverse=True) if cluster_dir.is_dir() else []
    return next(((v, d.name) for d in runs if (v := _recorded(d, kind)) is not None), None)


def _recorded(run_dir: Path, kind: type[H]) -> H | None:
    try:
        return state.load(run_dir, kind)
    except state.StateError:  # MissingState, or another schema version: not a run to start from
        return None
