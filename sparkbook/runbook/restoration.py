"""`sparkbook restore RUN_DIR`: bring back what the run's 01 stopped, from the restore plan it left, under the
cluster's run lock; each step is recorded in the run dir as it is taken, and the run's page gains its Restore
section. The stage (stages.cleanup.restore) decides and acts; this records and locks."""
from __future__ import annotations

from contextlib import nullcontext
from pathlib import Path

from ..core.values.evidence import read_events
from ..core.values.rundir import MANIFEST, PARAMS_COPY, RESTORE_PLAN
from ..core.values.stagelist import CLEANUP
from ..stages.cleanup import restore
from ..stages.cleanup.restore import RestoreFailed, RestoreOutcome, RestorePlanError, RestoreRefused, Step
from . import driver
from .driver import RunbookError, Say, silent
from .manifest import Manifest
from .operate import operator_lock
from .session import open_run


def restore_run(run_dir: Path, *, stop_new: bool, say: Say = silent) -> RestoreOutcome:
    """Restore what the run dir's 01 stopped (with `stop_new`: this runbook's node containers stopped first); the
    outcome, or RestoreRefused / RestoreFailed carrying it where something stood in the way or did not come back."""
    planned = _planned(run_dir)
    if planned is None:  # a notebook's own run dir: nothing to record the restore against
        return RestoreOutcome("nothing to restore")
    params_file, steps = planned
    # the run dir's own params.yaml, which the driver writes relative to the run dir once the run ends
    session = open_run(run_dir / params_file, run_dir, stage="restore")
    out = RestoreOutcome("nothing to restore")
    try:
        _known_nodes(run_dir, steps, [n.name for n in session.params.nodes])
        with operator_lock(session, f"restore-{run_dir.name}", say) if steps else nullcontext():  # none: no node
            for event in restore.restore_deployment(session.context(), steps, session.params.cleanup, stop_new):
                # each step as it is taken: one that fails later keeps the earlier
                session.record(event.kind, event.data)
                if isinstance(event.data, RestoreOutcome):
                    out = event.data
    finally:
        session.close()
        if (run_dir / MANIFEST).is_file():
            driver.write_index(run_dir, Manifest.read(run_dir, sealed=False))  # the page shows, never acts
    _check(run_dir, out)
    return out


def _planned(run_dir: Path) -> tuple[str, list[Step]] | None:
    """The params file and the steps to restore: the restore plan's, or none where 01 ran and stopped nothing; None
    where that run dir has no manifest to record against; RunbookError where 01 left nothing here."""
    plan_file = run_dir / RESTORE_PLAN
    if plan_file.is_file():
        plan = restore.read_plan(plan_file)
        return plan.params_file, plan.steps
    if not read_events(run_dir, "cleanup_plan"):
        raise RunbookError(f"{plan_file} not found: {CLEANUP.name} writes it after it stops something")
    if not (run_dir / MANIFEST).is_file():
        return None
    own = run_dir / PARAMS_COPY  # the run's own copy, which loads wherever the source has moved
    return str(own) if own.is_file() else Manifest.read(run_dir).params_file, []


def _known_nodes(run_dir: Path, steps: list[Step], nodes: list[str]) -> None:
    """RestorePlanError where a step names a node the params do not: nothing is restored."""
    unknown = sorted({s.node for s in steps} - set(nodes))
    if unknown:
        raise RestorePlanError(f"{run_dir / RESTORE_PLAN}: steps name node(s) {', '.join(unknown)}, which the run's "
                               f"params do not ({', '.join(nodes)}); nothing was restored",
                               remediation="bring those targets back by hand (restore.sh lists each command)")


def _check(run_dir: Path, out: RestoreOutcome) -> None:
    """Raise what a refused or failed restore is, carrying its outcome (the caller shows each step)."""
    if out.result == "refused":
        raise RestoreRefused(
            f"refused, nothing was restored: {'; '.join(c.line() for c in out.conflicts) or 'see the lines above'}",
            out, remediation=f"clear each one, or `sparkbook restore {run_dir} --stop-new` to stop this runbook's "
                             "node containers (its Ray and vLLM server) first")
    if not out.ok:
        bad = [f"{c.node}/{c.name}: {', '.join(c.problems)}" for c in out.checks if not c.ok]
        raise RestoreFailed(f"restore failed: {'; '.join(bad) or 'a restore step failed'}", out,
                            remediation="see each target's log tail above")
