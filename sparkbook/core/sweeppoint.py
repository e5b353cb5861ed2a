"""06's sweep points on disk: one `vllm bench serve --save-result` JSON file per concurrency under bench/.

06 writes them; its notebook reads an earlier run's back, and the records (archive, compare) read every run's.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .rundir import point_file, point_files


def read_points(run_dir: Path) -> list[dict[str, Any]]:
    """The saved sweep points of a run dir, by concurrency ([] where 06 did not run)."""
    points = [json.loads(p.read_text()) for p in point_files(run_dir)]
    return sorted(points, key=lambda p: p["max_concurrency"])


def write_point(run_dir: Path, point: dict[str, Any]) -> Path:
    """Save one point in its vLLM-bench JSON form (bench/c<concurrency>.json)."""
    path = point_file(run_dir, point["max_concurrency"])
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(point, indent=1))
    return path
