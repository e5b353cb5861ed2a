"""papermill's per-cell limit for each notebook: above the longest wait a cell of it may make under the params.

The waits are the stage list's (core.values.stagelist); here they become limits, so that a slow load is ended by
sparkbook's own timeout (named, with a remediation) and never by papermill's.
"""
from __future__ import annotations

from ..core.values.params import Params
from ..core.values.stagelist import stage_of

BASE_CELL_S = 1800  # a cell without a long wait of its own
CELL_SLACK_S = 600  # what a waiting cell does besides its waits (launches, log tails, smoke test)


def cell_limit(params: Params, notebook: str) -> tuple[int, str]:
    """papermill's per-cell limit for a notebook and why: its stage's longest wait (05: every serve attempt's ready
    wait; 04: the Ray join wait; 06: the sweep's points) plus slack, never under BASE_CELL_S."""
    stage = stage_of(notebook)
    wait = stage.longest_wait(params) if stage and stage.longest_wait else None
    if wait is None or wait.seconds + CELL_SLACK_S <= BASE_CELL_S:
        return BASE_CELL_S, f"the default {BASE_CELL_S} s" + (f" (longest wait: {wait.why})" if wait else "")
    return int(wait.seconds + CELL_SLACK_S), f"{wait.why} + {CELL_SLACK_S} s"
