"""`sparkbook unlock PARAMS`: clear the run lock on the head node (after a killed run)."""
from __future__ import annotations

import argparse
from pathlib import Path

from .command import Command


def arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("params")
    p.add_argument("--force", action="store_true", help="even when its holder still runs on this host")


def handle(args: argparse.Namespace) -> int:
    from .. import api

    result = api.unlock(Path(args.params), force=args.force)
    done = result.done
    if done.holder is None:
        print(f"{result.where}: no lock; nothing to clear")
    else:
        print(f"{result.where}: {'removed' if done.removed else 'could NOT remove'} the lock of "
              f"{done.holder.describe()}" + (f" (stale: {done.stale})" if done.stale else ""))
    return 0 if result.cleared else 1


COMMAND = Command("unlock", "clear the run lock on the head node (after a killed run)", arguments, handle, __doc__)
