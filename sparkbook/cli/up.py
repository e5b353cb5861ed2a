"""`sparkbook up PARAMS`: the cluster's last good deployment again, printing the run's progress. Exits 1 when no run
of the cluster deployed a server."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from . import show
from .command import Command, params_and_outputs
from .exits import EXIT_FAILED


def handle(args: argparse.Namespace) -> int:
    from .. import api

    done = api.up(Path(args.params), Path(args.outputs), say=print)
    show.run_dir(done.run_dir)
    if done.failed:
        exc = done.failed.exception or {}
        print(f"FAILED at {done.failed.name}: {exc.get('ename')}: {exc.get('evalue', '')[:500]}", file=sys.stderr)
        return EXIT_FAILED
    d = done.deployment
    print(f"up: the deployment of run {d.run_id} serves again (plan {d.plan_hash})")
    return 0


COMMAND = Command("up", "bring back the cluster's last good deployment (04 + 05 from its record; no cleanup, no "
                        "copies)", params_and_outputs, handle, __doc__)
