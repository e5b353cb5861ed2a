"""05's front door (serve.front: router): vllm-router on the head answers clients on serve.port and outlives the
servers behind it, which listen on serve.replica_port. A replacement or a restart keeps the front running and the
backend's address unchanged, so a request that arrives while no server answers is retried by the front with backoff
(held, for serve.hold_s) instead of refused; the old server is stopped drained (vLLM's --shutdown-timeout finishes
what it runs). `Watcher` measures what a client saw meanwhile."""
from __future__ import annotations

import dataclasses
import json
import math
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx

from ...core.cluster.context import Context
from ...core.cluster.runtime import Place, Spawned
from ...core.cluster.topology import LOG_DIR
from ...core.values.params import Params, ServeSettings
from . import router
from .commands import ServeCommand, ServePlan

RECORD = f"{LOG_DIR}/front.json"  # in the front's place: its argv with the servers it routes to now (moves included)
BACKOFF_MS = (100, 1000)  # the front's retry backoff, first and longest: a held request asks again within 1 s
HEALTH_CHECK_S = 3600  # the front's own health checks would mark a restarting server down, and then refuse at once
STARTUP_CHECK_S = 5  # the router's look at servers still starting (its default, 30 s, answers up to 30 s late)
WORKERS = "--worker-urls"  # last in the argv: every element after it is a backend's URL


def retries(settings: ServeSettings) -> int:
    """Retries that hold a request for about serve.hold_s at the longest backoff."""
    return max(1, math.ceil(settings.hold_s * 1000 / BACKOFF_MS[1]))


def argv(settings: ServeSettings, workers: list[str]) -> list[str]:
    """vllm-router before `workers`: it waits for them as long as 05 does (serve.ready_timeout_s), and holds a request
    no backend answers by retrying it with backoff (no circuit breaker, no health check that would drop a restarting
    server and answer 503 at once). One backend is routed round robin (vllm-router refuses power_of_two with fewer
    than two). It runs as a module from its own install (router.site, PYTHONPATH); with serve.api_key_env through
    router.KEYED, which makes it refuse every request without the key (its admin routes included), with its metrics
    on the loopback, where no key is asked."""
    keyed = settings.api_key_env is not None
    return ["python3", "-m", router.KEYED if keyed else "vllm_router.launch_router",
            "--host", str(settings.host), "--port", str(settings.port),
            *(["--prometheus-host", "127.0.0.1"] if keyed else []),
            "--policy", settings.router_policy if len(workers) > 1 else "round_robin",  # power_of_two needs two
            "--worker-startup-timeout-secs", str(math.ceil(settings.ready_timeout_s)),
            "--worker-startup-check-interval", str(STARTUP_CHECK_S),
            "--retry-max-retries", str(retries(settings)), "--retry-initial-backoff-ms", str(BACKOFF_MS[0]),
            "--retry-max-backoff-ms", str(BACKOFF_MS[1]), "--disable-circuit-breaker",
            "--health-check-interval-secs", str(HEALTH_CHECK_S), WORKERS, *workers]


def workers(command: ServeCommand) -> list[str]:
    """The backends' URLs a router argv names."""
    return command.argv[command.argv.index(WORKERS) + 1:]


def drained(argv_: list[str], settings: ServeSettings) -> list[str]:
    """A server's argv with vLLM's own drain: stopped, it takes no new request and finishes those it runs."""
    return [*argv_, "--shutdown-timeout", str(settings.drain_timeout_s)]


def backend_settings(settings: ServeSettings, slot: int) -> ServeSettings:
    """The settings a server behind the front is planned with: slot 0 on serve.replica_port (and master_port),
    slot 1 one above each, where a blue-green replacement stands up beside the server of slot 0 (and back)."""
    return settings.model_copy(update={"port": settings.replica_port + slot,
                                       "master_port": settings.master_port + slot})


def slot_of(serve_plan: ServePlan) -> int:
    """The slot a plan's servers are in (0 for a plan without a front): the head's server's port above
    serve.replica_port (every replica's is the same)."""
    if serve_plan.router is None or serve_plan.settings.front != "router":
        return 0
    argv = serve_plan.commands[0].argv
    return int(argv[argv.index("--port") + 1]) - serve_plan.settings.replica_port


def routes_alike(a: ServeCommand, b: ServeCommand) -> bool:
    """Two fronts' argvs alike but for the servers behind them (a blue-green switch changes those at run time)."""
    return a.argv[:a.argv.index(WORKERS)] == b.argv[:b.argv.index(WORKERS)]


def behind(params: Params, backend: ServePlan, settings: ServeSettings, drains: bool) -> ServePlan:
    """The tp layout's plan behind the front: `backend` (planned on serve.replica_port) answers the front, which
    answers clients at serve.port on the head; with `drains`, the head's server stops drained."""
    commands = list(backend.commands)
    if drains:
        commands[0] = dataclasses.replace(commands[0], argv=drained(commands[0].argv, settings))
    return dataclasses.replace(backend, settings=settings, commands=commands,
                               base_url=f"http://{params.head.fabric_ip}:{settings.port}",
                               router=ServeCommand(params.head.name, argv(settings, [backend.base_url]),
                                                   {"PYTHONPATH": router.site(params)}))


def drains(serve_plan: ServePlan) -> bool:
    """Whether the plan's servers stop drained (their argv carries --shutdown-timeout)."""
    return "--shutdown-timeout" in serve_plan.commands[0].argv


def place(ctx: Context, serve_plan: ServePlan) -> Place:
    """Where the plan's router runs: the front's own place (serve.front: router), else, a router of replicas started
    with them, the head's."""
    assert serve_plan.router is not None, "a plan with a router"
    return ctx.front if serve_plan.settings.front == "router" else ctx.place(serve_plan.router.node)


def runs(ctx: Context, serve_plan: ServePlan, spawned: Spawned) -> bool:
    """Whether the plan's router `spawned` runs in its place (a place that is gone runs nothing)."""
    where = place(ctx, serve_plan)
    return ctx.runtime.alive(ctx.head, where) and ctx.runtime.running(ctx.head, where, spawned)


def open_place(ctx: Context) -> bool:
    """Start the front's own place on the head where it does not run (True: started now); it stays across 04's new
    node places, replacements and restarts, until `sparkbook stop` removes it."""
    head = ctx.head
    if ctx.runtime.alive(head, ctx.front):
        return False
    ctx.runtime.start(head, ctx.runtime.start_spec(head, ctx.front, gpus=False))
    return True


def routes(ctx: Context) -> list[str] | None:
    """The standing front's argv with the servers it routes to now (RECORD); None where it has none or the file is
    not one (it is only compared with a plan's argv and read for a slot, never run)."""
    if not ctx.runtime.alive(ctx.head, ctx.front):
        return None
    try:
        argv = json.loads(ctx.runtime.read(ctx.head, ctx.front, RECORD))
    except ValueError:
        return None
    return argv if isinstance(argv, list) and all(isinstance(a, str) for a in argv) and WORKERS in argv else None


def record(ctx: Context, argv: list[str]) -> None:
    """Write what the front routes to now (at its start, and after a blue-green move) into its own place (its log
    directory made here too: the front's spawn, just before, makes it in the background)."""
    ctx.runtime.exec(ctx.head, ctx.front, ["sh", "-c", 'mkdir -p "$(dirname "$0")" && printf %s "$1" >"$0"', RECORD,
                                           json.dumps(argv)],
                     timeout=30).check()


def routed_slot(argv: list[str], settings: ServeSettings) -> int:
    """The slot (backend_settings, replicas.replica_settings) of the servers a front's argv routes to, all in one:
    the first's port above serve.replica_port; 0 where it names no other."""
    urls = argv[argv.index(WORKERS) + 1:]
    try:
        slot = int(urls[0].rsplit(":", 1)[1].split("/")[0]) - settings.replica_port
    except (IndexError, ValueError):
        return 0
    return slot if slot in (0, 1) else 0


@dataclass(frozen=True)
class ClientView:
    """What clients arriving at the front every POLL_S saw while a replacement or a restart ran: the longest stretch
    without an answer, and how many asks were refused (no connection) or failed (an error status or no answer in
    time); a held ask that was answered late counts as neither."""

    dark_s: float
    asks: int
    refused: int
    failed: int
    held: int  # answered, but after more than HELD_S: the front held it while no server answered

    def event(self) -> dict[str, object]:
        return {"seconds without service (as a client saw it)": self.dark_s, "asks": self.asks,
                "held": self.held, "held at once at most": Watcher.MAX_ASKS, "refused": self.refused,
                "failed": self.failed}


class Watcher:
    """Ask the front from here every POLL_S, from entering until leaving, what a client asks: a one-token completion
    (the front holds it while no server answers, and it waits up to `hold_s` for it; vllm-router answers /v1/models
    with an error meanwhile, so listing the models is no client's view of a gap). Asks do not wait for each other, as
    clients do not: through a gap one arrives every POLL_S and is held, up to MAX_ASKS at once, so `held` counts
    requests that arrived while no server answered, not the one that happened to be asking."""

    POLL_S = 0.5
    HELD_S = 2.0  # a one-token completion that took longer was held (the lab's CPU engine answers one in < 0.5 s)
    MAX_ASKS = 32  # held at once at most (16 s of arrivals): a probe, not a load that would fill the front's queue

    def __init__(self, base_url: str, model: str, headers: dict[str, str], hold_s: float,
                 dark_since: float | None = None) -> None:
        """`dark_since`: the monotonic time the servers stopped before the watch began (04's new node places),
        counted as without service; None: they answered until it began."""
        self._url, self._headers, self._wait_s = f"{base_url}/v1/completions", headers, hold_s + 10
        self._body = {"model": model, "prompt": "1", "max_tokens": 1}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._lock = threading.Lock()
        self._slots = threading.BoundedSemaphore(self.MAX_ASKS)
        self._asks = self._refused = self._failed = self._held = 0
        self._last_ok = time.monotonic() if dark_since is None else dark_since
        self._dark = 0.0

    def __enter__(self) -> Watcher:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=self._wait_s + 5)  # the asks in flight answer (or time out) first
        with self._lock:
            self._dark = max(self._dark, time.monotonic() - self._last_ok - self.POLL_S)

    def view(self) -> ClientView:
        with self._lock:
            return ClientView(round(max(self._dark, 0.0), 1), self._asks, self._refused, self._failed, self._held)

    def _watch(self) -> None:
        with httpx.Client(timeout=httpx.Timeout(self._wait_s, connect=2.0), headers=self._headers) as client, \
                ThreadPoolExecutor(self.MAX_ASKS, thread_name_prefix="front-watch") as asks:
            while not self._stop.is_set():
                if self._slots.acquire(blocking=False):
                    asks.submit(self._ask, client)
                self._stop.wait(self.POLL_S)

    def _ask(self, client: httpx.Client) -> None:
        """One ask, counted where it ends; an answer closes the stretch since the one before it, less one poll
        interval."""
        asked = time.monotonic()
        refused = False
        try:
            ok = client.post(self._url, json=self._body).status_code == 200
        except httpx.ConnectError:
            ok, refused = False, True
        except httpx.HTTPError:
            ok = False
        finally:
            self._slots.release()
        now = time.monotonic()
        with self._lock:
            self._asks += 1
            self._refused += refused
            self._failed += not ok and not refused
            if ok:
                self._held += now - asked > self.HELD_S
                self._dark = max(self._dark, now - self._last_ok - self.POLL_S)
                self._last_ok = max(self._last_ok, now)
