"""What one command of the command line is: its name and help, its arguments, and its handler (which calls
sparkbook.api, imported inside it so that building the parser loads nothing heavy, and renders the result)."""
from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass

Handler = Callable[[argparse.Namespace], int]  # the exit code


@dataclass(frozen=True)
class Command:
    name: str
    help: str
    arguments: Callable[[argparse.ArgumentParser], None]
    handle: Handler
    description: str | None = None  # what `sparkbook NAME --help` says beyond `help` (its module's docstring)


def params_and_outputs(p: argparse.ArgumentParser) -> None:
    """PARAMS and --outputs, what each operator command takes."""
    p.add_argument("params")
    p.add_argument("--outputs", default="outputs", help="where run dirs are (default: outputs/)")
