"""The A/B's notebooks (benchmark.ab; the arms: core.values.abarm): 05 and 06 run first as the baseline arm (without
serve.speculative, or serve.layout tp), then as the params' own plan, the second arm ("speculative", "replicas"), on
the same nodes one after the other; 06 of the second arm decides which configuration stays serving, and where that
is the baseline, 05 serves it again as the last notebook.

The baseline and kept arms run under their own output names, `NN-name.ab-<arm>.ipynb`, so their record (decisions,
events, logs) is filed apart, the baseline's sweep points under ab-baseline/; the params' own plan keeps the
notebooks' names. Every notebook of an A/B is told its arm (`ab_arm`): the second and third 05 replace the server the
arm before them left, and the second 06 decides.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from ..core.values.abarm import AB_ARMS, BASELINE, KEPT, AbKind, second_arm
from ..core.values.handoff import AbVerdict
from ..core.values.params import Params
from ..core.values.stagelist import BENCH, SERVE
from ..core.values.state import StateError, load
from .manifest import Manifest


def arm_name(notebook: str, arm: str) -> str:
    return notebook.replace(".ipynb", f".ab-{arm}.ipynb")


def source(name: str) -> str:
    """The notebook an output name runs: `05-serve.ab-baseline.ipynb` runs `05-serve.ipynb`."""
    stem, _, arm = name.removesuffix(".ipynb").partition(".ab-")
    return f"{stem}.ipynb" if arm else name


def known(name: str, names: list[str]) -> bool:
    """Whether `name` is an output name the runbook gives a notebook of `names` (the folder's, from the stage list):
    the notebook itself, or 05's or 06's under an arm; never a path (a manifest's `../../x.ipynb` is none)."""
    if name in names:
        return True
    src, arm = source(name), arm_of(name)
    return src in names and arm in AB_ARMS and (SERVE.owns(src) or BENCH.owns(src)) and name == arm_name(src, arm)


def arm_of(name: str) -> str | None:
    _, _, arm = name.removesuffix(".ipynb").partition(".ab-")
    return arm or None


def parameters(name: str, run: list[str], ab: AbKind | None) -> dict[str, Any]:
    """The `ab_arm` of a notebook of the run whose notebooks are `run` (those it runs or ran, not those it skips), in
    the params' A/B `ab`: its own arm, the second arm (named by what it serves) for 05 and 06 of the params' plan in a
    run that has the baseline arm, none outside an A/B (`sparkbook up`'s 05: no arm before it to replace)."""
    if (arm := arm_of(name)) is not None:
        return {"ab_arm": arm}
    in_ab = (SERVE.owns(name) or BENCH.owns(name)) and any(arm_of(n) == BASELINE for n in run)
    return {"ab_arm": second_arm(ab)} if in_ab and ab is not None else {}


def with_arms(names: list[str], params: Params) -> list[str]:
    """`names` with the baseline arm's 05 and 06 before 05, where the params ask for an A/B and both 05 and 06 are
    among them (an A/B needs a server and a sweep on it; `--only 05` or `--upto 05` serves the params' plan)."""
    serve = [n for n in names if SERVE.owns(n)]
    bench = [n for n in names if BENCH.owns(n)]
    if params.benchmark.ab is None or len(serve) != 1 or len(bench) != 1:
        return names
    at = names.index(serve[0])
    return names[:at] + [arm_name(serve[0], BASELINE), arm_name(bench[0], BASELINE)] + names[at:]


def follow_up(run_dir: Path, name: str, run: list[str], names: list[str], ab: AbKind) -> str | None:
    """After the second arm's 06 (in `run`, the run's notebooks): 05 once more, serving the baseline, where the A/B
    kept it (None otherwise). `names`: the notebooks of the folder; `ab`: the params' benchmark.ab."""
    if not BENCH.owns(name) or parameters(name, run, ab) != {"ab_arm": second_arm(ab)}:
        return None
    if load(run_dir, AbVerdict).kept != BASELINE:
        return None
    return arm_name(next(n for n in names if SERVE.owns(n)), KEPT)


def serving_again(seed: Path, params: Params) -> str | None:
    """The output name 05 runs under in a run that brings the deployment of run `seed` back (`sparkbook up`, a
    rollback): the kept arm's, where the seed's last 05 served the A/B's baseline again and the params still ask for
    that A/B (so it serves the baseline's plan, not the arm the A/B rejected); None: 05 serves the params' own plan."""
    served = [nb.name for nb in Manifest.read(seed).notebooks if SERVE.owns(nb.name) and nb.status == "ok"]
    if not served or arm_of(served[-1]) != KEPT or params.benchmark.ab is None:
        return None
    try:
        return served[-1] if load(seed, AbVerdict).ab == params.benchmark.ab else None
    except StateError:  # no verdict recorded: no A/B to follow
        return None
