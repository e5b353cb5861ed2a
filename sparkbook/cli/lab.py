"""`sparkbook lab up|down|reset|status`: the local multi-node test cluster (a test harness: no api of its own)."""
from __future__ import annotations

import argparse

from ..core.values.errors import SparkbookError
from .command import Command


def arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("action", choices=["up", "down", "reset", "status"])
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--keep-worker-images", action="store_true",
                   help="reset: leave the workers the images earlier runs copied (the next 03 copies nothing)")


def handle(args: argparse.Namespace) -> int:
    from .. import lab

    try:
        if args.action == "up":
            print(lab.up(nodes=args.nodes, progress=print))
        elif args.action == "down":
            lab.down(progress=print)
        elif args.action == "reset":  # back to the initial state (the old deployment serving) without a restart
            print(lab.reset(progress=print, keep_worker_images=args.keep_worker_images))
        else:
            print(lab.status())
    except lab.LabError as exc:  # the lab keeps its own root; here it is one more expected failure
        raise SparkbookError(str(exc), stage="lab") from None
    return 0


COMMAND = Command("lab", "the local multi-node test cluster", arguments, handle, __doc__)
