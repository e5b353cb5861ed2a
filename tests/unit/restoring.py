"""What the restore tests share: params of a cluster on this machine, a restore plan as the session keeps it, a run
dir `sparkbook restore` accepts, and a node that records each command (and its stdin) instead of running it."""
from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from sparkbook.core.values import seal
from sparkbook.core.values.params import Params, load_params
from sparkbook.core.values.rundir import RESTORE_PLAN
from sparkbook.runbook import driver
from sparkbook.runbook.manifest import Manifest, NotebookRun
from sparkbook.runbook.session import Run
from sparkbook.stages.cleanup.restore import RestoreFiles, Step, read_plan


def local_params(base: dict[str, Any], write_params: Callable[..., Path], tmp_path: Path) -> Path:
    """Params of a cluster on this machine (local transport), its run lock under tmp_path."""
    for node in base["nodes"]:
        node["transport"] = "local"
    for node in base["nodes"]:  # the run lock, in the head's state dir: this test's own
        node["state_dir"] = str(tmp_path / "state" / node["name"])
    return write_params(base)


def kept(files: RestoreFiles, params: Params, run_dir: Path) -> list[Step]:
    """The restore plan as 01 leaves it: written by the session, read back as `sparkbook restore` reads it."""
    Run(run_dir / "params.yaml", params, run_dir, "01-cleanup").keep_files(files.files())
    return read_plan(run_dir / RESTORE_PLAN).steps


def restorable_run(tmp_path: Path, local: Path) -> Path:
    """A run dir whose 01 stopped one process: its params copy, manifest and restore plan (sealed, as 01 writes
    it)."""
    run_dir = tmp_path / "20261203T000000Z"
    run_dir.mkdir()
    driver.copy_params(local, load_params(local), run_dir)
    seal.write(run_dir / "restore-plan.json", json.dumps({"params_file": "params.yaml", "steps": [
        {"node": "a", "kind": "process", "name": "python3[40]", "restore": "true"}]}))
    Manifest("unit", run_dir.name, str(local), {}, "2026-12-03T00:00:00+00:00",
             notebooks=[NotebookRun("01-cleanup.ipynb", "ok")]).write(run_dir)
    return run_dir


class Launcher:
    """A node that records each command it is given (a launch) and what it was fed on stdin, and answers ok."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.ran: list[list[str]] = []
        self.stdin: list[bytes | None] = []

    def run(self, argv: list[str], timeout: float = 0, check: bool = False,
            stdin: bytes | None = None) -> SimpleNamespace:
        self.ran.append(argv)
        self.stdin.append(stdin)
        return SimpleNamespace(stdout="", stderr="", ok=True, exit_code=0)
