"""05's replacement of a live server: a decision, not a side effect. A server that answers and was started from
another plan is stopped only with confirm_replace; without it 05 stops showing what differs, the server untouched."""
from __future__ import annotations

from dataclasses import dataclass

import httpx

from ...core.cluster.context import Context
from ...core.values.evidence import Alternative, Decision
from .commands import ServeError, ServePlan
from .launch import get
from .plandiff import Difference, differences
from .reuse import Serving, plan_data, read_serving


@dataclass(frozen=True)
class Replacement:
    """The live server a new plan would replace: whose run started it, since when, and what differs."""

    serving: Serving
    differences: list[Difference]

    def table(self) -> list[dict[str, str]]:
        return [{"field": d.field, "running": d.running, "new": d.new} for d in self.differences]

    @property
    def whose(self) -> str:
        return f"run {self.serving.run or '(unrecorded)'}'s server (serving since {self.serving.since or 'unknown'})"

    def decision(self, ab: bool = False) -> Decision:
        """`ab`: the A/B's next arm replaces what its arm before left serving (this run's own plan, no
        confirm_replace needed; that guards the servers other runs left)."""
        why = ("the A/B's arm before this one serves it (benchmark.ab)" if ab
               else "confirm_replace=true: the operator chose the new plan")
        return Decision(
            "Replace the live server with the new plan?", f"replace {self.whose}",
            f"{why}; should it fail to start, serve.rollback_on_failure relaunches this one",
            [Alternative("keep the running server", "not what confirm_replace asked for")],
            [f"{d.field}: {d.running!r} -> {d.new!r}" for d in self.differences], key="replace")

    def event(self) -> dict[str, str | None]:
        """What the run's events say of the replacement (`serve_replaced`)."""
        return {"run": self.serving.run, "since": self.serving.since, "base_url": self.serving.running.base_url,
                "fields": ", ".join(sorted({d.field for d in self.differences}))}


def answers(serving: Serving) -> bool:
    """Whether the recorded server answers /health (a dead one needs no decision to be replaced)."""
    with httpx.Client(timeout=httpx.Timeout(10.0, connect=3.0), headers=serving.running.settings.headers()) as client:
        r = get(client, f"{serving.running.base_url}/health")
    return r is not None and r.status_code == 200


def server_to_replace(ctx: Context, new: ServePlan) -> Replacement | None:
    """The live server that `new` would replace: recorded in the head's container, started from another plan,
    answering. None when nothing answers there or it serves this very plan (05 keeps it)."""
    serving = read_serving(ctx, new.commands[0].node)
    if serving is None:
        return None
    changed = differences(serving.requested, plan_data(new))
    return Replacement(serving, changed) if changed and answers(serving) else None


def confirm(replacement: Replacement | None, confirm_replace: bool) -> None:
    """ServeError, listing the differences, when a live server would be replaced without confirm_replace."""
    if replacement is None or confirm_replace:
        return
    listed = "; ".join(f"{d.field}: {d.running!r} -> {d.new!r}" for d in replacement.differences[:12])
    raise ServeError(f"{replacement.whose} still serves at {replacement.serving.running.base_url}, started from "
                     f"another plan ({listed}); it was left untouched",
                     remediation="run again with -p confirm_replace=true (or set it in 05's parameters cell) "
                                 "to replace it, or revert the params")
