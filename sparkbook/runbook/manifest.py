"""manifest.json: which notebooks a run executed, how each ended, with its decisions; what a resume starts from; which
sparkbook (version, commit) and which params (hash) made it, so a record read later says what wrote it."""
from __future__ import annotations

import json
import subprocess
from dataclasses import asdict, dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

from ..core.values import seal
from ..core.values.errors import SparkbookError
from ..core.values.rundir import MANIFEST
from ..core.values.stagelist import SERVE

# A notebook's status: pending (not reached yet) and running while the run goes on; ok | failed | not run (after a
# failure) | skipped (--only NN) | skipped (--from NN) once it ended.
NOT_RUN = "not run"
REPO = Path(__file__).resolve().parents[2]


class ManifestError(SparkbookError):
    """manifest.json is not one this sparkbook can act on."""

    exit_kind = "invalid"


@dataclass
class NotebookRun:
    name: str
    status: str = "pending"
    started: str | None = None
    duration_s: float | None = None
    exception: dict[str, Any] | None = None
    decisions: list[dict[str, Any]] = field(default_factory=list)
    cell_limit_s: int | None = None  # papermill's limit for each of its cells (runbook.limits.cell_limit)
    cell_limit_reason: str = ""
    html: str | None = None  # the executed notebook rendered by nbconvert, relative to the run dir


@dataclass
class Manifest:
    cluster: str
    run_id: str
    params_file: str
    parameters: dict[str, Any]
    started: str
    finished: str | None = None
    status: str = "running"  # running | ok | failed | partial (ended ok, but not every notebook ran)
    notebooks: list[NotebookRun] = field(default_factory=list)
    sparkbook_version: str | None = None
    sparkbook_commit: str | None = None  # None: not run from a git checkout
    params_hash: str | None = None  # of the params file as copied into the run dir
    params_source: str | None = None  # the params file relative to the repo; None: outside it (or an older run)

    def data(self) -> dict[str, Any]:
        """The manifest as plain JSON data (what manifest.json holds, what the records read)."""
        return asdict(self)

    def write(self, run_dir: Path) -> Path:
        """manifest.json, whole (a reader never meets half of it) and sealed (what --resume, up and the operator
        commands trust)."""
        return seal.write(run_dir / MANIFEST, json.dumps(self.data(), indent=2))

    @classmethod
    def read(cls, run_dir: Path, *, sealed: bool = True) -> Manifest:
        """The run dir's manifest, sealed by this controller's runbook (seal.SealError where not; `sealed=False`:
        for display only); FileNotFoundError where there is none; ManifestError where it is not a manifest."""
        path = run_dir / MANIFEST
        raw = seal.read(path) if sealed else path.read_bytes()
        try:
            data = json.loads(raw)
            data["notebooks"] = [NotebookRun(**nb) for nb in data["notebooks"]]
            return cls(**data)
        except (ValueError, KeyError, TypeError) as exc:
            raise ManifestError(f"{path}: not a manifest sparkbook reads ({type(exc).__name__})",
                                remediation="start a new run instead: `sparkbook run PARAMS`") from None

    def served(self) -> list[str]:
        """The notebooks of 05 (any A/B arm's) that ended ok, in run order: none where the run deployed nothing."""
        return [nb.name for nb in self.notebooks if SERVE.owns(nb.name) and nb.status == "ok"]

    def first_failed(self) -> NotebookRun | None:
        """The notebook the run stopped at (None: none failed)."""
        return next((nb for nb in self.notebooks if nb.status == "failed"), None)

    def close(self, selected: list[str], only: str | None) -> None:
        """Each notebook's final status once the run stops: those never reached are `not run` (after a failure) or
        `skipped (--only NN / --from NN / --to NN)`; the run is failed, partial (not every notebook ran ok) or ok."""
        names = [nb.name for nb in self.notebooks]
        first, last = names.index(selected[0]), names.index(selected[-1])
        for i, nb in enumerate(self.notebooks):
            if nb.status in ("pending", "running"):
                nb.status = (NOT_RUN if nb.name in selected else f"skipped (--only {only})" if only
                             else f"skipped (--from {selected[0][:2]})" if i < first
                             else f"skipped (--to {selected[-1][:2]})" if i > last else NOT_RUN)
        failed = any(nb.status == "failed" for nb in self.notebooks)
        self.status = "failed" if failed else "ok" if all(nb.status == "ok" for nb in self.notebooks) else "partial"


def sparkbook_version() -> tuple[str | None, str | None]:
    """The installed package's version and the git commit of the checkout it runs from (None outside git)."""
    try:
        version: str | None = metadata.version("sparkbook")
    except metadata.PackageNotFoundError:
        version = None
    try:
        done = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=10, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return version, None
    return version, done.stdout.strip() or None if done.returncode == 0 else None
