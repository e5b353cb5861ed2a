"""`sparkbook run PARAMS`: execute the notebooks in order, printing the driver's progress as it goes."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import yaml

from ..core.values.errors import SparkbookError
from . import show
from .command import Command


class ParameterError(SparkbookError):
    """A `-p NAME=VALUE` that is not one: one line and exit 2, nothing run (argparse's own refusal adds its usage)."""

    exit_kind = "invalid"


def _parameter(text: str) -> tuple[str, Any]:
    name, sep, value = text.partition("=")
    if not sep or not name.isidentifier():
        raise ParameterError(f"-p {text!r}: expected NAME=VALUE", remediation="e.g. -p confirm_cleanup=true")
    try:
        return name, yaml.safe_load(value)
    except yaml.YAMLError as exc:  # its value is read as YAML: one line naming it, never a traceback
        where = getattr(exc, "problem", None) or type(exc).__name__
        raise ParameterError(f"-p {name}: the value is not YAML ({where})", remediation="quote it") from None


def arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("params")
    p.add_argument("-p", "--parameter", action="append", metavar="NAME=VALUE",
                   help="notebook parameter, e.g. -p confirm_cleanup=true")
    p.add_argument("--from", dest="start", metavar="NN", help="start at notebook NN")
    p.add_argument("--to", dest="upto", metavar="NN", help="stop after notebook NN (with --from: NN..MM)")
    p.add_argument("--only", metavar="NN", help="run only notebook NN")
    p.add_argument("--resume", type=Path, metavar="RUN_DIR", help="continue a run at its first failed notebook")
    p.add_argument("--outputs", default="outputs", help="where run dirs go (default: outputs/)")
    p.add_argument("--archive", action="store_true", help="also write RUN_DIR.tar.gz")
    p.add_argument("--break-lock", action="store_true",
                   help="clear a stale run lock (its holder is gone or too old) before taking it")


def handle(args: argparse.Namespace) -> int:
    from .. import api

    options = api.RunOptions(out_root=Path(args.outputs), resume=args.resume, start=args.start, upto=args.upto,
                             only=args.only, parameters=dict(map(_parameter, args.parameter or [])),
                             break_lock=args.break_lock)
    done = api.run(Path(args.params), options, archive=args.archive, say=print)
    show.run_dir(done.run_dir)
    if done.archive:
        print(f"archive: {done.archive}")
    if done.failed:
        exc = done.failed.exception or {}
        print(f"FAILED at {done.failed.name} (cell {exc.get('cell_index')}): {exc.get('ename')}: "
              f"{exc.get('evalue', '')[:500]}\nresume with: sparkbook run {args.params} --resume {done.run_dir}",
              file=sys.stderr)
        return 1
    return 0


COMMAND = Command("run", "execute the notebooks in order with papermill", arguments, handle, __doc__)
