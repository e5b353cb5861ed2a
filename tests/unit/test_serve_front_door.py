"""05's front door: the branches that lived in the notebook's cells (replace, kept server, rollback) and the order
of the evidence `serve.run` returns, with the stage's own steps replaced by values (no node is reached), and the
room made once for both the memory measure and the bring-up (issue 39)."""
from __future__ import annotations

import json
import time
from datetime import UTC, datetime
from pathlib import Path

import pytest

from sparkbook.core.cluster import probes
from sparkbook.core.cluster.context import Context
from sparkbook.core.cluster.nodes import Cluster, Result
from sparkbook.core.cluster.qualityapi import QualityReport
from sparkbook.core.values.abarm import replaces_own_arm
from sparkbook.core.values.errors import SparkbookError
from sparkbook.core.values.evidence import Decision, Event, NotKnownYet
from sparkbook.core.values.handoff import Diagnosis, Endpoint, ImageChoice, RayCluster
from sparkbook.core.values.modelinfo import ModelFacts
from sparkbook.core.values.params import Params
from sparkbook.core.values.stagelist import SERVE
from sparkbook.stages import serve
from sparkbook.stages.serve import answers, bringup, commands, environ, launch, memory, replace, reuse, rollback, smoke
from sparkbook.stages.serve.bringup import Room
from sparkbook.stages.serve.failures import classify
from sparkbook.stages.serve.plandiff import differences
from sparkbook.stages.serve.reuse import Serving, plan_data

PARAMS = Path(__file__).resolve().parents[2] / "params"
CPU = commands.Platform("cpu", "0.32.0+cpu", "2.13.0+cpu", 0, "2.60.0")
FACTS = ModelFacts(architectures=["LlamaForCausalLM"], model_type="llama", dtype="bfloat16", quantization=None,
                   bytes_per_param=2.0, total_params=10**6, active_params=10**6, weight_bytes=2 * 10**6,
                   weight_source="safetensors files", num_layers=2, kv_bytes_per_token=1024, kv_latent=False,
                   dir_on_nodes="/srv/models/tiny")
DIAGNOSIS = Diagnosis(findings=[], question_for_03="", installed_image=None)
REAL_BRING_UP = bringup.bring_up


def context(params: Params, tmp_path: Path) -> Context:
    return Context(params, None, None, tmp_path)  # type: ignore[arg-type]  # every node operation is replaced


def a_preview(ctx: Context, replacing: bool = False, model: bool = True) -> serve.ServePreview:
    """The lab's preview as `serve.preview` builds it, without asking the image (its platform given)."""
    imaged = ctx.with_image("img")
    executor, decision = commands.choose_executor(imaged, CPU)
    plan = commands.plan(imaged, executor, model_dir=FACTS.dir_on_nodes if model else "")
    running = commands.plan(imaged, executor, imaged.params.serve.model_copy(update={"max_num_seqs": 4}))
    serving = Serving(plan_data(running), running, 1, 1, 41.5, "20261201T195946Z", "2026-12-01T19:59:46Z")
    live = replace.Replacement(serving, differences(serving.requested, plan_data(plan))) if replacing else None
    return serve.ServePreview(ImageChoice(ref="img", id=None, vllm_version=None, ray_version=None, nodes={}),
                              None, FACTS if model else None, DIAGNOSIS if model else None, CPU, executor, decision,
                              plan, None, live, "/srv/sparkbook-cache/lab")


def up_with(plan: commands.ServePlan, ready: bool) -> launch.BringUp:
    logs = {"lab-0": "INFO ready" if ready else "torch.OutOfMemoryError: CUDA out of memory"}
    readiness = launch.Readiness(ready, 5.0, 1.0 if ready else None, [plan.model] if ready else [], logs,
                                 None if ready else classify(logs))
    return launch.BringUp([(launch.Launch(plan, 1, {}, 0.0), readiness)], reuse=None, stopped_at=0.0)


def steps(monkeypatch, ready: bool = True, room: Room | None = None) -> list[str]:
    """The stage's steps replaced by values; the list names each step as it is called."""
    called: list[str] = []

    def make_room(ctx, plan):
        called.append("make_room")
        return room or Room(None, "nothing serving", 0.0)

    def bring_up(ctx, plan, on_round, floor, available, room, keep=True):
        called.append("bring_up")
        return up_with(plan, ready)

    monkeypatch.setattr(bringup, "make_room", make_room)
    monkeypatch.setattr(memory, "before_launch", lambda ctx, plan, model: memory.BeforeLaunch({"lab-0": 2**30}, []))
    monkeypatch.setattr(bringup, "bring_up", bring_up)
    monkeypatch.setattr(memory, "held", lambda ctx, before: called.append("held") or {"lab-0": 2**29})
    monkeypatch.setattr(reuse, "record_held", lambda ctx, head, held: called.append(f"record_held {head}"))
    monkeypatch.setattr(environ, "read", lambda ctx, plan: [])
    monkeypatch.setattr(smoke, "smoke_test", lambda url, model, asked: [smoke.Smoke("chat", "Say hello.", "hi", 1.0, 2)])
    monkeypatch.setattr(bringup, "drop_aside", lambda ctx: called.append("drop_aside") or {"nodes": ["lab-0"]})
    monkeypatch.setattr(answers, "run_checks", lambda ctx, plan, image, key, reference: answers.AnswerChecks(
        QualityReport(key, 2048, "serve.smoke.expect is null", [], None, [], [], 1.0), None, None, None))
    return called


def kinds(outcome: serve.ServeOutcome) -> list[str]:
    return [r.kind if isinstance(r, Event) else f"decision:{r.key or r.question}" for r in outcome.records]


def test_a_live_server_of_another_plan_is_not_replaced_unconfirmed_and_nothing_stops(lab, tmp_path, monkeypatch):
    called = steps(monkeypatch)
    ctx = context(lab, tmp_path)
    out = serve.run(ctx, a_preview(ctx, replacing=True), confirm_replace=False, ab_arm=None)
    assert isinstance(out.error, commands.ServeError) and "left untouched" in out.error.message
    assert called == [] and kinds(out) == ["decision:executor"], "the executor decision, then the refusal"
    assert out.handoffs == [] and "stopped at or before" in str(out.memory_shown()[0].value)


@pytest.mark.parametrize("ab_arm", ["speculative", "kept"])
def test_the_ab_arms_own_replacement_needs_no_confirmation_and_every_step_is_recorded_in_order(
        lab, tmp_path, monkeypatch, ab_arm):
    called = steps(monkeypatch)
    ctx = context(lab, tmp_path)
    out = serve.run(ctx, a_preview(ctx, replacing=True), confirm_replace=False, ab_arm=ab_arm)
    assert out.error is None and called == ["make_room", "bring_up", "held", "record_held lab-0"]
    assert kinds(out) == ["decision:executor", "serve_replaced", "decision:replace", "memory_before_launch",
                          "serve_attempts", "memory_held_by_server", "serving_env", "decision:What must the smoke test's chat reply hold?",
                          "smoke_test", "decision:quality", "quality_check"]
    replaced = next(r for r in out.records if isinstance(r, Decision) and r.key == "replace")
    assert replaced.reason.startswith("the A/B's arm before this one serves it") and out.ab_next
    (endpoint,) = out.handoffs
    assert isinstance(endpoint, Endpoint) and endpoint.attempts == 1 and endpoint.ready_s == 5.0
    assert list(out.logs) == ["serve-lab-0-attempt1.log"]
    assert out.summary_shown()[0].value["smoke test"] == "passed: chat"  # type: ignore[index]


def test_a_kept_server_is_not_measured_and_the_bring_up_does_not_ask_the_nodes_again(lab, tmp_path, monkeypatch):
    ctx = context(lab, tmp_path)
    p = a_preview(ctx)
    kept = up_with(p.plan, ready=True)
    steps(monkeypatch, room=Room(kept, None, None))
    monkeypatch.setattr(bringup, "bring_up", REAL_BRING_UP)  # with the room make_room made
    monkeypatch.setattr(bringup, "lost", lambda *a, **kw: {})
    for name in ("find_running", "stop_earlier", "refuse_missing_files", "port_taken", "launch"):
        monkeypatch.setattr(bringup, name, lambda *a, n=name: pytest.fail(f"{n} after make_room kept the server"))
    monkeypatch.setattr(memory, "before_launch", lambda *a: pytest.fail("a kept server's memory measured"))
    out = serve.run(ctx, p, confirm_replace=False, ab_arm=None)
    assert out.error is None and out.up is kept and out.before is None
    assert "memory_before_launch" not in kinds(out)
    assert "kept, nothing is launched or measured" in str(out.memory_shown()[0].value)


def test_the_room_is_made_once_for_the_measure_and_the_launch(lab, tmp_path, monkeypatch):
    """make_room's find_running, refuse_missing_files and stop_earlier are not fanned out again by bring_up."""
    ctx = context(lab, tmp_path).with_image("img")
    plan = commands.plan(ctx, "mp")
    asked: list[str] = []
    monkeypatch.setattr(bringup, "find_running", lambda *a: asked.append("find_running") or (None, "nothing"))
    monkeypatch.setattr(bringup, "refuse_missing_files", lambda *a: asked.append("refuse_missing_files"))
    monkeypatch.setattr(bringup, "stop_earlier", lambda *a: asked.append("stop_earlier"))
    for name, value in (("lost", {}), ("port_taken", None), ("remember", None), ("read_serving", None)):
        monkeypatch.setattr(bringup, name, lambda *a, v=value, **kw: v)
    monkeypatch.setattr(bringup, "launch", lambda ctx, plan, attempt: launch.Launch(plan, attempt, {}, 0.0))
    monkeypatch.setattr(bringup, "wait_ready", lambda *a: launch.Readiness(True, 3.0, 1.0, [plan.model], {}))
    room = bringup.make_room(ctx, plan)
    up = bringup.bring_up(ctx, plan, room=room)
    assert up.ok and asked == ["find_running", "refuse_missing_files", "stop_earlier"]
    assert up.stopped_at == room.stopped_at and up.reuse is not None and up.reuse.reason == "nothing"
    asked.clear()
    assert bringup.bring_up(ctx, plan).ok and asked == ["find_running", "refuse_missing_files", "stop_earlier"]


@pytest.mark.parametrize("address, checks_ray", [(None, False), ("10.0.0.1:6379", True), ("no hand-off", True)])
def test_bring_up_checks_ray_unless_04_formed_none(lab, tmp_path, monkeypatch, address, checks_ray):
    """A Ray that 04 formed and that died is a broken cluster even where mp serves (issue 45: only 04's record of
    forming no Ray leaves it out); a context without 04's hand-off checks it, as 04 always formed Ray before."""
    ctx = context(lab, tmp_path).with_image("img")
    if address != "no hand-off":
        ctx = ctx.with_handoffs(RayCluster(address=address, containers={"lab-0": "c0", "lab-1": "c1"}, reused=False,
                                           container_ids={}, nodes=[]))
    asked: list[bool] = []
    monkeypatch.setattr(bringup, "lost", lambda *a, ray: asked.append(ray) or {"lab-0": "the Ray head is not running"})
    with pytest.raises(commands.ServeError, match="the cluster of 04 is broken: lab-0: the Ray head"):
        bringup.bring_up(ctx, commands.plan(ctx, "mp"))
    assert asked == [checks_ray]


def test_where_a_server_runs_its_stop_waits_for_the_image_s_vllm_to_accept_the_argv(lab, tmp_path, monkeypatch):
    """Issue 40, item 6: the argv vLLM refuses ends 05 before the running server stops (0 s without service)."""
    ctx = context(lab, tmp_path).with_image("img")
    plan = commands.plan(ctx, "mp")
    asked: list[str] = []
    serving = Serving(plan_data(plan), plan, 1, 1, 41.5, "20261201T195946Z", "2026-12-01T19:59:46Z")
    monkeypatch.setattr(bringup, "find_running", lambda *a: (None, "another plan"))
    monkeypatch.setattr(bringup, "refuse_missing_files", lambda *a: None)
    monkeypatch.setattr(bringup, "read_serving", lambda *a: serving)
    monkeypatch.setattr(bringup, "answers", lambda s: s is serving)  # the recorded server still answers /health
    monkeypatch.setattr(bringup, "stop_earlier", lambda *a: asked.append("stop_earlier"))
    monkeypatch.setattr(bringup, "check_args", lambda ctx, p: asked.append("check_args") or bringup.ArgsCheck(
        {"lab-0": "vllm: error: unrecognized arguments: --planted"}, None, 2.0))
    with pytest.raises(commands.ServeError, match="refuses the new `vllm serve` arguments on lab-0: vllm: error: "
                       "unrecognized arguments: --planted .*it still serves"):
        bringup.make_room(ctx, plan)
    assert asked == ["check_args"], "nothing stopped"
    monkeypatch.setattr(bringup, "check_args", lambda ctx, p: asked.append("check_args") or bringup.ArgsCheck(
        {}, None, 2.0))
    asked.clear()
    room = bringup.make_room(ctx, plan)
    assert asked == ["check_args", "stop_earlier"] and room.args is not None and room.stopped_at is not None


def test_a_failed_start_after_a_replacement_rolls_back_and_fails_with_its_summary(lab, tmp_path, monkeypatch):
    steps(monkeypatch, ready=False)
    ctx = context(lab, tmp_path)
    p = a_preview(ctx, replacing=True)
    assert p.replacing is not None

    def relaunch_replaced(ctx, replaced, failed, failure):
        relaunch = launch.Launch(replaced.serving.running, 1, {}, 0.0)
        ready = launch.Readiness(True, 4.0, 1.0, [p.plan.model], {"lab-0": "old plan up"})
        return rollback.Rollback(replaced.serving.run, failure, relaunch, ready, [], 9.0, None)

    monkeypatch.setattr(rollback, "relaunch_replaced", relaunch_replaced)
    out = serve.run(ctx, p, confirm_replace=True, ab_arm=None)
    assert isinstance(out.error, commands.ServeError) and out.rolled_back is not None
    assert out.error.message == out.rolled_back.summary() and "rolled back to run 20261201T195946Z" in str(out.error)
    assert kinds(out)[-3:] == ["serve_attempts", "serve_rollback", "decision:rollback"]
    assert list(out.logs) == ["serve-lab-0-attempt1.log", "serve-lab-0-rollback.log"]
    assert out.handoffs == [] and "stopped at or before" in str(out.env_shown()[0].value)


def test_a_failed_start_without_a_replacement_names_the_cause(lab, tmp_path, monkeypatch):
    steps(monkeypatch, ready=False)
    monkeypatch.setattr(rollback, "relaunch_replaced", lambda *a: pytest.fail("rolled back with nothing replaced"))
    ctx = context(lab, tmp_path)
    out = serve.run(ctx, a_preview(ctx), confirm_replace=False, ab_arm=None)
    assert isinstance(out.error, commands.ServeError)
    assert out.error.message.startswith("serving did not start (1 attempt(s)): ")
    assert kinds(out)[-1] == "serve_attempts" and out.rolled_back is None


def test_a_failed_start_in_containers_04_replaced_leaves_the_rollback_to_the_driver(lab, tmp_path, monkeypatch):
    """Issue 40, item 1: the old server's containers wait aside; 05 neither relaunches in the new ones nor drops
    them: its error says the driver brings them back."""
    import dataclasses

    from sparkbook.core.values.handoff import RayCluster

    called = steps(monkeypatch, ready=False)
    monkeypatch.setattr(rollback, "relaunch_replaced", lambda *a: pytest.fail("05 relaunched the old plan itself"))
    ctx = context(lab, tmp_path)
    ray = RayCluster(address="10.0.0.1:6379", containers={}, reused=False, container_ids={}, nodes=[],
                     stopped_server_at="2026-12-04T10:00:00+00:00")
    out = serve.run(ctx, dataclasses.replace(a_preview(ctx), ray=ray), confirm_replace=True, ab_arm=None)
    assert isinstance(out.error, commands.ServeError) and "kept aside" in out.error.message
    assert "the driver brings them back" in out.error.message and "drop_aside" not in called


def test_a_run_without_02s_hand_offs_stops_naming_them(lab, tmp_path, monkeypatch):
    """The preview goes without them (model dir params' own, floor unknown: it says so); the run needs them."""
    called = steps(monkeypatch)
    ctx = context(lab, tmp_path)
    p = a_preview(ctx, model=False)
    assert "floor unknown" in p.commands_title() and "params' own" in p.commands_title()
    out = serve.run(ctx, p, confirm_replace=False, ab_arm=None)
    assert isinstance(out.error, SparkbookError) and "diagnosis" in str(out.error) and called == []


def test_the_ab_arms_after_the_baseline_replace_their_own() -> None:
    arms = (None, "baseline", "speculative", "replicas", "candidate", "kept")
    assert [replaces_own_arm(a) for a in arms] == [False, False, True, True, True, True]


def test_where_04_stopped_the_live_server_with_its_containers_the_dark_counts_from_then(lab, tmp_path, monkeypatch):
    """Issue 40, item 7: a new image or env makes 04 replace the places that held the server; 05 then finds nothing
    to stop, yet the cluster has served nothing since 04's stop: seconds without service count from there."""
    import dataclasses
    from datetime import UTC, datetime, timedelta

    from sparkbook.core.values.handoff import RayCluster

    called = steps(monkeypatch, room=Room(None, "nothing serving", None))
    seen: list[Room] = []
    monkeypatch.setattr(bringup, "bring_up", lambda ctx, plan, on_round, floor, available, room, keep=True: seen.append(room)
                        or up_with(plan, True))
    ctx = context(lab, tmp_path)
    stopped = (datetime.now(UTC) - timedelta(seconds=30)).isoformat(timespec="seconds")
    ray = RayCluster(address="10.0.0.1:6379", containers={}, reused=False, container_ids={}, nodes=[],
                     stopped_server_at=stopped)
    out = serve.run(ctx, dataclasses.replace(a_preview(ctx), ray=ray), confirm_replace=False, ab_arm=None)
    (room,) = seen
    assert out.error is None and called[0] == "make_room" and room.stopped_at is not None
    assert 29 <= time.monotonic() - room.stopped_at <= 40
    assert called[-1] == "drop_aside" and kinds(out)[-1] == "containers_dropped", "the kept containers go last"
    seen.clear()
    called.clear()
    serve.run(ctx, a_preview(ctx), confirm_replace=False, ab_arm=None)
    assert seen[0].stopped_at is None, "nothing was serving: no dark seconds"
    assert "drop_aside" not in called, "04 set nothing aside"


class Asked:
    """The runtime's verbs detect_platform uses, answered in-process: the head's place runs or not, the head holds
    the image or not; each call named in `calls`."""

    def __init__(self, alive: bool, held: bool = True) -> None:
        self.is_alive, self.held = alive, held
        self.calls: list[str] = []

    def alive(self, node, place) -> bool:
        return self.is_alive

    def lacks(self, node, ref, image_id=None) -> str | None:
        return None if self.held else f"holds no {ref} (absent; expected any)"

    def _reply(self, node, argv, verb: str) -> Result:
        self.calls.append(verb)
        doc = json.dumps({"vllm": "0.28.0+cpu", "ray": "2.60.0", "torch": "2.13.0+cpu", "cuda": False, "gpus": 0})
        return Result(node.name, tuple(argv), 0, f"{probes.PREFIX}{doc}\n{probes.END}\n", "", datetime.now(UTC), 0.1)

    def exec(self, node, place, argv, *, timeout=120, env=None) -> Result:
        return self._reply(node, argv, f"exec in {place.name}")

    def one_off(self, node, image, argv, *, env=None, timeout=120, gpus=False) -> Result:
        return self._reply(node, argv, f"one_off of {image}")


def asked(lab: Params, tmp_path: Path, runtime: Asked) -> Context:
    return Context(lab, Cluster(lab), runtime, tmp_path).with_image("sparkbook-lab/vllm-cpu:0.28.0")  # type: ignore[arg-type]


def test_the_platform_is_asked_in_04s_place_else_in_a_throwaway_container_of_the_image(lab, tmp_path) -> None:
    """Issue 54, item 6: `sparkbook plan` before a first run (04's place does not run) learns the platform as 03's
    probes do, in a fresh container of the image, so 05's commands are shown; in a run, in 04's place."""
    runtime = Asked(alive=True)
    platform = commands.detect_platform(asked(lab, tmp_path, runtime))
    assert runtime.calls == ["exec in sparkbook-lab-lab-0"] and platform.device == "cpu" and platform.ray == "2.60.0"
    assert platform.asked == "in sparkbook-lab-lab-0"
    runtime = Asked(alive=False)
    platform = commands.detect_platform(asked(lab, tmp_path, runtime))
    assert runtime.calls == ["one_off of sparkbook-lab/vllm-cpu:0.28.0"] and platform.device == "cpu"
    assert platform.asked is not None and platform.asked.startswith("in a throwaway container of sparkbook-lab/")


def test_an_image_the_head_lacks_leaves_the_platform_not_known_yet(lab, tmp_path) -> None:
    runtime = Asked(alive=False, held=False)
    with pytest.raises(NotKnownYet, match="lab-0 holds no sparkbook-lab/vllm-cpu:0.28.0") as raised:
        commands.detect_platform(asked(lab, tmp_path, runtime))
    assert runtime.calls == [] and raised.value.stage == SERVE.name


def test_the_answer_checks_return_the_reference_they_make_and_the_session_keeps_it(lab, tmp_path, monkeypatch):
    from sparkbook.core.analysis.quality import Trace
    from sparkbook.core.cluster import qualityapi
    from sparkbook.runbook.session import Run

    trace = Trace("story", [1, 2, 3], [10, 11], [-0.1, -0.2])
    monkeypatch.setattr(answers, "check", lambda url, model, settings, key, reference, tokens: QualityReport(
        key, 2048, "serve.smoke.expect is null", [], reference, [], [] if reference else [trace], 1.0))
    run_dir = tmp_path / "lab" / "20261207T000000Z"
    ctx = context(lab, run_dir)
    plan = a_preview(ctx).plan
    made = answers.run_checks(ctx, plan, "img:1", "abc", None)
    assert made.problem is None and made.new_reference is not None and made.new_reference.traces == [trace]
    assert made.recorded == tmp_path / "lab" / "quality" / "abc.json" and not made.recorded.exists(), \
        "the stage writes nothing: it returns the reference"
    run = Run(tmp_path / "lab.yaml", lab, run_dir, "05-serve")
    assert run.keep_reference(serve.ServeOutcome(answers=made).new_reference) == made.recorded
    assert qualityapi.load_reference(run_dir.parent / "20261208T000000Z", "abc") == made.new_reference, \
        "a later run of the cluster finds it"
    again = answers.run_checks(ctx, plan, "img:1", "abc", made.new_reference)
    assert (again.new_reference, again.recorded) == (None, None), "one exists: none is made"
    assert run.keep_reference(serve.ServeOutcome(answers=again).new_reference) is None
