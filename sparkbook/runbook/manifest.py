"""manifest.json: which notebooks a run executed, how each ended, with its decisions; what a resume starts from."""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..core.rundir import MANIFEST


@dataclass
class NotebookRun:
    name: str
    status: str = "pending"  # pending | ok | failed | skipped
    started: str | None = None
    duration_s: float | None = None
    exception: dict[str, Any] | None = None
    decisions: list[dict[str, Any]] = field(default_factory=list)
    cell_limit_s: int | None = None  # papermill's limit for each of its cells (runbook.limits.cell_limit)
    cell_limit_reason: str = ""


@dataclass
class Manifest:
    cluster: str
    run_id: str
    params_file: str
    parameters: dict[str, Any]
    started: str
    finished: str | None = None
    status: str = "running"  # running | ok | failed
    notebooks: list[NotebookRun] = field(default_factory=list)

    def data(self) -> dict[str, Any]:
        """The manifest as plain JSON data (what manifest.json holds, what the records read)."""
        return asdict(self)

    def write(self, run_dir: Path) -> Path:
        path = run_dir / MANIFEST
        path.write_text(json.dumps(self.data(), indent=2))
        return path

    @classmethod
    def read(cls, run_dir: Path) -> Manifest:
        data = json.loads((run_dir / MANIFEST).read_text())
        data["notebooks"] = [NotebookRun(**nb) for nb in data["notebooks"]]
        return cls(**data)
