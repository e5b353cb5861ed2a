"""The cluster's watch record: what `sparkbook watch` saw and did, one JSON object a line in
outputs/<cluster>/watch.jsonl, beside the run dirs.

A cluster file rather than a run's events: a watch outlives the deployment it starts on (each restart is a new run
of 04 and 05, which becomes the deployment), so its failures, causes, restarts and recoveries read in order in one
place, each naming the run that served and the run that brought it back; the run dirs stay what the runs wrote.
Written by the runbook's watch; read back by the cluster's page and `sparkbook runs`."""
from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, ValidationError

from ..core.values.rundir import WATCH

WatchKind = Literal["started", "check_failed", "cause", "restart", "restart_failed", "back", "deferred", "stale_lock",
                    "paused", "gave_up", "ended"]


class WatchEvent(BaseModel):
    """One thing the watch saw or did; `text` is the line a person reads, the other fields what a program reads."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    at: str  # ISO 8601, UTC
    kind: WatchKind
    run: str | None = None  # the deployment's run (the run whose 05 started what serves); None: the watch's own
    text: str
    cause: str | None = None  # the failure classifier's words (stages.serve.failures)
    node: str | None = None
    evidence: str | None = None  # the log line (or the fact seen) that shows the cause
    remediation: str | None = None
    restart: int | None = None  # its number within watch.restart_window_s
    wait_s: float | None = None  # the back-off waited before it
    up_run: str | None = None  # the run of 04 and 05 that the restart made
    seconds_without_service: float | None = None  # first failed check -> first check answered again
    redeploy: str | None = None  # the restart's own 05 behind the front: its way and what a client saw meanwhile

    def line(self) -> str:
        """The event as the watch prints it (a journal line)."""
        return f"{self.at} {self.kind:<14} {self.text}"


def path(cluster_dir: Path) -> Path:
    return cluster_dir / WATCH


def append(cluster_dir: Path, event: WatchEvent) -> None:
    """Add one event as one line, written whole (a watch killed meanwhile leaves at most a torn last line)."""
    cluster_dir.mkdir(parents=True, exist_ok=True)
    with path(cluster_dir).open("a") as fh:
        fh.write(event.model_dump_json(exclude_none=True) + "\n")


def read(cluster_dir: Path) -> list[WatchEvent]:
    """Every event, oldest first; a line that is not one (torn by a kill, or written by hand) is left out."""
    file = path(cluster_dir)
    if not file.is_file():
        return []
    events = []
    for line in file.read_text(errors="replace").splitlines():
        try:
            events.append(WatchEvent.model_validate_json(line))
        except ValidationError:
            continue
    return events
