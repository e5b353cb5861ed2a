"""What the earlier runs of a cluster recorded, read for the stages that set this run beside them: the image ID each
candidate's name meant to 03, and 06's earlier sweep with the runs of the same setup. The notebook's session hands
them to the stage, so no stage reads another run's dir."""
from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path

from ..core.analysis.benchcompare import EarlierSweep, recorded_sweep, same_setup_runs
from ..core.values import state
from ..core.values.errors import SparkbookError
from ..core.values.evidence import ProbedBefore
from ..core.values.handoff import ImageChoice
from ..core.values.rundir import earlier_run, runs_before


def probed_before(run_dir: Path, refs: Iterable[str]) -> dict[str, ProbedBefore]:
    """For 03: for each of `refs` an earlier sibling run recorded, the image ID the newest of them recorded under it
    (a dir without a run id, such as a notebook's interactive one, reads every run)."""
    wanted, found = set(refs), dict[str, ProbedBefore]()
    for earlier, ids in _recorded(run_dir):
        for ref, image_id in ids.items():
            if ref in wanted:
                found.setdefault(ref, ProbedBefore(image_id, earlier.name))
        if wanted <= set(found):
            break
    return found


def images_before(run_dir: Path) -> dict[str, ProbedBefore]:
    """For 02: the image ID of every candidate the cluster's last run with 03's choice recorded; {} where no earlier
    run has one."""
    for earlier, ids in _recorded(run_dir):
        return {ref: ProbedBefore(image_id, earlier.name) for ref, image_id in ids.items()}
    return {}


def _recorded(run_dir: Path) -> Iterator[tuple[Path, dict[str, str | None]]]:
    """Newest first, each earlier run's image IDs by name as its 03 recorded them: every candidate's and the chosen
    one's, from its ImageChoice in a state.json this controller sealed (a run dir whose seal does not match is passed
    over, never believed; a record from before the candidates were kept names the chosen image alone)."""
    for earlier in runs_before(run_dir):
        try:
            chosen = state.load(earlier, ImageChoice, sealed=True)
        except (SparkbookError, OSError):  # no 03 there, another schema, or not sealed here
            continue
        yield earlier, {**chosen.candidates, chosen.ref: chosen.id}


def earlier_sweep(run_dir: Path) -> EarlierSweep | None:
    """06's earlier run (the newest older one with sweep points) as recorded, this run's params and image beside it,
    and the sweeps of the runs of this setup before both; None where no earlier run has sweep points."""
    earlier = earlier_run(run_dir)
    if earlier is None:
        return None
    return EarlierSweep(recorded_sweep(earlier), recorded_sweep(run_dir), same_setup_runs(earlier, run_dir))
