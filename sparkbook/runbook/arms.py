"""The A/B's notebooks (benchmark.ab; the arms: core.values.abarm): 05 and 06 run first as the baseline arm (without
serve.speculative, or serve.layout tp), then as the params' own plan, the second arm ("speculative", "replicas"), on
the same nodes one after the other; 06 of the second arm decides which configuration stays serving, and where that
is the baseline, 05 serves it again as the last notebook. The image A/B runs 04 in every arm too (the arms' images
differ, and 04 makes the nodes' containers of an image); where 03 found no baseline image, its baseline arm is
skipped with 03's reason and the run serves 03's choice as without an A/B.

The baseline and kept arms run under their own output names, `NN-name.ab-<arm>.ipynb`, so their record (decisions,
events, logs) is filed apart, the baseline's sweep points under ab-baseline/; the params' own plan keeps the
notebooks' names. Every notebook of an A/B is told its arm (`ab_arm`): the second and third 05 replace the server the
arm before them left, and the second 06 decides.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from ..core.values.abarm import AB_ARMS, BASELINE, KEPT, AbKind, changes_image, second_arm
from ..core.values.handoff import AbBaseline, AbVerdict
from ..core.values.params import Params
from ..core.values.stagelist import BENCH, RAYCLUSTER, SERVE, Stage
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
    return src in names and arm in AB_ARMS and any(s.owns(src) for s in ARM_STAGES) and name == arm_name(src, arm)


ARM_STAGES = (RAYCLUSTER, SERVE, BENCH)  # the stages that can run under an arm (04: the image A/B alone)


def arm_stages(ab: AbKind | None) -> tuple[Stage, ...]:
    """The stages each arm of the A/B `ab` runs: 05 and 06, and 04 where the arms' images differ."""
    return ARM_STAGES if changes_image(ab) else ARM_STAGES[1:]


def in_arm(name: str, ab: AbKind | None) -> bool:
    return any(s.owns(source(name)) for s in arm_stages(ab))


def arm_of(name: str) -> str | None:
    _, _, arm = name.removesuffix(".ipynb").partition(".ab-")
    return arm or None


def parameters(name: str, run: list[str], ab: AbKind | None) -> dict[str, Any]:
    """The `ab_arm` of a notebook of the run whose notebooks are `run` (those it runs or ran, not those it skips), in
    the params' A/B `ab`: its own arm, the second arm (named by what it serves) for 05 and 06 of the params' plan in a
    run that has the baseline arm, none outside an A/B (`sparkbook up`'s 05: no arm before it to replace)."""
    if (arm := arm_of(name)) is not None:
        return {"ab_arm": arm}
    in_ab = in_arm(name, ab) and any(arm_of(n) == BASELINE for n in run)
    return {"ab_arm": second_arm(ab)} if in_ab and ab is not None else {}


def with_arms(names: list[str], params: Params) -> list[str]:
    """`names` with the baseline arm's notebooks (05 and 06; for the image A/B 04, 05 and 06) before the first of
    them, where the params ask for an A/B and each of them is among `names` (an A/B needs a server and a sweep on
    it; `--only 05` or `--upto 05` serves the params' plan)."""
    ab = params.benchmark.ab
    each = [[n for n in names if stage.owns(n)] for stage in arm_stages(ab)]
    if ab is None or any(len(found) != 1 for found in each):
        return names
    at = names.index(each[0][0])
    return names[:at] + [arm_name(found[0], BASELINE) for found in each] + names[at:]


def skipped(run_dir: Path, name: str, ab: AbKind | None) -> str | None:
    """Why a baseline-arm notebook does not run (None: it runs): the image A/B's 03 found no baseline image."""
    if arm_of(name) != BASELINE or not changes_image(ab):
        return None
    try:
        chosen = load(run_dir, AbBaseline)
    except StateError as exc:  # no 03 in this run: nothing says which image the baseline serves
        return f"skipped: no baseline image ({exc.message})"
    return None if chosen.image is not None else f"skipped: {chosen.reason}"


def follow_up(run_dir: Path, name: str, run: list[str], names: list[str], ab: AbKind) -> list[str]:
    """After the second arm's 06 (in `run`, the run's notebooks): 05 once more (for the image A/B 04 and 05),
    serving the baseline, where the A/B kept it (none otherwise). `names`: the notebooks of the folder; `ab`: the
    params' benchmark.ab."""
    if not BENCH.owns(name) or parameters(name, run, ab) != {"ab_arm": second_arm(ab)}:
        return []
    if load(run_dir, AbVerdict).kept != BASELINE:
        return []
    return [arm_name(next(n for n in names if stage.owns(n)), KEPT) for stage in arm_stages(ab)
            if stage is not BENCH]


def serving_again(seed: Path, params: Params) -> str | None:
    """The output name 05 runs under in a run that brings the deployment of run `seed` back (`sparkbook up`, a
    rollback): the kept arm's, where the seed's last 05 served the A/B's baseline again and the params still ask for
    that A/B (so it serves the baseline's plan, not the arm the A/B rejected); None: 05 serves the params' own plan."""
    served = Manifest.read(seed).served()
    if not served or arm_of(served[-1]) != KEPT or params.benchmark.ab is None:
        return None
    try:
        return served[-1] if load(seed, AbVerdict).ab == params.benchmark.ab else None
    except StateError:  # no verdict recorded: no A/B to follow
        return None
