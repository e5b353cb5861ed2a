"""05: the commands from params (commands.py; serve.layout replicas: a copy per node behind vllm-router,
replicas.py), launch and readiness (launch.py), a server kept when it already
serves this plan (reuse.py), a live server of another plan replaced only as a decision (replace.py) and relaunched
when the new plan fails (rollback.py), memory before the launch (memory.py), the bring-up with its remediated
retries (bringup.py, failures.py), the serving processes' env (environ.py), the smoke test (smoke.py), the answers
checked at depth against the reference of this model and plan (answers.py, on core.analysis.quality).

The front door: `preview(ctx)` (the image, the executor, each node's exact `vllm serve`, what a replacement would
change; read-only probes) and `run(ctx, preview, ...)`, which does the stage in order and returns its evidence."""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime

from ...core.analysis.quality import Reference
from ...core.cluster.context import Context
from ...core.cluster.progress import Progress
from ...core.cluster.topology import cache_dir
from ...core.values.abarm import changes_image, replaces_own_arm, second_arm
from ...core.values.errors import SparkbookError
from ...core.values.evidence import Alternative, Decision, Shown, StageOutcome, tail
from ...core.values.handoff import AbAnswers, Diagnosis, Endpoint, ImageChoice, RayCluster
from ...core.values.modelinfo import ModelFacts, utilization_floor
from ...core.values.state import Handoff
from . import (
    answers,
    bluegreen,
    bringup,
    commands,
    endpoints,
    environ,
    front,
    memory,
    replace,
    replicas,
    reuse,
    rollback,
    smoke,
)
from .answers import AnswerChecks
from .bluegreen import Beside
from .bringup import Room
from .commands import Platform, ServeError, ServePlan
from .endpoints import ClientAddress
from .environ import NodeEnviron
from .front import ClientView
from .launch import BringUp, standing_front, stop_earlier, stop_serving
from .memory import BeforeLaunch
from .replace import Replacement
from .rollback import Rollback
from .smoke import Smoke

LOG_TAIL_LINES = 12


# --- preview ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ServePreview:
    """What 05 would do: the image and Ray cluster it serves in, the platform and the executor it implies (the
    decision `run` records first), the exact commands, the OOM ladder's floor, the live server it would replace
    and what that changes, and the Endpoint it would hand 06 (`assumed`, for `sparkbook plan`'s next preview)."""

    image: ImageChoice
    ray: RayCluster | None  # None: 04 has not run in this run dir
    model: ModelFacts | None  # None: 02 has not run; the model dir is params' own
    diagnosis: Diagnosis | None  # None: 02 has not run; the OOM ladder's floor is unknown
    platform: Platform
    executor: str
    executor_decision: Decision
    plan: ServePlan
    floor: float | None  # the lowest gpu_memory_utilization that holds the model; None: unknown
    replacing: Replacement | None  # the live server of another plan this one would replace
    caches: str  # the compile caches' dir on every node (a replacement and `up` start warm from it)
    assumed: tuple[Handoff, ...] = ()
    checks: dict[str, object] = field(default_factory=dict)  # the answers checked at depth and their reference

    def shown(self) -> list[Shown]:
        return [Shown("Where 05 serves", self.where()), Shown("Executor", self.executor_row()),
                Shown(self.commands_title(), self.plan.table()), *self.replacement(),
                Shown("Answers checked at depth, after the smoke test", self.checks)]

    def where(self) -> dict[str, object]:
        ray, unknown = self.ray, f"not known: no RayCluster of {RayCluster.notebook} in this run dir"
        return {"image": self.image.ref, "Ray address": ray.address if ray else unknown,
                "containers": ", ".join(ray.containers.values()) if ray else "-",
                "compile caches (vLLM, Triton, Inductor, FlashInfer)": self.caches}

    def executor_row(self) -> dict[str, object]:
        p = self.platform
        return {"platform": p.device, **({"asked": p.asked} if p.asked else {}), "vllm": p.vllm, "torch": p.torch,
                "visible GPUs": p.gpus, "executor": self.executor_decision.choice, "why": self.executor_decision.reason}

    def commands_title(self) -> str:
        model = "" if self.model else (f" (model dir: params' own, no ModelFacts of {ModelFacts.notebook} in this "
                                       "run dir)")
        what = ("vllm serve, a whole copy per node, then vllm-router on the head before them"
                if self.plan.settings.layout == "replicas" else
                "vllm serve, per node, behind vllm-router in its own place on the head (the front: it stays up "
                "while servers and 04's node places change)"
                if self.plan.router else "vllm serve, per node")
        if self.floor is not None:
            return f"{what} (OOM ladder: gpu_memory_utilization {self.floor}, then eager){model}"
        known = ("max_model_len or a serving node's memory unknown" if self.model and self.diagnosis
                 else f"no ModelFacts and Diagnosis of {Diagnosis.notebook} in this run dir")
        return f"{what} (OOM ladder: floor unknown, {known}: straight to eager){model}"

    def replacement(self) -> list[Shown]:
        if self.replacing is None:
            return []
        return [Shown(f"What differs from {self.replacing.whose}", self.replacing.table())]


def preview(ctx: Context) -> ServePreview:
    """Read 03's image, 04's Ray cluster and 02's model facts; ask the image for its platform, choose the
    executor, build each node's command and read what serves now (read-only probes). Without 02's hand-offs the
    model is served from params' own path and the OOM ladder's floor is unknown: the preview says so."""
    choice = ctx.handoffs.need(ImageChoice)
    ctx = ctx.with_image(choice.on_nodes)
    model, diagnosis = ctx.handoffs.get(ModelFacts), ctx.handoffs.get(Diagnosis)
    platform = commands.detect_platform(ctx)
    executor, decision, serve_plan = _layout_plan(ctx, platform, model.dir_on_nodes if model else "")
    floor = _floor(ctx, model, diagnosis)
    endpoint = bringup.planned_endpoint(serve_plan, endpoints.client_addresses(ctx.params))
    return ServePreview(choice, ctx.handoffs.get(RayCluster), model, diagnosis, platform, executor, decision,
                        serve_plan, floor, replace.server_to_replace(ctx, serve_plan), cache_dir(ctx.params),
                        (endpoint,), answers.planned(ctx, serve_plan))


def _layout_plan(ctx: Context, platform: Platform, model_dir: str) -> tuple[str, Decision, ServePlan]:
    """serve.layout picks the executor (a replica spans one node) and the commands (bringup.layout_plan), behind the
    front in the slot the running server is in (so a server of this very plan is kept)."""
    if ctx.params.serve.layout == "replicas":
        executor, decision = replicas.executor(ctx.params, platform)
    else:
        executor, decision = commands.choose_executor(ctx, platform)
    return executor, decision, bringup.layout_plan(ctx, executor, ctx.params.serve, model_dir, platform.drains,
                                                   _running_slot(ctx))


def _running_slot(ctx: Context) -> int:
    """The slot behind the front the standing front routes to (its own record: after 04's new node places no
    server's record is left), else the recorded server's; 0 without a front or a record."""
    if ctx.params.serve.front != "router":
        return 0
    routed = front.routes(ctx)
    if routed is not None:
        return front.routed_slot(routed, ctx.params.serve)
    serving = reuse.read_serving(ctx, ctx.params.head.name)
    return front.slot_of(serving.running) if serving is not None else 0


def _floor(ctx: Context, model: ModelFacts | None, diagnosis: Diagnosis | None) -> float | None:
    """The OOM ladder's floor for the layout served (None: 02's hand-offs or a figure it needs are missing)."""
    if model is None or diagnosis is None:
        return None
    if ctx.params.serve.layout == "replicas":
        return replicas.floor(model, ctx.params, diagnosis.node_memory)
    return utilization_floor(model, ctx.params, diagnosis.node_memory)


# --- run -------------------------------------------------------------------------------------------
@dataclass(kw_only=True)
class ServeOutcome(StageOutcome):
    """What 05 did, step by step: the replacement it confirmed, the room it made (or the server it kept), memory
    before the launch, the bring-up, the rollback where the new plan failed, the serving env, the smoke test and
    the Endpoint. A field is None where 05 stopped before its step (outcome.error says why)."""

    replaced: Replacement | None = None
    ab_next: bool = False  # the replacement was the A/B's own (its arm before this one served)
    room: Room | None = None
    before: BeforeLaunch | None = None
    up: BringUp | None = None
    held: dict[str, int] | None = None  # bytes per serving node the new server holds (None: kept or not reached)
    rolled_back: Rollback | None = None
    found_env: list[NodeEnviron] | None = None
    smoke: list[Smoke] | None = None
    answers: AnswerChecks | None = None
    answers_off: bool = False  # serve.quality.enabled is false: nothing checked, said so
    answers_judged_by_ab: bool = False  # the image A/B's candidate arm: a disagreement is 06's verdict to judge
    client_view: ClientView | None = None  # behind a standing front: what a client saw while the servers changed
    quality_key: str | None = None  # the reference the answers were checked against (None: not checked)
    beside: Beside | None = None  # behind the front, a replacement: whether the new plan fit beside the old
    endpoint: Endpoint | None = None
    addresses: list[ClientAddress] = field(default_factory=list)

    @property
    def new_reference(self) -> Reference | None:
        """The reference this run's answers make, for the notebook to keep (None: one was there, or none passed)."""
        return self.answers.new_reference if self.answers else None

    def _stopped(self, title: str) -> list[Shown]:
        """A step 05 did not reach or that stopped it: why (the record cell raises it)."""
        why = self.error.message if self.error else "not reached"
        return [Shown(title, f"05 stopped at or before this step: {why}")]

    def replacement_shown(self) -> list[Shown]:
        if self.room is None and self.error is not None:
            return self._stopped("Replacement")
        if self.replaced is None:
            return [Shown("Replacement", "no live server of another plan to replace")]
        why = "the A/B's arm before this one served it" if self.ab_next else "confirm_replace=true"
        return [Shown("Replacement", {"replaced": self.replaced.whose, "because": why,
                                      "fields": self.replaced.event()["fields"]})]

    def memory_shown(self) -> list[Shown]:
        if self.room is not None and self.room.kept is not None:
            return [Shown("Memory before the launch",
                          "the running server serves this plan: it is kept, nothing is launched or measured")]
        if self.before is None:
            return self._stopped("Memory before the launch")
        b = self.before
        shown = [Shown(f"MemAvailable before the launch (unified memory: {', '.join(b.unified) or 'no serving node'})",
                       {n: f"{v / 2**30:.2f} GiB" for n, v in b.available.items()})]
        if b.unified:
            shown += [Shown("Page cache dropped", [d.row() for d in b.drops]),
                      Shown("02's memory fit, measured again after the drop", b.fit)]
        return shown

    def attempts_shown(self) -> list[Shown]:
        if self.up is None:
            return self._stopped("Attempts")
        shown = [Shown("Attempts", self.up.table())]
        if self.up.router_install is not None:
            shown.insert(0, Shown("vllm-router in its place on the head (its own install, not the image's packages)",
                                  {**self.up.router_install.event(), "front's place started": self.up.front_opened}))
        if self.up.settles:  # after each failed attempt: MemAvailable before the launch, after the failure, settled
            shown.append(Shown("Memory settle after failed attempts", settle_rows(self.up)))
        if self.held is not None:
            shown.append(Shown("What the server holds once ready (a later run's 02 counts it free)",
                               {n: f"{b / 2**30:.2f} GiB" for n, b in self.held.items()}))
        return shown

    def logs_shown(self) -> list[Shown]:
        """The last lines of each log 05 keeps (in full under the run dir's logs/), the rollback's after the
        attempts'."""
        if self.up is None:
            return self._stopped("Serve logs")
        return [Shown(f"logs/{name} (tail)", tail(text, LOG_TAIL_LINES)) for name, text in self.logs.items()]

    def env_shown(self) -> list[Shown]:
        title = "Env names in the serving processes (names only)"
        if self.found_env is None:
            return self._stopped(title)
        rows = [e.row() for e in self.found_env]
        return [Shown(title, rows or "not checked: the Python runtime's processes share the node with others")]

    def smoke_shown(self) -> list[Shown]:
        if self.smoke is None:
            return self._stopped("Smoke test")
        return [Shown("Smoke test", [{"kind": s.kind, "prompt": s.prompt, "answer": s.text,
                                      "reasoning (tail)": s.reasoning[-200:], "finish": s.finish_reason,
                                      "seconds": round(s.seconds, 1), "tokens": s.completion_tokens,
                                      "verdict": s.problem or "ok"} for s in self.smoke])]

    def answers_shown(self) -> list[Shown]:
        title = "Answers checked at depth"
        if self.answers_off:
            return [Shown(title, "not checked: serve.quality.enabled is false")]
        q = self.answers
        if q is None:
            return self._stopped(title)
        r = q.report
        known = [Shown(f"Known answers (the served window: {r.window} tokens)",
                       [a.row() for a in r.answers] or f"skipped: {r.skipped}")]
        agreement = (Shown(f"Agreement with run {r.reference.run}'s reference (key {r.key})", q.rows()) if r.reference
                     else Shown("Agreement", f"no reference for key {r.key} yet: " + (
                         f"this run's greedy tokens recorded as it ({q.recorded})" if q.recorded
                         else "none recorded (the checks failed)")))
        judged = [Shown("Left to the A/B's verdict", f"{q.problem}: in the A/B of images 06 keeps this image only "
                        "where its answers agree as well as the baseline's")] \
            if self.answers_judged_by_ab and q.problem else []
        return [*known, agreement, Shown("Verdict", q.summary()), *judged]

    def endpoint_shown(self) -> list[Shown]:
        if self.endpoint is None:
            return self._stopped("endpoint (state.json)")
        return [Shown("endpoint (state.json)", self.endpoint.model_dump(exclude={"commands", "env", "logs"})),
                Shown("Where clients reach the API, per network", [a.row() for a in self.addresses])]

    def summary_shown(self) -> list[Shown]:
        e = self.endpoint
        if e is None or self.smoke is None:
            return self._stopped("05 summary")
        return [Shown("05 summary", {"endpoint": e.base_url, "model": e.model, "executor": e.executor,
                                     "nodes serving": len(e.commands), "time to ready (s)": e.ready_s,
                                     "seconds without service": e.seconds_without_service
                                     if e.seconds_without_service is not None else "none: nothing was serving",
                                     "attempts": e.attempts,
                                     "smoke test": "passed: " + ", ".join(s.kind for s in self.smoke),
                                     "answers checked": self.answers.summary() if self.answers
                                     else "not checked (serve.quality.enabled is false)"})]


def seconds_since(iso: str) -> float:
    """Seconds from an ISO time a stage recorded (core.values.evidence.now) until now."""
    return (datetime.now(UTC) - datetime.fromisoformat(iso)).total_seconds()


def settle_rows(up: BringUp) -> list[dict[str, object]]:
    return [row for s in up.settles for row in s.rows()]


def run(ctx: Context, preview: ServePreview, *, confirm_replace: bool, ab_arm: str | None) -> ServeOutcome:
    """Serve the preview's plan: the executor decision, the replacement confirmed (or 05 stops with the live
    server untouched), room made and memory measured, the bring-up with its remedies, a rollback where the new
    plan that replaced a server fails, the serving env, the smoke test, the Endpoint for 06. An expected failure
    is the outcome's error, after the evidence of every step it reached."""
    ctx, outcome = ctx.with_image(preview.image.on_nodes), ServeOutcome()
    outcome.answers_judged_by_ab = changes_image(ctx.params.benchmark.ab) and ab_arm == second_arm("image")
    outcome.decide(preview.executor_decision)
    try:
        model = _needed(ctx, preview)
        _replace(preview, outcome, confirm_replace, ab_arm)
        up = _through_front(ctx, preview, outcome, model)
        _started(ctx, preview, outcome, up)
        _held(ctx, outcome, up)
        _serving_env(ctx, outcome, up)
        if outcome.smoke is None:  # a blue-green server was checked on its own port before the front moved
            _smoke(ctx, outcome, up)
            outcome.quality_key = _check_answers(ctx, preview, outcome, up)
        key = outcome.quality_key
        _drop_aside(ctx, preview, outcome)
        outcome.addresses = endpoints.client_addresses(ctx.params)
        outcome.endpoint = bringup.endpoint(up, outcome.addresses).model_copy(update={
            "quality_key": key, **_front_seconds(outcome)})
        outcome.handoffs.append(outcome.endpoint)
        if ab_arm is not None and changes_image(ctx.params.benchmark.ab):  # the A/B whose verdict reads answers
            earlier = ctx.handoffs.get(AbAnswers) or AbAnswers()
            outcome.handoffs.append(earlier.adding(ab_arm, answers.lowest_agreement(outcome.answers)))
    except SparkbookError as exc:
        outcome.error = exc
    return outcome


def _front_seconds(outcome: ServeOutcome) -> dict[str, object]:
    """Behind a kept front, the seconds without service are what a client saw (held requests answered late count;
    the server's own stop-to-ready time is longer), with the asks refused and failed meanwhile."""
    view = outcome.client_view
    if view is None:
        return {}
    return {"seconds_without_service": view.dark_s, "front_refused": view.refused, "front_failed": view.failed}


def _drop_aside(ctx: Context, preview: ServePreview, outcome: ServeOutcome) -> None:
    """The containers this run's 04 replaced, kept aside until now: the new server answers, so they go."""
    if preview.ray is not None and preview.ray.stopped_server_at is not None:
        outcome.event("containers_dropped", bringup.drop_aside(ctx))


def _needed(ctx: Context, preview: ServePreview) -> ModelFacts:
    """02's hand-offs: a preview may go without them (`sparkbook plan`), a run may not (the fit is measured again
    before the launch); MissingState names the notebook that makes them."""
    if preview.diagnosis is None:
        ctx.handoffs.need(Diagnosis)
    return preview.model if preview.model is not None else ctx.handoffs.need(ModelFacts)


def _replace(preview: ServePreview, outcome: ServeOutcome, confirm_replace: bool, ab_arm: str | None) -> None:
    """Replace a live server of another plan only when confirmed (or the A/B's own); else ServeError, the server
    untouched."""
    outcome.ab_next = replaces_own_arm(ab_arm)
    replace.confirm(preview.replacing, confirm_replace or outcome.ab_next)
    if preview.replacing is not None:
        outcome.replaced = preview.replacing
        outcome.event("serve_replaced", preview.replacing.event())
        outcome.decide(preview.replacing.decision(outcome.ab_next))


def _through_front(ctx: Context, preview: ServePreview, outcome: ServeOutcome, model: ModelFacts) -> BringUp:
    """Make room and bring up; behind a standing front (serve.front: router), a replacement stands up beside the old
    server where both fit (blue-green), else stops it drained, a client's view of it measured meanwhile from here
    and recorded as the replacement's seconds without service."""
    if standing_front(ctx, preview.plan) is None:
        _make_room(ctx, preview, outcome, model)
        return _bring_up(ctx, preview, outcome)
    plan, green = preview.plan, _green(ctx, preview, outcome, model)
    by_04 = preview.ray.stopped_server_at if preview.ray else None  # 04's new node places ended the old server
    with front.Watcher(plan.base_url, plan.model, plan.settings.headers(), plan.settings.hold_s,
                       time.monotonic() - seconds_since(by_04) if by_04 else None) as w:
        if green is not None:
            up = _blue_green(ctx, preview, outcome, model, *green)
        else:
            _make_room(ctx, preview, outcome, model)
            up = _bring_up(ctx, preview, outcome)
    if outcome.room is not None and outcome.room.kept is None:
        outcome.client_view = w.view()
        way = _way(green is not None, outcome.replaced is not None, outcome.room.drain_s, by_04 is not None)
        drain_s = outcome.room.drain_s if outcome.replaced is not None else None
        outcome.event("front_held", {"way": way, "drain_timeout_s": drain_s, **w.view().event()})
    return up


def _way(blue_green: bool, replaced: bool, drain_s: int | None, by_04: bool = False) -> str:
    """How a bring-up behind a standing front went, in the words the records use: the same plan started again (a
    watch restart, `up` after a crash) drains nothing, whatever its server's argv allows; 04's new node places (a new
    image or env) ended the old server with its container, the front standing in its own place."""
    if blue_green:
        return "blue-green"
    if by_04:
        return "new node places behind the front"
    if not replaced:
        return "restart behind the front"
    return "drained stop" if drain_s else "stop behind the front"


def _green(ctx: Context, preview: ServePreview, outcome: ServeOutcome, model: ModelFacts
           ) -> tuple[ServePlan, reuse.Serving] | None:
    """The new plan in the other slot where it replaces a server and fits beside it (serve.switch auto; with
    replicas, every node's copy beside that node's), with the serving record it replaces; the decision recorded
    either way; None: a drained stop."""
    settings = preview.plan.settings
    if preview.replacing is None:
        return None
    question = "Blue-green or a drained stop?"
    if settings.switch == "drain":
        outcome.decide(Decision(question, "drained stop", "serve.switch is drain", [
            Alternative("blue-green", "not asked for")]))
        return None
    green = bringup.layout_plan(ctx, preview.plan.executor, settings, preview.plan.model_dir,
                                front.drains(preview.plan), 1 - front.slot_of(preview.plan))
    serving = reuse.read_serving(ctx, ctx.head.name)
    old_front = serving.running.router if serving is not None else None
    if serving is None or old_front is None or green.router is None or \
            not front.routes_alike(old_front, green.router):
        outcome.decide(Decision(question, "drained stop", "the front itself changes (its own settings), so it "
                                "starts again with the new plan", [Alternative("blue-green", "it needs the front "
                                                                               "that serves now to stay")]))
        return None
    outcome.beside = bluegreen.beside(ctx, green, model)
    outcome.event("fit_beside", outcome.beside.event())
    chosen = "blue-green" if outcome.beside.fits else "drained stop"
    outcome.decide(Decision(question, chosen, f"the new plan: {outcome.beside.why()}", [
        Alternative("drained stop" if outcome.beside.fits else "blue-green",
                    "requests held while no server answers" if outcome.beside.fits else "it does not fit")]))
    return (green, serving) if outcome.beside.fits else None


def _blue_green(ctx: Context, preview: ServePreview, outcome: ServeOutcome, model: ModelFacts,
                green: ServePlan, serving: reuse.Serving) -> BringUp:
    """The new server in the other slot while the old one serves: launched, ready, checked on its own port (smoke
    test, answers); then the front moves to it and the old one drains and stops. A failure before the move stops the
    new server alone: ServeError, the old one untouched and serving (0 s without service)."""
    outcome.room = Room(None, "blue-green: the server of the other plan serves until the front moves", None)
    outcome.before = memory.before_launch(ctx, green, model)
    outcome.event("memory_before_launch", outcome.before)
    up = _bring_up(ctx, preview, outcome, green, keep=False)
    outcome.logs.update(bringup.log_tails(up))
    try:
        if not up.ok:
            raise ServeError(bringup.failure_message(up))
        outcome.held = memory.held(ctx, outcome.before)  # recorded with the new server once the front moved to it
        outcome.event("memory_held_by_server", outcome.held)
        checked = _on_own_port(up, green)
        _smoke(ctx, outcome, checked)
        outcome.quality_key = _check_answers(ctx, preview, outcome, checked)
        bluegreen.move(green.base_url, bluegreen.backends(green), bluegreen.backends(serving.running),
                       green.settings.headers())
        assert green.router is not None, "_green plans it behind the front"
        front.record(ctx, green.router.argv)
    except ServeError as exc:
        stop_serving(ctx, up.launched)
        raise ServeError(f"the replacement was refused before the front moved, the server of run {serving.run} "
                         f"serves on, untouched (0 s without service): {exc}") from exc
    outcome.event("old_server_settled", bluegreen.settle(bluegreen.backends(serving.running),
                                                          ctx.params.serve.drain_timeout_s,
                                                          serving.running.settings.headers()).event())
    stop_earlier(ctx, ctx.params.serve.max_remedies + 1, ctx.params.serve.drain_timeout_s
                 if front.drains(serving.running) else 0, slots=(front.slot_of(serving.running),))
    reuse.remember(ctx, green, up)
    if outcome.held is not None:
        reuse.record_held(ctx, green.commands[0].node, outcome.held)
    outcome.room = dataclasses.replace(outcome.room, drain_s=ctx.params.serve.drain_timeout_s
                                       if front.drains(serving.running) else None)
    return up


def _on_own_port(up: BringUp, green: ServePlan) -> BringUp:
    """The bring-up as the checks before the move see it: its server on its own port, not through the front."""
    launched, ready = up.attempts[-1]
    direct = dataclasses.replace(launched, plan=dataclasses.replace(launched.plan,
                                                                    base_url=bluegreen.backends(green)[0]))
    return dataclasses.replace(up, attempts=[*up.attempts[:-1], (direct, ready)])


def _make_room(ctx: Context, preview: ServePreview, outcome: ServeOutcome, model: ModelFacts) -> None:
    """Stop what earlier runs serve (unless it serves this plan: kept, nothing measured), then measure memory;
    ServeError where 02's fit no longer holds."""
    outcome.room = bringup.make_room(ctx, preview.plan)
    if outcome.room.args is not None:
        outcome.event("serve_args_checked", outcome.room.args)
        learned = bringup.args_learned(ctx, preview.plan, outcome.room.args)
        outcome.learned.extend([learned] if learned else [])
    if outcome.room.kept is not None:
        return
    outcome.before = memory.before_launch(ctx, preview.plan, model)
    outcome.event("memory_before_launch", outcome.before)
    memory.check_fit(outcome.before)


def _bring_up(ctx: Context, preview: ServePreview, outcome: ServeOutcome, serve_plan: ServePlan | None = None,
              keep: bool = True) -> BringUp:
    """Launch and wait (a progress bar over the ready timeout), with the remedies decided between attempts: the
    preview's plan, or blue-green's `serve_plan`, recorded as serving only with `keep`. Where this run's 04 stopped a
    live server with its containers, the cluster has served nothing since then."""
    before, room = outcome.before, outcome.room
    stopped_by_04 = preview.ray.stopped_server_at if preview.ray else None
    if room is not None and room.stopped_at is None and room.kept is None and stopped_by_04:
        room = dataclasses.replace(room, stopped_at=time.monotonic() - seconds_since(stopped_by_04))
    with Progress("serve ready (s of the timeout)", total=ctx.params.serve.ready_timeout_s) as bar:
        up = bringup.bring_up(ctx, serve_plan or preview.plan, on_round=bar.update, floor=preview.floor,
                              available=before.available if before else None, room=room, keep=keep)
    outcome.up = up
    if up.front_opened:
        outcome.event("front_place_started", {"place": ctx.front.name, "node": ctx.head.name, "image": ctx.front.image})
    if up.router_install is not None:
        outcome.event("router_installed", up.router_install.event())
    for change in up.decisions():
        outcome.decide(change)
    outcome.event("serve_attempts", up.table())
    if up.settles:
        outcome.event("serve_settle", settle_rows(up))
    return up


def _started(ctx: Context, preview: ServePreview, outcome: ServeOutcome, up: BringUp) -> None:
    """Keep every attempt's log tails; a failed start is a ServeError naming the cause, after a rollback to the
    replaced plan where one was replaced and serve.rollback_on_failure holds."""
    outcome.logs.update(bringup.log_tails(up))
    if up.ok:
        return
    failure = bringup.failure_message(up)
    if preview.ray is not None and preview.ray.stopped_server_at is not None:
        raise ServeError(failure + "; the containers this run's 04 replaced are kept aside: "
                         + ("the driver brings them back with the plan they served" if
                            ctx.params.serve.rollback_on_failure else "serve.rollback_on_failure is false"))
    if outcome.replaced is not None and ctx.params.serve.rollback_on_failure:
        back = rollback.relaunch_replaced(ctx, outcome.replaced, up, failure)
        outcome.rolled_back = back
        outcome.event("serve_rollback", back.event())
        outcome.decide(back.decision())
        outcome.logs.update(back.log_tails())
        failure = back.summary()
    raise ServeError(failure)


def _held(ctx: Context, outcome: ServeOutcome, up: BringUp) -> None:
    """A server this run started (memory was measured before its launch; a kept one was not): what it holds per
    node, measured and recorded beside it in the head's place (a blue-green one's before the old one stops)."""
    if outcome.before is None or outcome.held is not None:
        return
    outcome.held = memory.held(ctx, outcome.before)
    outcome.event("memory_held_by_server", outcome.held)
    reuse.record_held(ctx, up.launched.plan.commands[0].node, outcome.held)


def _serving_env(ctx: Context, outcome: ServeOutcome, up: BringUp) -> None:
    """Every serving process carries the env names params give its node; ServeError naming what lacks them."""
    outcome.found_env = environ.read(ctx, up.launched.plan)
    outcome.event("serving_env", outcome.found_env)
    environ.check(outcome.found_env)


def _smoke(ctx: Context, outcome: ServeOutcome, up: BringUp) -> None:
    """This run's smoke question (a reused server too) through the API; ServeError for an unusable reply."""
    running = up.launched.plan
    asked = running.settings.model_copy(update={"smoke": ctx.params.serve.smoke})
    outcome.decide(smoke.smoke_decision(asked))
    outcome.smoke = smoke.smoke_test(running.base_url, running.model, asked)
    outcome.event("smoke_test", outcome.smoke)
    smoke.check_smoke(outcome.smoke)


def _check_answers(ctx: Context, preview: ServePreview, outcome: ServeOutcome, up: BringUp) -> str | None:
    """The answers checked at depth (a reused server too: what serves is what is checked), and the reference key
    they passed against (06 checks again after its soak; None: not checked); ServeError naming the prompt and
    position where the answers are lost or disagree with this model and plan's reference."""
    running = up.launched.plan
    if not ctx.params.serve.quality.enabled:
        outcome.answers_off = True
        outcome.event("quality_check", {"checked": False, "why": "serve.quality.enabled is false"})
        return None
    asked = dataclasses.replace(running, settings=running.settings.model_copy(
        update={"quality": ctx.params.serve.quality, "smoke": ctx.params.serve.smoke}))
    key, reference = answers.reference_for(ctx, asked)
    outcome.decide(answers.decision(ctx, asked, preview.image.ref, reference, key))
    outcome.answers = answers.run_checks(ctx, asked, preview.image.ref, key, reference)
    outcome.event("quality_check", outcome.answers.event())
    answers.check_answers(outcome.answers, judged_by_ab=outcome.answers_judged_by_ab)
    return key
