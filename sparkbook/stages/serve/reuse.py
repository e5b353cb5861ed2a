"""05's reuse: what serves now is written into the head's container, so a later run keeps a server that was started
from exactly its plan and still answers, instead of stopping it only to start it again."""
from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass
from typing import Any

import httpx

from ...core.cluster.context import Context
from ...core.cluster.runtime import Spawned
from ...core.cluster.topology import SERVING
from ...core.values.evidence import Alternative, Decision, now
from ...core.values.params import ServeSettings
from . import front
from .commands import ServeCommand, ServePlan
from .launch import BringUp, Kept, Launch, Readiness, get, listed, log_path, router_log, tails
from .plandiff import differences


def plan_data(p: ServePlan) -> dict[str, Any]:
    """The plan as its JSON record has it (what a later run compares its own plan with)."""
    data: dict[str, Any] = json.loads(json.dumps({
        "executor": p.executor, "settings": p.settings.model_dump(mode="json"),
        "commands": [dataclasses.asdict(c) for c in p.commands], "base_url": p.base_url, "model": p.model,
        "model_dir": p.model_dir, **({"router": dataclasses.asdict(p.router)} if p.router else {})}))
    return data


def _plan_from(data: dict[str, Any]) -> ServePlan:
    return ServePlan(data["executor"], ServeSettings.model_validate(data["settings"]),
                     [ServeCommand(**c) for c in data["commands"]], data["base_url"], data["model"],
                     data.get("model_dir", ""), ServeCommand(**data["router"]) if data.get("router") else None)


@dataclass(frozen=True)
class Serving:
    """What the head's container says serves there: the plan asked for, the one running after remedies, and the
    run that started it (None in records older than that field)."""

    requested: dict[str, Any]  # as plan_data has it: what a later run's plan is compared with
    running: ServePlan
    attempt: int
    attempts: int
    ready_s: float
    run: str | None
    since: str | None

    @property
    def requested_plan(self) -> ServePlan:
        return _plan_from(self.requested)


def read_serving(ctx: Context, head: str) -> Serving | None:
    """The head container's record of what serves (None when there is no container or no record)."""
    if not ctx.runtime.alive(ctx.cluster.nodes[head], ctx.places[head]):
        return None
    try:
        record = json.loads(ctx.runtime.read(ctx.cluster.nodes[head], ctx.places[head], SERVING))
    except ValueError:
        return None
    return Serving(record["requested"], _plan_from(record["running"]), record["attempt"], record["attempts"],
                   record["ready_s"], record.get("run"), record.get("since"))


def remember(ctx: Context, requested: ServePlan, result: BringUp, run: str | None = None) -> None:
    """Write what serves now (the plan asked for, the one running after remedies, the run whose plan it is:
    this one unless `run` names the one a rollback relaunched) into the head's container."""
    head = requested.commands[0].node
    record = {"requested": plan_data(requested), "running": plan_data(result.launched.plan),
              "attempt": result.launched.attempt, "attempts": len(result.attempts),
              "ready_s": round(result.readiness.seconds, 1), "run": run or ctx.run_dir.name, "since": now()}
    _write(ctx, head, record)


def _write(ctx: Context, head: str, record: dict[str, Any]) -> None:
    """The head place's record of what serves, replaced whole."""
    ctx.runtime.exec(ctx.cluster.nodes[head], ctx.places[head],
                     ["sh", "-c", 'printf %s "$1" >"$0"', SERVING, json.dumps(record)], timeout=30).check()


def record_held(ctx: Context, head: str, held: dict[str, int]) -> None:
    """Add to the head's record of what serves what 05 measured the server holding per node (topology.live_server
    reads it for 02's fit)."""
    record = json.loads(ctx.runtime.read(ctx.cluster.nodes[head], ctx.places[head], SERVING))
    _write(ctx, head, {**record, "held": held})


def find_running(ctx: Context, requested: ServePlan) -> tuple[BringUp | None, str]:
    """The server a previous run started, when it is still right: started from this very plan, every node's
    `vllm serve` running, /health and /v1/models answering. Otherwise None and why not."""
    head, where = requested.commands[0].node, ctx.places
    record = read_serving(ctx, head)
    if record is None:
        return None, f"no server recorded in {head}'s container ({SERVING}), or no container"
    changed = differences(record.requested, plan_data(requested))
    if changed:
        fields = sorted({d.field.split("[")[0].split(".env")[0] for d in changed})
        return None, f"the running server was started from another plan (differs in: {', '.join(fields)})"
    running = record.running
    spawned = {c.node: Spawned(c.node, where[c.node].name, log_path(record.attempt, front.slot_of(running)))
               for c in running.commands}
    dead = [n for n, sp in spawned.items() if not ctx.runtime.running(ctx.cluster.nodes[n], where[n], sp)]
    if dead:
        return None, f"the earlier `vllm serve` is not running on {', '.join(dead)}"
    router = Spawned(ctx.head.name, front.place(ctx, running).name, router_log(running, record.attempt)) \
        if running.router else None
    if router is not None and not front.runs(ctx, running, router):
        return None, f"the earlier router is not running in {router.place} on {router.node}"
    with httpx.Client(timeout=httpx.Timeout(10.0, connect=3.0), headers=running.settings.headers()) as client:
        health, models = get(client, f"{running.base_url}/health"), listed(client, running.base_url)
    if health is None or health.status_code != 200 or running.model not in models:
        return None, f"the earlier server does not answer /health with {running.model} listed at {running.base_url}"
    launched = Launch(running, record.attempt, spawned, time.monotonic(), router)
    ready = Readiness(True, 0.0, 0.0, models, tails(ctx, launched))
    return BringUp([(launched, ready)], reuse=Decision(
        "Reuse the running server or start a new one?", "reused: the server already running",
        "it was started from exactly this plan (same commands, settings and environment), every node's `vllm serve` "
        "still runs, and it answers /health with the model listed",
        [Alternative("start vllm serve again", "would stop a healthy server of the same model and configuration")],
        [f"{running.base_url}/health: 200", f"/v1/models: {', '.join(models)}",
         f"started by run {record.run} at attempt {record.attempt}, ready then in {record.ready_s} s"]),
        reused_from=Kept(record.attempt, record.attempts, record.ready_s)), ""


def start_decision(why: str) -> Decision:
    return Decision("Reuse the running server or start a new one?", "start vllm serve", why,
                    [Alternative("reuse the running server", why)])

