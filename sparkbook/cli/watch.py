"""`sparkbook watch PARAMS`: keep the deployment serving. Exits 0 at its bound (--checks, --for) or on SIGTERM, 5 when
it gives up (its restarts did not keep the deployment serving, or a run lock stale only by its age blocks them), 2 when
another watch of the cluster runs (or its restart budget file is not one a watch wrote), 1 when nothing is deployed."""
from __future__ import annotations

import argparse
from pathlib import Path

from .command import Command, params_and_outputs


def _positive_int(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of at least 1")
    return int(text)


def arguments(p: argparse.ArgumentParser) -> None:
    params_and_outputs(p)
    bound = p.add_mutually_exclusive_group()
    bound.add_argument("--checks", type=_positive_int, metavar="N", help="end after N checks (tests, cron)")
    bound.add_argument("--for", dest="for_s", type=float, metavar="SECONDS", help="end after SECONDS (between checks)")


def say(line: str) -> None:
    print(line, flush=True)  # a journal line as it happens, not when a pipe's buffer fills


def handle(args: argparse.Namespace) -> int:
    from .. import api

    api.watch(Path(args.params), api.WatchOptions(Path(args.outputs), args.checks, args.for_s, sigterm_ends=True),
              say=say)
    return 0


COMMAND = Command("watch", "keep the deployment serving: /health and a one-token completion every watch.interval_s; "
                           "on a failure the cause from the logs, `up` with back-off, then give up (exit 5); every "
                           "event in outputs/<cluster>/watch.jsonl", arguments, handle, __doc__)
