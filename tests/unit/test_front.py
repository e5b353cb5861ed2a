"""05's front door (serve.front: router, issue 55): the tp layout's server moved behind vllm-router on
serve.replica_port, the front's argv holding requests through a gap (retries with backoff, no circuit breaker), a
drained server argv where the image's vLLM has --shutdown-timeout, params that cannot serve a front refused by name,
and the client's view a replacement records (a real HTTP server going away and coming back). The front on the lab:
tests/lab/test_front_lab.py."""
from __future__ import annotations

import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from test_serve_plan import ctx

from sparkbook.core.cluster.topology import FRONT_LOG
from sparkbook.core.values.params import ParamsError, load_params
from sparkbook.stages.serve import bluegreen, bringup, front, launch


def with_front(params, **serve):
    return params.model_copy(update={"serve": params.serve.model_copy(update={"front": "router", **serve})})


def value(argv, flag):
    return argv[argv.index(flag) + 1]


def test_the_tp_server_answers_the_front_on_its_own_port(lab):
    params = with_front(lab, hold_s=30)
    plan = bringup.layout_plan(ctx(params), "mp", params.serve, "", drains=True)
    head, worker = plan.commands
    assert value(head.argv, "--port") == "8001" and value(head.argv, "--shutdown-timeout") == "30"
    assert "--shutdown-timeout" not in worker.argv  # the head's API drains; the worker rank follows it
    assert plan.base_url == "http://10.77.0.10:8000"  # clients see the front, as before
    assert plan.router is not None and plan.router.node == "lab-0"
    assert front.workers(plan.router) == ["http://10.77.0.10:8001"]
    assert launch.replica_urls(plan) == {"lab-0": "http://10.77.0.10:8001"}  # readiness waits for it, then the front
    assert value(plan.router.argv, "--retry-max-retries") == "30"  # 30 s at the longest backoff of 1 s
    assert "--disable-circuit-breaker" in plan.router.argv
    assert value(plan.router.argv, "--policy") == "round_robin"  # vllm-router refuses power_of_two for one worker
    assert launch.router_log(plan, 3) == FRONT_LOG  # one front, whatever the attempt
    assert front.drains(plan)


def test_without_the_images_drain_the_server_is_stopped_plainly(lab):
    params = with_front(lab)
    plan = bringup.layout_plan(ctx(params), "mp", params.serve, "", drains=False)
    assert "--shutdown-timeout" not in plan.commands[0].argv and not front.drains(plan)


def test_front_none_serves_directly(lab):
    params = with_front(lab, front="none")
    plan = bringup.layout_plan(ctx(params), "mp", params.serve, "")
    assert plan.router is None and value(plan.commands[0].argv, "--port") == "8000"
    assert launch.router_log(plan, 2).endswith("router-2.log")


def test_a_front_on_the_servers_port_is_refused(write_params, base):
    base["serve"] = {"front": "router", "replica_port": 8000}
    with pytest.raises(ParamsError, match="serve.replica_port: 8000 is serve.port"):
        load_params(write_params(base))


@pytest.mark.parametrize(("serve", "secrets", "resolved"), [
    ({}, [], "router"),  # the default: a front door, as params/lab.yaml has it
    ({"front": "auto"}, [], "router"),
    ({"api_key_env": "VLLM_KEY"}, ["VLLM_KEY"], "router"),  # the keyed router asks the key on every route
    ({"front": "none"}, [], "none")])
def test_front_auto_is_the_router(write_params, base, serve, secrets, resolved):
    base["serve"], base["secrets"] = serve, secrets
    assert load_params(write_params(base)).serve.front == resolved


class _Answering(BaseHTTPRequestHandler):
    """A handler that answers 200 with a body and logs nothing."""

    def answer(self, body: bytes) -> None:
        self.send_response(200)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


class _Completions(_Answering):
    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        self.rfile.read(int(self.headers["content-length"]))
        self.answer(b'{"choices": [{"text": "2"}]}')


def _serve(port: int) -> ThreadingHTTPServer:
    server = ThreadingHTTPServer(("127.0.0.1", port), _Completions)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def test_the_watcher_counts_a_gap_as_a_client_sees_it():
    server = _serve(0)
    port = server.server_address[1]
    with front.Watcher(f"http://127.0.0.1:{port}", "m", {}, hold_s=5) as watching:
        time.sleep(1.2)
        server.shutdown()
        server.server_close()
        time.sleep(2.5)  # nothing listens: every ask is refused
        server = _serve(port)
        time.sleep(1.5)
    server.shutdown()
    view = watching.view()
    assert view.refused >= 3 and view.failed <= 1  # at most the ask in flight when the server went away
    assert 2.0 <= view.dark_s <= 4.5
    assert view.asks > view.refused


class _Holding(_Answering):
    """A front holding every request that arrives until `until` (monotonic), then answering it."""

    until = 0.0

    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        self.rfile.read(int(self.headers["content-length"]))
        time.sleep(max(0.0, type(self).until - time.monotonic()))
        self.answer(b'{"choices": [{"text": "2"}]}')


def test_the_watcher_counts_every_request_that_arrived_while_the_front_held(monkeypatch):
    """Asks do not wait for each other: through a 4.5-s hold one arrives every poll and is held, each counted, and
    the stretch without an answer is the hold less a poll."""
    monkeypatch.setattr(_Holding, "until", time.monotonic() + 4.5)
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Holding)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        with front.Watcher(f"http://127.0.0.1:{server.server_address[1]}", "m", {}, hold_s=10) as watching:
            time.sleep(5.5)
    finally:
        server.shutdown()
    view = watching.view()
    assert (view.refused, view.failed) == (0, 0), view
    assert view.held >= 4, f"an ask every {front.Watcher.POLL_S} s through the hold, held > 2 s: {view}"
    assert view.asks > view.held and 3.5 <= view.dark_s <= 5.0, view


def test_blue_green_plans_the_other_slot_and_a_server_there_keeps_its_own_files(lab):
    params = with_front(lab)
    blue = bringup.layout_plan(ctx(params), "mp", params.serve, "", drains=True, slot=0)
    green = bringup.layout_plan(ctx(params), "mp", params.serve, "", drains=True, slot=1)
    assert (front.slot_of(blue), front.slot_of(green)) == (0, 1)
    assert value(green.commands[0].argv, "--port") == "8002" and value(green.commands[0].argv, "--master-port") == \
        str(params.serve.master_port + 1)
    assert value(green.commands[1].argv, "--master-port") == str(params.serve.master_port + 1)
    assert green.base_url == blue.base_url  # clients see the one front either way
    assert bluegreen.backends(green) == ["http://10.77.0.10:8002"]
    assert bluegreen.backends(blue) == ["http://10.77.0.10:8001"]
    assert front.routes_alike(blue.router, green.router)  # the front stays: only the server behind it moves
    assert blue.router.argv != green.router.argv
    assert launch.log_path(1, 0).endswith("/serve-1.log") and launch.log_path(1, 1).endswith("/serve-1-slot1.log")
    assert front.slot_of(bringup.layout_plan(ctx(lab), "mp", lab.serve, "")) == 0  # no front: one slot


def _row(node, planned, free):
    from sparkbook.core.values.modelinfo import FitRow
    return FitRow(node, 1, 24.0, free, planned, planned / free, 0.1, 0.1, 2048, 2048, planned <= free,
                  "weights + KV + reserve", "no GPU: MemAvailable")


def test_the_beside_decision_names_each_node_that_cannot_hold_both():
    fits = bluegreen.Beside([_row("lab-0", 2.0, 20.0), _row("lab-1", 2.0, 19.5)])
    assert fits.fits and "lab-0: takes 2.0 of 20.0 GiB free now" in fits.why()
    tight = bluegreen.Beside([_row("lab-0", 2.0, 20.0), _row("lab-1", 9.0, 3.0)])
    assert not tight.fits and "lab-1: takes 9.0 GiB, 3.0 GiB free now" in tight.why() and "lab-0" not in tight.why()
    assert not bluegreen.Beside([]).fits  # nothing measured: no blue-green


def test_behind_the_front_the_worker_rank_follows_its_head_server_not_the_front(lab):
    params = with_front(lab)
    plan = bringup.layout_plan(ctx(params), "mp", params.serve, "", slot=1)
    assert launch._head_api(plan) == ("10.77.0.10", "8002")
    direct = with_front(lab, front="none")
    assert launch._head_api(bringup.layout_plan(ctx(direct), "mp", direct.serve, "")) == ("10.77.0.10", "8000")


def test_a_front_is_kept_only_where_it_routes_as_the_new_plan_would(lab):
    """The drained stop keeps a standing front whose whole argv is the new plan's (bringup._front_for compares it):
    a tp plan and a replicas plan under the same policy route to different servers, and a changed hold_s is another
    front even for blue-green (which needs the serving front to stay)."""
    params = with_front(lab, router_policy="round_robin")
    tp = bringup.layout_plan(ctx(params), "mp", params.serve, "")
    both = with_front(lab, router_policy="round_robin", layout="replicas")
    replicas = bringup.layout_plan(ctx(both), "mp", both.serve, "")
    assert front.routes_alike(tp.router, replicas.router)  # the same front settings ...
    assert tp.router.argv != replicas.router.argv  # ... to other servers: not kept through a drained stop
    longer = with_front(lab, router_policy="round_robin", hold_s=300)
    held_longer = bringup.layout_plan(ctx(longer), "mp", longer.serve, "")
    assert not front.routes_alike(tp.router, held_longer.router)


class _Metrics(_Answering):
    """vLLM's /metrics with vllm:num_requests_running going down by one per look (two engines' lines summed), or a
    page without it (`running` None)."""

    running: list[float | None] = []

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        left = self.running.pop(0) if len(self.running) > 1 else self.running[0]
        lines = ["# TYPE vllm:num_requests_running gauge",
                 f'vllm:num_requests_running{{engine="0"}} {left / 2}',
                 f'vllm:num_requests_running{{engine="1"}} {left / 2}'] if left is not None else ["# nothing"]
        self.answer(("\n".join(lines) + "\n").encode())


@pytest.mark.parametrize(("running", "timeout_s", "left", "looks_at_least"), [
    ([4.0, 2.0, 2.0, 0.0], 30, 0, 3),  # drained: the old server's last requests finished
    ([3.0], 1.2, 3, 2),  # still running at the bound: stopped all the same, said so
    ([None], 0.6, None, 1)])  # no such gauge: not a vLLM page, unknown
def test_blue_greens_old_server_is_stopped_once_it_runs_nothing(running, timeout_s, left, looks_at_least):
    handler = type("Metrics", (_Metrics,), {"running": list(running)})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        settled = bluegreen.settle([f"http://127.0.0.1:{server.server_address[1]}"], timeout_s, {})
    finally:
        server.shutdown()
    assert settled.running == left
    assert settled.seconds >= (looks_at_least - 1) * bluegreen.POLL_S
    assert settled.seconds < timeout_s + 1


@pytest.mark.parametrize(("blue_green", "replaced", "drain_s", "by_04", "way"), [
    (True, True, 30, False, "blue-green"),
    (False, True, 30, False, "drained stop"),
    (False, True, None, False, "stop behind the front"),  # the image's vLLM has no --shutdown-timeout
    (False, False, 30, False, "restart behind the front"),  # a watch restart: its server died, nothing drained
    (False, False, 30, True, "new node places behind the front")])  # 04's new image or env ended the old server
def test_the_way_a_bring_up_behind_the_front_went(blue_green, replaced, drain_s, by_04, way):
    from sparkbook.stages import serve

    assert serve._way(blue_green, replaced, drain_s, by_04) == way


def test_the_front_has_a_place_of_its_own_on_the_head_that_teardowns_remove(lab):
    from sparkbook.core.cluster.topology import container_names, front_place

    place = front_place(lab, "img")
    assert (place.node, place.name, place.image) == ("lab-0", f"sparkbook-{lab.cluster}-front", "img")
    assert place.name not in {p.name for p in ctx(lab).places.values()}  # 04's node places leave it standing
    assert set(place.env) == {"VLLM_CACHE_ROOT", "TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR",
                              "FLASHINFER_WORKSPACE_BASE"}  # no fabric, no GPU: a Python for the router
    assert container_names(lab) == {"lab-0": [f"sparkbook-{lab.cluster}-lab-0", place.name],
                                    "lab-1": [f"sparkbook-{lab.cluster}-lab-1"]}


def test_a_node_cannot_take_the_fronts_name(write_params, base):
    base["nodes"][1]["name"] = "front"
    with pytest.raises(ParamsError) as err:
        load_params(write_params(base))
    assert "nodes[1].name: 'front' names the front's own container" in str(err.value)


@pytest.mark.parametrize(("urls", "slot"), [
    (["http://10.77.0.10:8001"], 0), (["http://10.77.0.10:8002"], 1),
    (["http://10.77.0.10:9000"], 0),  # not a slot of these settings: the first
    (["http://10.77.0.10:8001", "http://10.77.0.11:8001"], 0),  # replicas, every one in the same slot
    (["http://10.77.0.10:8002", "http://10.77.0.11:8002"], 1),
    (["nonsense"], 0)])
def test_the_slot_a_standing_front_routes_to_is_read_from_its_record(lab, urls, slot):
    params = with_front(lab)
    argv = front.argv(params.serve, urls)
    assert front.routed_slot(argv, params.serve) == slot


def test_the_watcher_counts_from_when_04_stopped_the_servers():
    server = _serve(0)
    try:
        with front.Watcher(f"http://127.0.0.1:{server.server_address[1]}", "m", {}, hold_s=5,
                           dark_since=time.monotonic() - 20) as watching:
            time.sleep(1.0)
    finally:
        server.shutdown()
    view = watching.view()
    assert view.refused == 0 and 19.0 <= view.dark_s <= 22.0, view  # dark from 04's stop until its first answer
