"""`sparkbook status PARAMS`: exits 0 when every node's server runs and /health answers, 1 otherwise (a stopped or
dark cluster: the table still says what each node shows)."""
from __future__ import annotations

import argparse
from pathlib import Path

from . import show
from .command import Command, params_and_outputs
from .exits import EXIT_FAILED


def handle(args: argparse.Namespace) -> int:
    from .. import api

    st = api.status(Path(args.params), Path(args.outputs))
    print("\n".join(st.lines()))
    print(show.table([n.row(st.deployment) for n in st.nodes]))
    print("serving" if st.serving else "NOT serving: `sparkbook up " + args.params + "` brings the deployment back")
    return 0 if st.serving else EXIT_FAILED


COMMAND = Command("status", "per node: container, Ray, server, model, image, plan, the run that started it, /health",
                  params_and_outputs, handle, __doc__)
