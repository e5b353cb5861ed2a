"""`sparkbook runs [PARAMS|CLUSTER]`: every archived run of a cluster, newest first (and its index.html)."""
from __future__ import annotations

import argparse
from pathlib import Path

from . import show
from .command import Command


def arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("target", nargs="?", metavar="PARAMS|CLUSTER",
                   help="a params file, a cluster name or its outputs dir (default: every cluster)")
    p.add_argument("--status", choices=["ok", "failed", "partial", "running", "unreadable"],
                   help="only the runs of this status")
    p.add_argument("--outputs", default="outputs", help="where run dirs are (default: outputs/)")


def handle(args: argparse.Namespace) -> int:
    from .. import api

    for cluster in api.runs(args.target, Path(args.outputs), status=args.status):
        print(f"{cluster.folder.name}: {len(cluster.shown)} of {len(cluster.runs)} run(s), newest first; page: "
              f"{cluster.page}")
        if cluster.shown:
            print(show.table(cluster.rows()))
        if cluster.watched:
            print(f"watch: {len(cluster.watched)} event(s) in {cluster.watch_record}; the last: "
                  f"{cluster.watched[-1].line()}")
    return 0


COMMAND = Command("runs", "every archived run of a cluster, newest first (and its index.html)",
                  arguments, handle, __doc__)
