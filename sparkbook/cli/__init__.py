"""`sparkbook COMMAND`: the command line. It parses and renders; sparkbook.api does the work. Each command is a module
of this package (its help, arguments and handler), listed once in COMMANDS, which makes the help.

An expected failure prints one line to stderr (the message and what to do; invalid params: one line per problem),
never a traceback, and exits with its kind's code."""
from __future__ import annotations

import argparse
import sys

from ..core.values.errors import SparkbookError
from . import check, compare, exits, lab, logs, plan, restore, run, runs, status, stop, unlock, up, watch
from .command import Command
from .exits import EXIT_INTERRUPTED, failure

# The commands, in the order `sparkbook --help` lists them.
COMMANDS: tuple[Command, ...] = (check.COMMAND, plan.COMMAND, run.COMMAND, unlock.COMMAND, restore.COMMAND,
                                 runs.COMMAND, compare.COMMAND, up.COMMAND, status.COMMAND, logs.COMMAND,
                                 stop.COMMAND, watch.COMMAND, lab.COMMAND)


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="sparkbook", description=f"{__doc__}\nExit codes: {exits.MEANINGS}",
                                  formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = top.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        one = sub.add_parser(command.name, help=command.help, description=command.description)
        command.arguments(one)
        one.set_defaults(handle=command.handle)
    return top


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        code: int = args.handle(args)
        return code
    except SparkbookError as exc:
        code, text = failure(exc)
        print(text, file=sys.stderr)
        return code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
