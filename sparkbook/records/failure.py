"""A failed run's evidence as a colleague wants it first: the log lines around each node log's first error, beside
the cause the failing stage classified, with links to the logs and to the failing notebook.

Read from the run dir only: a record written before a cause was known still shows its logs' real first error,
and nothing is inferred that the files do not hold."""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from ..core.values.rundir import LOGS

# A line that reports an error (argparse's "prog: error:", Python's traceback, vLLM/Ray's ERROR level, the kernel's
# OOM killer); warnings and the words inside identifiers (error_handler) do not count.
ERROR_LINE = re.compile(r"\berror\b|^Traceback|\bERROR\b|\bKilled\b|out of memory|\bFATAL\b", re.IGNORECASE)
CONTEXT = 3  # lines shown either side of the first error


@dataclass(frozen=True)
class LogExcerpt:
    """The first error of one log and the lines around it."""

    log: str  # relative to the run dir
    line_no: int  # 1-based, of the error line
    error: str  # the error line itself
    lines: list[str]  # CONTEXT lines before, the error, CONTEXT after


def stage_logs(run_dir: Path, notebook: str) -> list[Path]:
    """The logs the notebook's stage wrote: named after its number (`05-...`) or its stage word (`serve-...`)."""
    folder = run_dir / LOGS
    if not folder.is_dir():
        return []
    number, word = notebook[:2], notebook[3:].split("-")[0].split(".")[0]
    return sorted(p for p in folder.iterdir() if p.is_file() and p.name.startswith((f"{number}-", f"{word}-")))


def first_error(text: str) -> tuple[int, list[str]] | None:
    """The index of the first error line and the lines of the text, or None when no line reports an error."""
    lines = text.splitlines()
    hit = next((i for i, line in enumerate(lines) if ERROR_LINE.search(line)), None)
    return None if hit is None else (hit, lines)


def excerpt(run_dir: Path, log: Path) -> LogExcerpt | None:
    found = first_error(log.read_text(errors="replace"))
    if found is None:
        return None
    hit, lines = found
    return LogExcerpt(str(log.relative_to(run_dir)), hit + 1, lines[hit].strip(),
                      lines[max(0, hit - CONTEXT):hit + CONTEXT + 1])


def excerpts(run_dir: Path, notebook: str) -> list[LogExcerpt]:
    """Each of the failing stage's logs that reports an error, with the lines around its first."""
    return [x for x in (excerpt(run_dir, p) for p in stage_logs(run_dir, notebook)) if x is not None]
