"""`sparkbook compare RUN_A RUN_B`: what changed between two runs, as text and as a page."""
from __future__ import annotations

import argparse
from pathlib import Path

from .command import Command


def arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_a", metavar="RUN_A", help="the baseline: a run dir, or a run id under --outputs")
    p.add_argument("run_b", metavar="RUN_B", help="the run to compare with it")
    p.add_argument("--outputs", default="outputs", help="where run dirs are (default: outputs/)")
    p.add_argument("--html", metavar="FILE", help="the page to write (default: compare/RUN_A-vs-RUN_B.html in "
                                                  "RUN_B's cluster outputs)")


def handle(args: argparse.Namespace) -> int:
    from .. import api

    done = api.compare(args.run_a, args.run_b, Path(args.outputs), html=Path(args.html) if args.html else None)
    print(done.comparison.text())
    print(f"\npage: {done.page}")
    return 0


COMMAND = Command("compare", "what changed between two runs: params, image, decisions, figures", arguments,
                  handle, __doc__)
