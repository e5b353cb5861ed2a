"""05's blue-green replacement behind the front (serve.front: router, serve.switch: auto): where the new plan fits
beside the serving one (every serving node's memory measured now, the old servers holding their share), the new
servers start in the other slot (front.backend_settings; with replicas, one per node), are checked directly on the
head's own port, and only then the front moves new requests to them; the old ones drain and stop. Before the move
nothing of the old servers is touched."""
from __future__ import annotations

import time
from dataclasses import dataclass

import httpx

from ...core.analysis.benchstats import prometheus_totals
from ...core.cluster.context import Context
from ...core.values.modelinfo import FitRow, ModelFacts, memory_fit
from . import front, replicas
from .commands import ServeError, ServePlan
from .memory import samples

ADMIN_TIMEOUT_S = 60.0  # /add_worker returns once the router sees the server healthy: it already is
RUNNING = "vllm:num_requests_running"
POLL_S = 0.5


@dataclass(frozen=True)
class Beside:
    """Whether the new plan fits beside the serving one, per node, as measured just now."""

    rows: list[FitRow]

    @property
    def fits(self) -> bool:
        return bool(self.rows) and all(r.fits for r in self.rows)

    def why(self) -> str:
        if self.fits:
            return "it fits beside the serving one on every node: " + "; ".join(
                f"{r.node}: takes {r.planned_gib} of {r.allocatable_gib} GiB free now" for r in self.rows)
        return "it does not fit beside the serving one: " + "; ".join(
            f"{r.node}: takes {r.planned_gib} GiB, {r.allocatable_gib} GiB free now ({r.why})"
            for r in self.rows if not r.fits)

    def event(self) -> list[dict[str, object]]:
        return [{"node": r.node, "planned GiB": r.planned_gib, "free now GiB": r.allocatable_gib, "fits": r.fits}
                for r in self.rows]


def beside(ctx: Context, serve_plan: ServePlan, model: ModelFacts) -> Beside:
    """02's fit of the new plan against what every serving node has free now, the old server still serving: the
    plan's split, or with replicas each node's whole copy on that node alone."""
    memory = samples(ctx, [c.node for c in serve_plan.commands])
    params = ctx.params.model_copy(update={"serve": serve_plan.settings})
    free = {n: m.for_fit(n) for n, m in memory.items()}
    if serve_plan.settings.layout == "replicas":
        return Beside([row for spec in params.nodes if spec.name in free
                       for row in memory_fit(model, replicas.alone(params, spec), {spec.name: free[spec.name]})])
    return Beside(memory_fit(model, params, free))


def backends(serve_plan: ServePlan) -> list[str]:
    """The URLs the front reaches the plan's servers at (the tp layout's one, or every replica's)."""
    assert serve_plan.router is not None, "a plan behind the front"
    return front.workers(serve_plan.router)


def move(front_url: str, new: list[str], old: list[str], headers: dict[str, str]) -> None:
    """The front sends new requests to the `new` servers and none to the `old` (what those run goes on to its end),
    every new one added before any old one is removed, asked with the key (a keyed front refuses its admin routes
    without it); ServeError naming the step that failed (then the front may route to both: the old ones are not
    stopped)."""
    with httpx.Client(timeout=httpx.Timeout(ADMIN_TIMEOUT_S, connect=5.0), headers=headers) as client:
        for verb, url in [*(("add_worker", u) for u in new), *(("remove_worker", u) for u in old)]:
            try:
                r = client.post(f"{front_url}/{verb}", params={"url": url})
            except httpx.HTTPError as exc:
                raise ServeError(f"the front's /{verb} for {url} failed: {exc}") from exc
            if r.status_code != 200:
                raise ServeError(f"the front's /{verb} for {url} answered {r.status_code}: {r.text[:200]}")


@dataclass(frozen=True)
class Settled:
    """How the old server's own work ran out after the front moved away from it: the seconds waited and the requests
    it still ran then (0: drained; None: its /metrics did not say)."""

    seconds: float
    running: int | None

    def event(self) -> dict[str, object]:
        return {"seconds": round(self.seconds, 1), "requests still running": self.running}


def settle(urls: list[str], timeout_s: float, headers: dict[str, str]) -> Settled:
    """Wait until the servers at `urls`, which get no new requests, run none (vLLM's vllm:num_requests_running on
    their /metrics, summed), at most `timeout_s` for all: the drain of an image whose vLLM has no --shutdown-timeout,
    and a check on one that has it before it is stopped."""
    t0 = time.monotonic()
    with httpx.Client(timeout=httpx.Timeout(5.0), headers=headers) as client:
        while True:
            each = [_running(client, url) for url in urls]
            running = None if None in each else sum(n for n in each if n is not None)
            if running == 0 or time.monotonic() - t0 >= timeout_s:
                return Settled(time.monotonic() - t0, running)
            time.sleep(POLL_S)


def _running(client: httpx.Client, url: str) -> int | None:
    try:
        page = client.get(f"{url}/metrics")
    except httpx.HTTPError:
        return None
    found = prometheus_totals(page.text).get(RUNNING) if page.status_code == 200 else None
    return None if found is None else int(found)
