"""The example records as git holds them: tests about committed records read this copy, not the working tree,
where a local run may have added or rewritten files (issue 27). The copy also proves the records stand on their
own: every link is checked in a folder that holds nothing but what git tracks."""
from __future__ import annotations

import atexit
import functools
import shutil
import subprocess
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = "outputs/examples"


def tracked(pattern: str = EXAMPLES) -> list[str]:
    """Paths (from the repo root) that git's index holds under `pattern`."""
    out = subprocess.run(["git", "ls-files", "-z", "--", pattern], cwd=REPO, capture_output=True, text=True,
                         timeout=30, check=True).stdout
    return [p for p in out.split("\0") if p]


@functools.cache
def examples() -> Path:
    """outputs/examples as git's index holds it, checked out into a temporary folder (once per test session)."""
    dest = Path(tempfile.mkdtemp(prefix="sparkbook-committed-"))
    atexit.register(shutil.rmtree, dest, ignore_errors=True)
    subprocess.run(["git", "checkout-index", "-z", "--stdin", f"--prefix={dest}/"], cwd=REPO,
                   input="\0".join(tracked()), text=True, timeout=120, check=True)
    return dest / EXAMPLES
