"""`sparkbook logs PARAMS`: a node's vLLM server log (or the router's), with --follow until Ctrl-C. Exits 1 when no
run of the cluster deployed a server."""
from __future__ import annotations

import argparse
from pathlib import Path

from .command import Command, params_and_outputs


def arguments(p: argparse.ArgumentParser) -> None:
    params_and_outputs(p)
    p.add_argument("--node", help="the node (default: the head)")
    p.add_argument("--follow", "-f", action="store_true", help="keep printing new lines until Ctrl-C")
    p.add_argument("--router", action="store_true", help="the router's log (serve.layout replicas), on the head")


def handle(args: argparse.Namespace) -> int:
    from .. import api

    api.logs(Path(args.params), api.LogsOptions(Path(args.outputs), args.node, args.follow, args.router), say=print)
    return 0


COMMAND = Command("logs", "a node's vLLM server log (the file 05 writes; docker logs is empty)",
                  arguments, handle, __doc__)
