"""05's blue-green replacement behind the front (serve.front: router, serve.switch: auto): where the new plan fits
beside the serving one (every serving node's memory measured now, the old server holding its share), the new server
starts in the other slot (front.backend_settings), is checked directly on its own port, and only then the front
moves new requests to it; the old one drains and stops. Before the move nothing of the old server is touched."""
from __future__ import annotations

import time
from dataclasses import dataclass

import httpx

from ...core.analysis.benchstats import prometheus_totals
from ...core.cluster.context import Context
from ...core.values.modelinfo import FitRow, ModelFacts, memory_fit
from . import front
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
    """02's fit of the new plan against what every serving node has free now, the old server still serving."""
    memory = samples(ctx, [c.node for c in serve_plan.commands])
    params = ctx.params.model_copy(update={"serve": serve_plan.settings})
    return Beside(memory_fit(model, params, {n: m.for_fit(n) for n, m in memory.items()}))


def backend(serve_plan: ServePlan) -> str:
    """The URL the front reaches the plan's server at (the tp layout: one server behind it)."""
    assert serve_plan.router is not None, "a plan behind the front"
    (url,) = front.workers(serve_plan.router)
    return url


def move(front_url: str, new: str, old: str) -> None:
    """The front sends new requests to `new` and none to `old` (what `old` runs goes on to its end); ServeError
    naming the step that failed (then the front may route to both: the old one is not stopped)."""
    with httpx.Client(timeout=httpx.Timeout(ADMIN_TIMEOUT_S, connect=5.0)) as client:
        for verb, url in (("add_worker", new), ("remove_worker", old)):
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


def settle(url: str, timeout_s: float, headers: dict[str, str]) -> Settled:
    """Wait until the server at `url`, which gets no new requests, runs none (vLLM's vllm:num_requests_running on its
    /metrics), at most `timeout_s`: the drain of an image whose vLLM has no --shutdown-timeout, and a check on one
    that has it before it is stopped."""
    t0 = time.monotonic()
    with httpx.Client(timeout=httpx.Timeout(5.0), headers=headers) as client:
        while True:
            running = _running(client, url)
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
