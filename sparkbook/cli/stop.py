"""`sparkbook stop PARAMS`: stop the deployment, recorded in its run, under the run lock. Exits 1 when no run of the
cluster deployed a server, or when a node could not be reached (the others are stopped, and that partial stop is
recorded: the watch leaves it stopped)."""
from __future__ import annotations

import argparse
from pathlib import Path

from .command import Command, params_and_outputs


def arguments(p: argparse.ArgumentParser) -> None:
    params_and_outputs(p)
    p.add_argument("--keep-ray", action="store_true", help="stop only the server; keep the containers and Ray")


def handle(args: argparse.Namespace) -> int:
    from .. import api

    done = api.stop(Path(args.params), Path(args.outputs), keep_ray=args.keep_ray, say=print)
    for s in done.nodes:
        print(f"{s.node:12} vllm serve {s.server}; node container {s.container}"
              + (f"; front {s.front}" if s.front else ""))
    print(f"stopped the deployment of run {done.deployment.run_id} (recorded there); `sparkbook up {args.params}` "
          "brings it back")
    return 0


COMMAND = Command("stop", "stop the deployment (server and node containers); recorded; `up` brings it back",
                  arguments, handle, __doc__)
