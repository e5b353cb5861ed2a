"""`sparkbook restore RUN_DIR`: bring back what 01-cleanup stopped, and show each step and each target's verdict.

It exits 1 when it is refused (each conflict is named; nothing was restored) or a restored target does not come back
(one the plan cannot relaunch is skipped, saying why), 2 when a target to relaunch reads a secret this environment
does not set (named; nothing was restored)."""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from ..core.values.stagelist import CLEANUP
from .command import Command

if TYPE_CHECKING:
    from ..api import RestoreOutcome


def arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir")
    p.add_argument("--stop-new", action="store_true",
                   help="first stop the node containers this run started (by name and recorded ID)")


def handle(args: argparse.Namespace) -> int:
    from .. import api

    run_dir = Path(args.run_dir)
    try:
        out = api.restore(run_dir, stop_new=args.stop_new, say=print)
    except (api.RestoreRefused, api.RestoreFailed) as exc:
        _show(run_dir, exc.outcome)
        raise
    _show(run_dir, out)
    return 0


def _show(run_dir: Path, out: RestoreOutcome) -> None:
    """What the restore did, step by step, and each target's verdict with the log tail of a failed one."""
    if out.result == "nothing to restore":
        print(f"{run_dir}: {CLEANUP.name} stopped nothing in this run: nothing to restore; nothing was changed")
    for con in out.conflicts:
        print(f"in the way: {con.line()}")
    if out.unread_ports:
        print(f"{CLEANUP.id} saw no listening port of {', '.join(out.unread_ports)} (still starting, or none): a "
              "conflict on their ports cannot be found before acting")
    for a in [*out.stopped_new, *out.actions]:
        print(f"{a.node:12} {a.name:24} {'ok' if a.ok else 'FAILED'}  {a.command}  {a.detail}")
    for c in out.checks:
        print(f"{c.node:12} {c.name:24} {'verified' if c.ok else 'NOT BACK'}  {c.state}; health {c.health}; "
              f"memory {c.memory}" + "".join(f"\n    {p}" for p in c.problems)
              + ("\n    log tail:\n      " + c.log_tail.replace("\n", "\n      ") if c.log_tail else ""))
    if out.checks:
        print(f"{out.result}: {sum(c.ok for c in out.checks)}/{len(out.checks)} target(s) back and verified")


COMMAND = Command("restore", "bring back what 01-cleanup stopped (its run dir's restore plan)",
                  arguments, handle, __doc__)
