"""A copy of the session's full run in an outputs root of its own, for the lab tests that act on it (`up`, `watch`,
05 alone): what they record there leaves the full run its own outputs' deployment, which the tests after them read."""
from __future__ import annotations

import shutil
from pathlib import Path

from sparkbook.core.rundir import QUALITY


def outputs_copy(run_dir: Path, root: Path) -> Path:
    """`run_dir` and its cluster's quality/ references (05's answer checks read them beside the runs) copied under
    `root`/<cluster>/; the copy's run dir."""
    cluster = root / run_dir.parent.name
    shutil.copytree(run_dir.parent / QUALITY, cluster / QUALITY)
    return Path(shutil.copytree(run_dir, cluster / run_dir.name))
