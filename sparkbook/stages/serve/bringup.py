"""05's bring-up: refuse what cannot work before loading a model (04's Ray cluster broken, the serve port taken,
the chat template missing), keep a server that already serves this plan, else launch and wait, and retry once
per known remediation; what 06 is handed."""
from __future__ import annotations

import dataclasses
import hashlib
import json
import time
from collections.abc import Callable
from dataclasses import dataclass

from ...core.cluster import imagememo, probes
from ...core.cluster.context import Context
from ...core.cluster.nodes import Node
from ...core.cluster.topology import lost
from ...core.values.errors import ProbeOutputError
from ...core.values.handoff import Endpoint, ImageChoice, RayCluster
from ...core.values.learned import SERVE_ARGS, Learned, memo_key
from ...core.values.params import ServeSettings
from . import front, replicas, router
from .commands import ServeError, ServePlan, plan
from .endpoints import ClientAddress
from .failures import FailureCause, classify, remedy
from .launch import (
    ROUTER,
    BringUp,
    address,
    host_port,
    launch,
    log_path,
    replica_urls,
    router_log,
    standing_front,
    stop_earlier,
    stop_serving,
    wait_ready,
)
from .memory import settle
from .replace import answers
from .reuse import Serving, find_running, read_serving, remember, start_decision


def port_taken(ctx: Context, serve_plan: ServePlan) -> FailureCause | None:
    """The classified cause when something already listens on a serve address (the head's serve port; with
    replicas, each node's replica port too), else None: found before launching (vLLM itself reports it only after
    loading the model, minutes on a loaded node)."""
    host = str(serve_plan.settings.host)  # where vLLM will bind: 0.0.0.0 collides with a listener on any address
    kept_front = standing_front(ctx, serve_plan) is not None  # the front's own port: it stays and answers there
    wanted = [] if kept_front else [(serve_plan.commands[0].node, host_port(serve_plan)[1])]
    wanted += [(node, address(url)[1]) for node, url in replica_urls(serve_plan).items()]  # behind a router
    for node, port in wanted:
        r = ctx.runtime.exec(ctx.cluster.nodes[node], ctx.place(node),
                             ["python3", "-c", probes.source("bind"), host, port], timeout=30)
        try:
            bound = probes.parse(r, node=node, probe=f"bind {host}:{port}")
        except ProbeOutputError:
            continue  # no whole answer: the launch reports what is wrong
        if not bound["bound"] and "Errno 98" in bound["error"]:
            return classify({node: f"{host}:{port}: {bound['error']}"})
    return None


def named_paths(settings: ServeSettings) -> list[tuple[str, str, str]]:
    """What params name on the serving nodes, as (field, path, `test` flag): serve.chat_template, a file;
    serve.speculative.model, the draft's directory."""
    draft = settings.speculative.model if settings.speculative else None
    return [(field, path, flag) for field, path, flag in (("serve.chat_template", settings.chat_template, "-f"),
                                                          ("serve.speculative.model", draft, "-d")) if path]


def lacking(ctx: Context, serve_plan: ServePlan, path: str, flag: str) -> list[str]:
    """The serving nodes on which `test FLAG PATH` fails in the node's container (or that do not answer)."""
    nodes, where = [ctx.cluster.nodes[c.node] for c in serve_plan.commands], ctx.places

    def there(n: Node) -> bool:
        return ctx.runtime.exec(n, where[n.name], ["test", flag, path], timeout=30).ok
    return [n for n, o in ctx.cluster.fan_out(there, nodes, timeout=60).items() if not (o.ok and o.value)]


def missing_on_nodes(ctx: Context, serve_plan: ServePlan) -> dict[str, str]:
    """Each named path (named_paths) that is not there as a serving node's container sees it: its field -> the
    nodes that lack it. vLLM would report either only after loading the model."""
    return {field: ", ".join(nodes) for field, path, flag in named_paths(serve_plan.settings)
            if (nodes := lacking(ctx, serve_plan, path, flag))}


def refuse_missing_files(ctx: Context, serve_plan: ServePlan) -> None:
    """ServeError naming each field and the nodes where its file or directory is not (vLLM would say so after the
    load)."""
    missing = missing_on_nodes(ctx, serve_plan)
    if not missing:
        return
    raise ServeError("; ".join(f"{field}: {path} is not {'a file' if flag == '-f' else 'a directory'} where "
                               f"`vllm serve` runs on {missing[field]}"
                               for field, path, flag in named_paths(serve_plan.settings) if field in missing),
                     node=next(iter(missing.values())).split(", ")[0],
                     remediation=f"put it on every node under model.cache_dir ({ctx.params.model.cache_dir}, which "
                                 "the node containers mount at the same path) or correct the field")


@dataclass(frozen=True)
class ArgsCheck:
    """The image's own vLLM asked whether it accepts each node's argv (probes/serve_args.py): what it refused, or
    why it could not be asked (then the launch tells, as before); `recalled`: the record's line where an earlier run's
    answer for this image ID and these argvs stands for it (nothing was asked)."""

    refused: dict[str, str]  # node -> vLLM's own words
    why_unchecked: str | None
    seconds: float
    recalled: str | None = None


ARGS_TIMEOUT_S = 180  # importing vLLM's CLI takes 5-20 s on a GPU node, longer on a loaded lab


def _serving_image_id(ctx: Context) -> str | None:
    """The ID of the image the head's place runs (03's choice as 04 started it); None: no image ID (an environment's
    identity is its vLLM version alone, too weak to stand for its parser)."""
    chosen = ctx.handoffs.get(ImageChoice)
    image_id = (chosen.nodes.get(ctx.head.name) or chosen.id) if chosen else None
    return image_id if image_id and image_id.startswith("sha256:") else None


def _args_parts(serve_plan: ServePlan) -> dict[str, str]:
    """What the argv check's answer depends on besides the image: the argvs and the probe's code."""
    code = hashlib.sha256(probes.source("serve_args").encode()).hexdigest()[:16]
    return {"argvs": json.dumps([[c.node, *c.argv[1:]] for c in serve_plan.commands]), "probe": code}


def args_learned(ctx: Context, serve_plan: ServePlan, checked: ArgsCheck) -> Learned[ArgsCheck] | None:
    """The check's answer to keep by the image's ID (a later run with the same image and argvs reads it back): only
    one asked now, and answered (an unchecked one tells nothing of the image)."""
    image_id = _serving_image_id(ctx)
    if checked.recalled is not None or checked.why_unchecked is not None or image_id is None:
        return None
    return Learned(SERVE_ARGS, image_id, memo_key(SERVE_ARGS, image_id, _args_parts(serve_plan)), checked)


def check_args(ctx: Context, serve_plan: ServePlan) -> ArgsCheck:
    """Parse every serving node's `vllm serve` argv with the vLLM of the head's place (the image that will serve),
    as its CLI would before it loads anything; where an earlier run kept the answer for this image ID and these
    argvs (core.cluster.imagememo), that answer, said so."""
    kept, _ = imagememo.recall(ctx.run_dir, SERVE_ARGS, _serving_image_id(ctx), _args_parts(serve_plan), ArgsCheck)
    if kept is not None:
        return dataclasses.replace(kept.value, recalled=kept.line("the image's `vllm serve` argument check"))
    head, t0 = serve_plan.commands[0].node, time.monotonic()
    argvs = [c.argv[1:] for c in serve_plan.commands]  # without "vllm": the parser's own argv
    r = ctx.runtime.exec(ctx.cluster.nodes[head], ctx.place(head),
                         ["python3", "-c", probes.source("serve_args"), json.dumps(argvs)], timeout=ARGS_TIMEOUT_S)
    try:
        answer = probes.parse(r, node=head, probe="vllm serve argument check")
    except ProbeOutputError as exc:
        return ArgsCheck({}, str(exc), time.monotonic() - t0)
    refused = {c.node: why for c, why in zip(serve_plan.commands, answer["refused"], strict=False) if why}
    return ArgsCheck(refused, answer["why_unchecked"] or None, time.monotonic() - t0)


def refuse_before_stop(ctx: Context, serve_plan: ServePlan, serving: Serving) -> ArgsCheck:
    """What is knowable before the server `serving` records stops: the argv vLLM refuses and a new serve port
    already held (the old server's own port is freed by its stop). ServeError with the old server untouched."""
    checked = check_args(ctx, serve_plan)
    if checked.refused:
        node, why = next(iter(checked.refused.items()))
        raise ServeError(f"the image's vLLM refuses the new `vllm serve` arguments on {node}: {why} (checked before "
                         "the running server was stopped: it still serves)", node=node,
                         remediation="correct serve.extra_args or the serve setting it names in the params")
    if host_port(serving.running)[1] != host_port(serve_plan)[1] and standing_front(ctx, serve_plan) is None:
        taken = port_taken(ctx, serve_plan)
        if taken is not None:
            raise ServeError(f"the new serve port is taken: {taken.summary()} (the running server still serves)",
                             node=taken.node, remediation="free the port or choose another serve.port")
    return checked


@dataclass(frozen=True)
class Room:
    """What `make_room` found and did, handed on to `bring_up` so that neither asks the nodes twice: the server
    kept because it serves this plan (then nothing was stopped), or why none is kept and when the earlier one was
    stopped (the cluster has served nothing since)."""

    kept: BringUp | None
    why: str | None  # why no running server is kept; None when one is
    stopped_at: float | None  # monotonic time the server that ran was stopped; None: one is kept, or none ran
    args: ArgsCheck | None = None  # the argv check before a running server was stopped (None: none was recorded)
    drain_s: int | None = None  # the old servers were stopped drained behind the kept front, given at most this


def make_room(ctx: Context, serve_plan: ServePlan) -> Room:
    """Before 05 measures memory for a launch: where no running server can be kept for this plan, stop what
    earlier runs left serving (a replacement is confirmed by now), so that what is measured is what the new server
    will get, not what the old one holds. A kept server is not touched (nothing is launched, so nothing is
    measured). Raises ServeError, stopping nothing, when a file params name is missing on a serving node or, where a
    server runs, when the image's vLLM refuses the new argv or the new port is taken (refuse_before_stop)."""
    found, why = find_running(ctx, serve_plan)
    if found is not None:
        return Room(found, None, None)
    refuse_missing_files(ctx, serve_plan)  # before the stop: a refusal after it would leave the cluster dark
    serving = read_serving(ctx, serve_plan.commands[0].node)
    # only a server that answers loses anything to an argv its successor's vLLM refuses
    args = refuse_before_stop(ctx, serve_plan, serving) if serving is not None and answers(serving) else None
    stopped_at = time.monotonic() if serving is not None else None  # from here the cluster serves nothing
    drain_s = _front_for(ctx, serve_plan, serving)
    stop_earlier(ctx, ctx.params.serve.max_remedies + 1, drain_s)
    return Room(None, why, stopped_at, args, drain_s or None)


def _front_for(ctx: Context, serve_plan: ServePlan, serving: Serving | None) -> int:
    """Keep a standing front whose argv, servers it routes to now included (its own record), is the new plan's: it
    holds requests through the stop (and through 04's new node places, which it outlives) and routes to the new
    servers where the old ones were; else end it. The seconds the old servers may drain behind a kept front (0: no
    front kept, or they do not drain)."""
    standing = standing_front(ctx, serve_plan)
    if standing is None:
        return 0
    if serve_plan.router is None or front.routes(ctx) != serve_plan.router.argv:
        ctx.runtime.kill(ctx.head, ctx.front, standing)
        return 0
    return serve_plan.settings.drain_timeout_s if serving is not None and front.drains(serving.running) else 0


def bring_up(ctx: Context, serve_plan: ServePlan,
             on_round: Callable[[float, str], None] = lambda s, note: None, floor: float | None = None,
             available: dict[str, int] | None = None, room: Room | None = None, keep: bool = True) -> BringUp:
    """Launch and wait; on a failure with a known remediation (and serve.retry_with_remediation), stop the
    serve processes, apply it and try again (at most serve.max_remedies times). `floor` is the lowest
    gpu_memory_utilization that still holds weights and KV cache (`modelinfo.utilization_floor`; None: unknown,
    a graph-capture OOM goes straight to --enforce-eager). `available`: each serving node's MemAvailable before the
    first launch (memory.before_launch); after a failed attempt every node must come back within serve.settle_gib of
    it (memory.settle) or nothing more is tried. `room`: what `make_room` found and stopped before (None: make room
    here). Raises ServeError, launching nothing, when 04's cluster is no longer whole (a node's container is gone, or
    its Ray process where 04 formed Ray), the serve port is taken on the head or serve.chat_template is not
    there."""
    params = ctx.params
    formed = ctx.handoffs.get(RayCluster)  # its Ray is checked unless 04 recorded forming none
    gone = lost(params, ctx.cluster, ctx.runtime, ray=formed is None or formed.address is not None)
    if gone:
        raise ServeError("the cluster of 04 is broken: " + "; ".join(f"{n}: {why}" for n, why in gone.items()),
                         remediation="run 04 again to re-form it")
    room = room or make_room(ctx, serve_plan)
    if room.kept is not None:
        return room.kept
    result = BringUp(reuse=start_decision(room.why or ""), stopped_at=room.stopped_at)
    taken = port_taken(ctx, serve_plan)
    if taken is not None:
        raise ServeError(f"serving did not start: {taken.summary()}")
    if serve_plan.router is not None:
        result.front_opened = serve_plan.settings.front == "router" and front.open_place(ctx)
        result.router_install = router.ensure(ctx, front.place(ctx, serve_plan))
    current = serve_plan
    for attempt in range(1, params.serve.max_remedies + 2):
        launched = launch(ctx, current, attempt)
        ready = wait_ready(ctx, launched, params.serve.ready_timeout_s, on_round)
        result.attempts.append((launched, ready))
        if ready.ok:
            if keep:  # a blue-green server is written down as serving only once the front moved to it
                remember(ctx, serve_plan, result)
            return result
        stop_serving(ctx, launched)
        if available:
            result.settles.append(settle(ctx, available, attempt))
            if not result.settles[-1].ok:
                return result
        cause = ready.cause if params.serve.retry_with_remediation else None
        fix = remedy(cause, current.settings, floor) if cause else None
        if fix is None or attempt > params.serve.max_remedies:
            return result
        result.remedies.append(fix)
        current = layout_plan(ctx, current.executor, fix.settings, current.model_dir, front.drains(current),
                              front.slot_of(current))
    return result


def layout_plan(ctx: Context, executor: str, settings: ServeSettings, model_dir: str,
                drains: bool = False, slot: int = 0) -> ServePlan:
    """The commands of serve.layout: tp, one server split over the nodes; replicas, a whole copy on each node behind
    the router (the preview's plan, and each remedy's again in the layout it serves). `model_dir` is 02's snapshot
    of model.hf_id on the nodes ('' without 02); `drains`: the image's vLLM has --shutdown-timeout (behind the front
    its servers stop drained); `slot`: behind the front, which of the two server slots (front.backend_settings, and
    replicas.replica_settings for a copy per node)."""
    if settings.layout == "replicas":
        return replicas.plan(ctx.params, executor, settings, model_dir, slot, drains)
    if settings.front == "router":
        backend = plan(ctx, executor, front.backend_settings(settings, slot), model_dir)
        return front.behind(ctx.params, backend, settings, drains)
    return plan(ctx, executor, settings, model_dir)


def log_tails(result: BringUp) -> dict[str, str]:
    """Every attempt's log tail per node (and the router's), named for the run dir's logs/ folder."""
    return {(f"router-attempt{launched.attempt}.log" if node == ROUTER else
             f"serve-{node}-attempt{launched.attempt}.log"): text
            for launched, ready in result.attempts for node, text in ready.tails.items()}


def failure_message(result: BringUp) -> str:
    d = result.readiness.cause
    unsettled = result.settles[-1].problem() if result.settles else None
    return (f"serving did not start ({len(result.attempts)} attempt(s)): {d.summary() if d else 'unknown'}"
            + (f"; {unsettled}" if unsettled else ""))


def endpoint(result: BringUp, addresses: list[ClientAddress]) -> Endpoint:
    """What 06 needs: where to send requests (and the key's variable), exactly what was started where, and the
    address clients use on each network."""
    launched = result.launched
    return Endpoint(base_url=launched.plan.base_url, model=launched.plan.model, executor=launched.plan.executor,
                    api_key_env=launched.plan.settings.api_key_env,
                    addresses={a.network: a.url for a in addresses if a.not_listening is None},
                    commands={c.node: c.argv for c in launched.plan.commands},
                    env={c.node: c.env for c in launched.plan.commands},
                    logs={n: s.log for n, s in launched.spawned.items()},
                    router=launched.plan.router.argv if launched.plan.router else None,
                    router_log=launched.router.log if launched.router else None,
                    front=launched.router is not None and launched.plan.settings.front == "router",
                    replicas=replica_urls(launched.plan),
                    ready_s=result.reused_from.ready_s if result.reused_from
                    else round(result.readiness.seconds, 1),
                    attempts=result.reused_from.attempts if result.reused_from else len(result.attempts),
                    reused=result.reused_from is not None, seconds_without_service=result.dark_s)


def planned_endpoint(serve_plan: ServePlan, addresses: list[ClientAddress]) -> Endpoint:
    """The Endpoint 06 would be handed should the plan's first launch serve, for previews before the run (it has
    not started yet: no seconds to ready, no attempt made)."""
    return Endpoint(base_url=serve_plan.base_url, model=serve_plan.model, executor=serve_plan.executor,
                    api_key_env=serve_plan.settings.api_key_env,
                    addresses={a.network: a.url for a in addresses if a.not_listening is None},
                    commands={c.node: c.argv for c in serve_plan.commands},
                    env={c.node: c.env for c in serve_plan.commands},
                    logs={c.node: log_path(1, front.slot_of(serve_plan)) for c in serve_plan.commands},
                    router=serve_plan.router.argv if serve_plan.router else None,
                    router_log=router_log(serve_plan, 1) if serve_plan.router else None,
                    front=serve_plan.router is not None and serve_plan.settings.front == "router",
                    replicas=replica_urls(serve_plan), ready_s=0.0, attempts=0, reused=False)


def drop_aside(ctx: Context) -> dict[str, object]:
    """Remove the places 04 kept aside (runtime.aside) once their successor serves: the nodes that had one, and
    the errors of those where the removal failed (left for `sparkbook stop` or the next replacement)."""
    dropped = ctx.cluster.fan_out(lambda n: ctx.runtime.drop_aside(n, ctx.places[n.name]))
    return {"nodes": [n for n, o in dropped.items() if o.ok and o.value],
            "errors": {n: str(o.error) for n, o in dropped.items() if not o.ok}}
