"""`sparkbook plan PARAMS`: what each stage would do, read-only; what only a run can tell is shown as not known;
exits 1 where a stage's preview failed (a node down)."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from ..core.values.evidence import table_rows
from . import show
from .command import Command, params_and_outputs
from .exits import EXIT_FAILED


def handle(args: argparse.Namespace) -> int:
    from .. import api

    planned = api.plan(Path(args.params), Path(args.outputs))
    for p in planned.stages:
        print(f"\n== {p.stage.name}")
        if p.why:
            print(f"   {p.why}")
        for shown in p.shown:
            rows = table_rows(shown.value)
            print(f"-- {shown.title}")
            print(show.table(rows, colwidth=2000, width=10000) if rows is not None else shown.value
                  if isinstance(shown.value, str) else json.dumps(shown.value, indent=2, default=str))
    return 0 if planned.showed_what_it_could else EXIT_FAILED


COMMAND = Command("plan", "what each stage would do: cleanup targets, memory fit, copies, docker run / ray start / "
                          "vllm serve argv (env by name); read-only probes only", params_and_outputs, handle, __doc__)
