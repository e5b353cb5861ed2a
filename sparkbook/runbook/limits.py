"""papermill's per-cell limit for each notebook: above the longest wait a cell of it may make under the params.

The one place the driver knows what 04, 05 and 06 wait for, so that a slow load is ended by sparkbook's own timeout
(named, with a remediation) and never by papermill's.
"""
from __future__ import annotations

from ..core.benchstats import point_timeout_s
from ..core.params import Params

BASE_CELL_S = 1800  # a cell without a long wait of its own
CELL_SLACK_S = 600  # what a waiting cell does besides its waits (launches, log tails, smoke test)


def _longest_wait(params: Params, prefix: str) -> tuple[float, str]:
    """The longest wait a cell of notebook `prefix` ('04') may make, and why; (0, '') for one without."""
    s, ray = params.serve, params.ray
    if prefix == "04":
        return ray.join_timeout_s, f"ray.join_timeout_s {ray.join_timeout_s:g} s"
    if prefix == "05":
        return ((s.max_remedies + 1) * s.ready_timeout_s,
                f"{s.max_remedies + 1} attempts (serve.max_remedies {s.max_remedies} + 1) x serve.ready_timeout_s "
                f"{s.ready_timeout_s:g} s")
    if prefix == "06":
        sweep = sum(point_timeout_s(params.benchmark, c) for c in params.benchmark.concurrency)
        return sweep, f"the sweep's point timeouts, {sweep:.0f} s in all"
    return 0.0, ""


def cell_limit(params: Params, notebook: str) -> tuple[int, str]:
    """papermill's per-cell limit for a notebook and why: its longest wait (05: every serve attempt's ready wait;
    04: the Ray join wait; 06: the sweep's points) plus slack, never under BASE_CELL_S."""
    wait, why = _longest_wait(params, notebook[:2])
    if wait + CELL_SLACK_S <= BASE_CELL_S:
        return BASE_CELL_S, f"the default {BASE_CELL_S} s" + (f" (longest wait: {why})" if why else "")
    return int(wait + CELL_SLACK_S), f"{why} + {CELL_SLACK_S} s"
