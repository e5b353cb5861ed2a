"""`sparkbook check PARAMS`: validate a params file; touches no node."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .command import Command


def arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("params")


def handle(args: argparse.Namespace) -> int:
    from .. import api

    checked = api.check(Path(args.params))
    params = checked.params
    print(f"{args.params}: ok — cluster {params.cluster}, {len(params.nodes)} node(s), head {params.head.name}, "
          f"runtime {params.runtime.kind}, TP={params.serve.tensor_parallel_size} "
          f"PP={params.serve.pipeline_parallel_size} executor={params.serve.executor or 'chosen by 05'} "
          f"layout={params.serve.layout}")
    if checked.listen_warning:
        print(f"warning: {checked.listen_warning}", file=sys.stderr)
    return 0


COMMAND = Command("check", "validate a params file; touches no node", arguments, handle, __doc__)
