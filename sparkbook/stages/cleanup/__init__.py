"""01: inventory what the old deployment holds (inventory.py), plan its stop, dependents first, with what a unit
or managed process owns under its owner (planning.py, ownership.py), hand the restore plan to the session to write
(restore.py; a process's relaunch with its secrets by name: relaunch.py), act and verify (act.py); `sparkbook restore`
brings it back (restore.py).

The front door: `preview(ctx)` (every node's inventory and the stop plan: read-only) and `run(ctx, preview, ...)`,
which decides, stops in plan order only with confirm_cleanup, and verifies."""
from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from ...core.cluster.context import Context
from ...core.values.evidence import Shown, StageOutcome, unreachable
from ...core.values.fanout import Outcome
from ...core.values.handoff import Action, OldDeployment
from ...core.values.rundir import RESTORE_PLAN
from ...core.values.state import Handoff
from . import act, inventory, planning, restore
from .act import CleanupError, Verification
from .inventory import Inventory
from .planning import Plan
from .restore import RestoreFiles

# The session's writer of files into the run dir (`Run.keep_files`): name -> text
Keep = Callable[[Mapping[str, str]], object]


@dataclass(frozen=True)
class CleanupPreview:
    """What 01 would stop: every node's inventory (an unreachable node is its own outcome), the stop plan over the
    nodes reached with its order warnings, and the images the old deployment runs (02 and 03 read them)."""

    found: dict[str, Outcome[Inventory]]
    plan: Plan
    unreached: list[str]
    old: OldDeployment
    assumed: tuple[Handoff, ...] = ()

    @property
    def reached(self) -> list[Inventory]:
        return _reached(self.found)

    def inventories_shown(self, ctx: Context) -> list[Shown]:
        return [Shown(f"{name}: inventory ({o.duration_s:.1f} s)", inventory.inventory_rows(o.value, ctx.params.cleanup)
                      if o.value is not None else f"UNREACHABLE: {o.error}") for name, o in self.found.items()]

    def shown(self) -> list[Shown]:
        return [Shown("Cleanup plan, in this order (it acts only with -p confirm_cleanup=true)",
                      self.plan.rows() or "nothing allow-listed is running: nothing to stop"),
                Shown("Plan warnings", self.plan.warnings + self.unreached
                      or "no order conflicts; every node inventoried")]


def _reached(found: dict[str, Outcome[Inventory]]) -> list[Inventory]:
    return [o.value for o in found.values() if o.ok and o.value is not None]


def preview(ctx: Context) -> CleanupPreview:
    """Every node's inventory against the allow-lists and the stop plan, dependents first (nothing is touched)."""
    found = inventory.inventory_all(ctx)
    reached = _reached(found)
    return CleanupPreview(found, planning.plan(reached, ctx.params.cleanup, ctx.params.secret_values()),
                          [f.text for f in unreachable(found)], inventory.old_deployment(reached))


@dataclass(kw_only=True)
class CleanupOutcome(StageOutcome):
    """What 01 did: whether it acted, the stops in plan order, the restore plan and script, the verification (None
    where nothing was stopped)."""

    acted: bool
    preview: CleanupPreview
    actions: list[Action]
    restore: RestoreFiles | None = None
    check: Verification | None = None

    def actions_shown(self) -> list[Shown]:
        if not self.acted:
            return [Shown("Stopped", "confirm_cleanup is false: nothing was stopped "
                                     "(run with -p confirm_cleanup=true to act)")]
        return [Shown("Stopped, in plan order", self.actions)]

    def verification_shown(self) -> list[Shown]:
        c = self.check
        if c is None:
            return [Shown("Verification", "not acted: nothing to verify")]
        return [Shown("Every planned target stopped?", c.stopped), Shown("Memory available, before and after",
                                                                        c.memory), Shown("Verification", c.summary())]

    def restore_shown(self, run_dir: Path) -> list[Shown]:
        return [Shown(f"sparkbook restore {run_dir}",
                      self.restore.script if self.restore else "nothing was stopped: nothing to restore")]

    def summary_shown(self) -> list[Shown]:
        p = self.preview
        return [Shown("Cleanup findings", {
            "nodes inventoried": len(p.reached), "unreachable": "; ".join(p.unreached) or "none",
            "planned": len(p.plan.targets), "acted": self.acted,
            "verification": self.check.summary() if self.check else "not acted: plan only"})]


def run(ctx: Context, preview: CleanupPreview, *, confirm_cleanup: bool, params_file: Path,
        keep: Keep) -> CleanupOutcome:
    """Record the plan and the decision; with confirm_cleanup, hand the restore plan to `keep` (the session writes
    it into the run dir before anything is stopped), stop in plan order, inventory again and verify (a target still
    running, or anything outside the allow-lists touched, is the error)."""
    out = CleanupOutcome(acted=confirm_cleanup, preview=preview, actions=[], handoffs=[preview.old])
    out.event("cleanup_plan", preview.plan)
    out.decide(planning.decision(preview.plan, confirm_cleanup, preview.unreached))
    if not confirm_cleanup:
        return out
    out.restore = restore.restore_files(ctx, params_file, preview.plan)
    keep(out.restore.files())
    out.actions = act.stop(ctx, preview.plan)
    out.handoffs.append(act.outcome(out.actions, ctx.run_dir / RESTORE_PLAN))
    after = _reached(inventory.inventory_all(ctx))
    out.check = act.verify(preview.plan, preview.reached, after)
    out.event("cleanup_verification", out.check)
    if not out.check.ok:
        out.error = CleanupError(out.check.summary())
    return out
