"""A failed run's fall-back to the deployment before it, where its 04 replaced the containers of a live server and its
04 or 05 then failed (issue 40): the containers 04 kept aside come back under their names, and a run of 04 and 05 from
the hand-offs of the run that deployed them (as `sparkbook up` starts one) redeploys its plan in them. The failed run
records it as its `serve_rollback`, so status, logs, stop and up find the deployment that serves. (05's own rollback
within one run is stages.serve.rollback.)"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from ..core.cluster.topology import places
from ..core.values.evidence import read_events
from ..core.values.params import load_params
from ..core.values.rundir import PARAMS_COPY
from ..core.values.stagelist import SERVE
from .manifest import Manifest
from .session import Run

# what the failed run's rollback calls: a run of 04 and 05 from the hand-offs of the given run dir
UpFrom = Callable[[Path], tuple[Path, Manifest]]


@dataclass(frozen=True)
class SetAside:
    """The containers a run's 04 stopped and kept aside, and the run whose server they held."""

    run: str | None
    at: str  # ISO time they were stopped: the cluster has served nothing since
    nodes: list[str]


def waiting_aside(run_dir: Path) -> SetAside | None:
    """The containers the run's 04 set aside and its 05 did not drop (they are dropped once the new server
    answers); None where nothing waits aside."""
    aside = read_events(run_dir, "containers_set_aside")
    if not aside or read_events(run_dir, "containers_dropped"):
        return None
    data = aside[-1]["data"]
    return SetAside(data["run"], data["at"], list(data["nodes"]))


def redeploy_previous(params_file: Path, run_dir: Path, aside: SetAside, up_from: UpFrom,
                      say: Callable[[str], None]) -> bool:
    """Bring the containers back, then the plan they served (`up_from` the run that deployed it); record it in the
    failed run as `serve_rollback` with its seconds without service (from 04's stop of the old containers until the
    rollback run's 05 ended ok). Whether the old plan serves again."""
    failed = Manifest.read(run_dir)
    why = next((f"{nb.name}: {nb.exception['evalue'][:300]}" for nb in failed.notebooks
                if nb.status == "failed" and nb.exception), "unknown")
    session = Run(params_file, load_params(params_file), run_dir, "rollback")
    try:
        ctx, where = session.context(), places(session.params, "")  # by name: whatever image they run
        back = ctx.cluster.fan_out(lambda n: ctx.runtime.bring_back(n, where[n.name]))
    finally:
        session.close()
    problem = "; ".join(f"{n}: {o.error}" for n, o in back.items() if not o.ok) or None
    returned = [n for n, o in back.items() if o.ok and o.value]
    deployed = run_dir.parent / aside.run if aside.run else None
    if problem is None and (deployed is None or not (deployed / PARAMS_COPY).is_file()):
        problem = f"the run whose server the containers held ({aside.run or 'unrecorded'}) is not in {run_dir.parent}"
    elif problem is None and deployed == run_dir:  # a resume of the deploying run: its params copy is the new one's
        problem = (f"the containers held this run's own server, and resuming {run_dir.name} replaced the params it "
                   "served with: bring its plan up with `sparkbook up` from an earlier run, or resume it with them")
    via = None
    if problem is None and deployed is not None:
        say(f"rollback: the containers of run {aside.run} are back on {', '.join(returned) or 'no node'}; 04 and 05 "
            "bring its plan up again")
        via, manifest = up_from(deployed)
        problem = None if manifest.served() else \
            f"the rollback run {via.name} ended {manifest.status} before {SERVE.id} served"
    dark = (datetime.now(UTC) - datetime.fromisoformat(aside.at)).total_seconds()
    session.record("serve_rollback", {"rolled_back_to_run": aside.run, "ok": problem is None,
                                      "seconds_without_service": round(dark, 1), "new_plan_failure": why,
                                      "rollback_problem": problem, "via_run": via.name if via else None,
                                      "containers_back": returned})
    say(f"rolled back to run {aside.run}: its plan serves again after {dark:.0f} s without service (run {via.name})"
        if problem is None and via else f"the rollback failed: {problem}; the cluster serves nothing")
    return problem is None
