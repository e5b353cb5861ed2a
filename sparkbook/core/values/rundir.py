"""A run dir's layout: the one place that names the files a run writes under outputs/<cluster>/<run-id>/.

The runbook driver, the notebooks' record and state, the stages and the records (archive, pages, compare) all read
and write the same dir; naming its files here keeps them agreeing. Core, so that core's writers need nothing above it.
"""
from __future__ import annotations

import hashlib
import re
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

MANIFEST = "manifest.json"  # the driver's: which notebooks ran, how they ended, their decisions
STATE = "state.json"  # the hand-offs one notebook leaves the next (core.values.state)
EVENTS = "events.jsonl"  # every recorded result, decision and value (runbook.session)
PARAMS_COPY = "params.yaml"  # the params file as the run used it (for `sparkbook compare`)
INDEX = "index.html"  # a run's page, and a cluster's page over its runs one level up
WATCH = "watch.jsonl"  # one level up too: `sparkbook watch`'s record of the cluster (records.watchlog)
WATCH_BUDGET = "watch-restarts.json"  # beside it: the watch's restarts in its window (runbook.restarts)
WATCH_LOCK = "watch.lock"  # beside it: held (flock) by the one watch of the cluster (runbook.watchlock)
LOGS = "logs"  # full command output, where a cell shows a tail
BENCH = "bench"  # 06's sweep points, one vLLM-bench JSON file per concurrency
SOAK_SERIES = "soak.json"  # 06's soak: its samples, windows and verdict, in bench/
SOAK_FIGURE = "soak.png"  # 06's soak over time, in bench/ beside its series (soak.json); the run page links it
AB_BASELINE = "ab-baseline"  # the A/B's baseline arm (benchmark.ab): its 06 keeps its sweep points in its own bench/
RESTORE_PLAN = "restore-plan.json"  # 01's plan of what it stopped, for `sparkbook restore`
RESTORE_SCRIPT = "restore.sh"  # the same steps as a shell script, for a node without sparkbook
# what the runbook acts on when it reads it back: sealed when written (core.values.seal), verified before use
SEALED = (MANIFEST, STATE, RESTORE_PLAN)
# beside the cluster's runs: the agreement check's references, one file per key (core.cluster.qualityapi)
QUALITY = "quality"
# beside them too: what the runbook learned about an image, by its ID (core.cluster.imagememo), its dir 0700
LEARNED = "learned"
INTERACTIVE = "interactive"  # the run dir of notebooks opened by hand (no driver, no run id)
RUN_ID = re.compile(r"^\d{8}T\d{6}Z$")


def new_run_id() -> str:
    """A run id: the UTC start time, so run ids sort by when the runs started."""
    return datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")


def is_run_dir(path: Path) -> bool:
    """A run dir: it has a manifest, or is named like a run id (a run whose manifest is gone)."""
    return path.is_dir() and ((path / MANIFEST).exists() or bool(RUN_ID.match(path.name)))


def point_file(run_dir: Path, concurrency: int) -> Path:
    """Where 06 keeps the sweep point at `concurrency`."""
    return run_dir / BENCH / f"c{concurrency:04d}.json"


def point_files(run_dir: Path) -> list[Path]:
    """The sweep point files of a run dir (none when 06 did not run there)."""
    return sorted((run_dir / BENCH).glob("c*.json"))


def quality_reference(run_dir: Path, key: str) -> Path:
    """Where the agreement check's reference for `key` lies: in the cluster's outputs, beside `run_dir`."""
    return run_dir.parent / QUALITY / f"{key}.json"


def learned_file(run_dir: Path, kind: str, key: str) -> Path:
    """Where an answer learned about an image is kept: in the cluster's outputs, beside `run_dir`, so any later run
    of the cluster finds it (core.values.learned.memo_key gives `key`)."""
    return run_dir.parent / LEARNED / f"{kind}-{key[:32]}.json"


def runs_before(run_dir: Path) -> list[Path]:
    """The sibling run dirs older than `run_dir` by run id, newest first (every one, for a dir without a run id,
    such as a notebook's interactive dir)."""
    if not run_dir.parent.is_dir():
        return []
    mine = run_dir.name if RUN_ID.match(run_dir.name) else None
    return sorted((d for d in run_dir.parent.iterdir() if d.is_dir() and RUN_ID.match(d.name)
                   and (mine is None or d.name < mine)), key=lambda d: d.name, reverse=True)


def earlier_run(run_dir: Path) -> Path | None:
    """The run before this one that has sweep points: the newest of runs_before that has any."""
    return next((d for d in runs_before(run_dir) if point_files(d)), None)


def relative_text(text: str, run_dir: Path) -> str:
    """`text` with every absolute path into the run dir written relative to it (`logs/x.log`, `.`) and into its
    parent, the cluster's outputs, as `..` (`../<run-id>/...`): a run dir copied elsewhere or unpacked from its
    archive still resolves them."""
    prefixes: dict[str, str] = {}
    for base in dict.fromkeys((run_dir, run_dir.resolve())):
        prefixes |= {f"{base.parent}/": "../", f"{base.parent}": "..", f"{base}/": "", f"{base}": "."}
    # longest first; a bare dir only where no name character follows (R1 is not the start of R10)
    pattern = re.compile("|".join(re.escape(k) + ("" if k.endswith("/") else r"(?![\w.-])")
                                  for k in sorted(prefixes, key=len, reverse=True)))
    return pattern.sub(lambda m: prefixes[m.group(0)], text)


def relative_paths(data: Any, run_dir: Path) -> Any:
    """`data` (JSON-like) with relative_text applied to every string in it."""
    if isinstance(data, dict):
        return {k: relative_paths(v, run_dir) for k, v in data.items()}
    if isinstance(data, list):
        return [relative_paths(v, run_dir) for v in data]
    return relative_text(data, run_dir) if isinstance(data, str) else data


def params_hash(run_dir: Path) -> str | None:
    """The first 12 hex digits of the sha256 of the params file the run copied (None: it kept none)."""
    path = run_dir / PARAMS_COPY
    return hashlib.sha256(path.read_bytes()).hexdigest()[:12] if path.is_file() else None
