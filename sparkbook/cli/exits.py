"""The exit codes, and an expected failure as one line (a params file: one line per problem)."""
from __future__ import annotations

from ..core.values.errors import ExitKind, SparkbookError
from ..core.values.params import ParamsError

MEANINGS = """0 done; 1 a notebook, a restore step or a command on a node failed (and any other expected failure);
2 invalid params or run request (unknown parameter, notebook selection, host key not vouched for); 3 the run lock is
held, or cannot be taken or cleared; 4 a node cannot be reached or used (SSH, host key, its Docker daemon); 5 `watch`
gave up (its own code, so a service manager restarting it on failure can leave it down); 130 interrupted (Ctrl-C)."""

EXIT_FAILED = 1
EXIT_INVALID = 2
EXIT_LOCKED = 3
EXIT_NODE = 4
EXIT_GAVE_UP = 5
EXIT_INTERRUPTED = 130

CODES: dict[ExitKind, int] = {"failed": EXIT_FAILED, "invalid": EXIT_INVALID, "locked": EXIT_LOCKED,
                              "node": EXIT_NODE, "gave_up": EXIT_GAVE_UP}


def failure(exc: SparkbookError) -> tuple[int, str]:
    """The exit code of an expected failure (its kind's) and what to print: one line starting with its label."""
    code = CODES[exc.exit_kind]
    if isinstance(exc, ParamsError):
        return code, "\n".join([f"{exc.label} ({len(exc.problems)} problem(s)):", *(f"  {p}" for p in exc.problems)])
    where = f" ({exc.stage})" if exc.stage else ""
    return code, f"{exc.label}{where}: {exc}"
