"""05's rollback: when the plan that replaced a live server does not start, the plan that served before it (as the
head's container recorded it for the run that started it) is launched again, checked for health and a smoke
reply, and the time the cluster served nothing is measured from the moment the old server was stopped."""
from __future__ import annotations

import time
from dataclasses import dataclass

import httpx

from ...core.cluster.context import Context
from ...core.values.evidence import Alternative, Decision
from .launch import BringUp, Launch, Readiness, launch, stop_serving, wait_ready
from .replace import Replacement
from .reuse import remember
from .smoke import Smoke, smoke_test


@dataclass(frozen=True)
class Rollback:
    """The relaunch of the replaced plan: whose it is, whether it serves again, and for how long nothing served."""

    run: str | None  # the run whose plan was relaunched
    new_failure: str  # why the new plan did not start
    launched: Launch
    readiness: Readiness
    smoke: list[Smoke]
    dark_s: float  # from stopping the old server until the old plan listed its model again (or until giving up)
    problem: str | None  # why the rollback failed; None when the old plan serves again

    @property
    def ok(self) -> bool:
        return self.problem is None

    def summary(self) -> str:
        if self.ok:
            return (f"rolled back to run {self.run}: its plan serves again after {self.dark_s:.0f} s without "
                    f"service; the new plan failed: {self.new_failure}")
        return (f"the rollback to run {self.run} failed as well ({self.problem}); the cluster serves nothing "
                f"since {self.dark_s:.0f} s; the new plan failed: {self.new_failure}")

    def decision(self) -> Decision:
        return Decision("The new plan did not start: what serves now?",
                        f"rolled back to run {self.run}" if self.ok else "nothing: the rollback failed too",
                        self.summary(), [Alternative("leave the cluster serving nothing",
                                                     "serve.rollback_on_failure is true")],
                        [f"seconds without service: {self.dark_s:.1f}", f"new plan: {self.new_failure}",
                         f"rollback: {self.problem or 'health and smoke test passed'}"], key="rollback")

    def event(self) -> dict[str, object]:
        """What the run's events say of it (`serve_rollback`)."""
        return {"rolled_back_to_run": self.run, "ok": self.ok, "seconds_without_service": round(self.dark_s, 1),
                "new_plan_failure": self.new_failure, "rollback_problem": self.problem}

    def log_tails(self) -> dict[str, str]:
        """The relaunch's log tail per node, named for the run dir's logs/ folder."""
        return {f"serve-{node}-rollback.log": text for node, text in self.readiness.tails.items()}


def relaunch_replaced(ctx: Context, replaced: Replacement, failed: BringUp, new_failure: str) -> Rollback:
    """Relaunch the plan that served before `failed` (its processes are already stopped), under the attempt number
    its record names, so a later run's reuse and stop find it; then health, /v1/models and a smoke reply.
    The head's record names the run that started that plan again; a failed rollback is stopped as well."""
    old = replaced.serving
    launched = launch(ctx, old.running, old.attempt)
    ready = wait_ready(ctx, launched, ctx.params.serve.ready_timeout_s)
    replies: list[Smoke] = []
    problem = ready.cause.summary() if ready.cause else None if ready.ok else "not ready"
    if ready.ok:
        try:
            asked = old.running.settings.model_copy(update={"smoke": ctx.params.serve.smoke})  # this run's question
            replies = smoke_test(old.running.base_url, old.running.model, asked)
            problem = next((f"smoke test: {s.problem}" for s in replies if s.problem), None)
        except httpx.HTTPError as exc:
            problem = f"smoke test: {exc}"
    stopped = failed.stopped_at if failed.stopped_at is not None else launched.started_at
    dark = (launched.started_at + ready.seconds if ready.ok else time.monotonic()) - stopped  # until it answered
    if problem is None:
        remember(ctx, old.requested_plan, BringUp([(launched, ready)]), run=old.run)
    else:
        stop_serving(ctx, launched)
    return Rollback(old.run, new_failure, launched, ready, replies, dark, problem)
