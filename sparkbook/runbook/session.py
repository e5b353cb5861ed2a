"""The notebook's session: one run of the runbook opened on a params file and a run dir, recording what the stages
return (events, decisions, results) into the run dir and showing it, redacted, in the cell; the A/B arms' naming."""
from __future__ import annotations

import base64
import json
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from ..core.analysis import depthsweep
from ..core.analysis.benchcompare import EarlierSweep
from ..core.analysis.depthsweep import DepthSweep
from ..core.analysis.quality import Reference
from ..core.cluster import imagememo
from ..core.cluster.context import Context
from ..core.cluster.nodes import Cluster, Result
from ..core.cluster.progress import Progress
from ..core.cluster.qualityapi import save_reference
from ..core.cluster.runtimes import runtime_for
from ..core.values import atomic, seal, state
from ..core.values.abarm import AB_ARMS, BASELINE, KEPT, AbArm, arms_of, changes_image
from ..core.values.errors import SparkbookError
from ..core.values.evidence import (
    Decision,
    Event,
    ProbedBefore,
    Shown,
    StageOutcome,
    markdown_text,
    now,
    table_rows,
    tail,
    to_data,
)
from ..core.values.handoff import AbBaseline, ImageChoice
from ..core.values.params import Params, load_params
from ..core.values.redact import Redactor
from ..core.values.rundir import AB_BASELINE, EVENTS, INTERACTIVE, LOGS, SEALED, relative_paths, runs_before
from ..core.values.state import H, Handoffs, StateError
from ..core.values.sweeppoint import SweepPoint, write_point
from ..records.earlier import earlier_sweep, images_before, probed_before
from .manifest import Manifest

if TYPE_CHECKING:
    from matplotlib.figure import Figure

DECISION_MIME = "application/vnd.sparkbook.decision+json"

LONG_TEXT_LINES = 30  # longer text is shown as its tail, the whole of it in a log file
TAIL_LINES = 20


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-")[:60] or "output"


class Run:
    """One execution of the runbook for one cluster: params, run dir, state and evidence."""

    def __init__(self, params_file: Path, params: Params, run_dir: Path, stage: str, ab_arm: AbArm | None = None):
        self.params_file, self.params, self.run_dir, self.stage = params_file, params, run_dir, stage
        self.ab_arm = ab_arm
        self.redactor = Redactor.from_env(params.secrets)
        self._cluster: Cluster | None = None
        (run_dir / LOGS).mkdir(parents=True, exist_ok=True)

    @property
    def cluster(self) -> Cluster:
        if self._cluster is None:
            self._cluster = Cluster(self.params, on_trust=self._trusted, progress=Progress)
        return self._cluster

    def context(self, image: str | None = None) -> Context:
        """What the stages are handed (params, nodes, runtime, run dir, the run's hand-offs; the image from 04 on).
        The image A/B's baseline and kept arms are handed 03's baseline image (AbBaseline) as the image to serve."""
        handoffs = Handoffs(self.run_dir, stage=self.stage)
        arm_image = self.arm_image()
        return Context(self.params, self.cluster, runtime_for(self.params), self.run_dir, image,
                       handoffs.adding(arm_image) if arm_image else handoffs)

    def arm_image(self) -> ImageChoice | None:
        """The image this arm serves where it is not 03's choice: the image A/B's baseline (and kept) arm."""
        if self.ab_arm not in (BASELINE, KEPT) or not changes_image(self.params.benchmark.ab):
            return None
        chosen = self.recall(AbBaseline)
        if chosen.image is None:
            raise StateError(f"{self.stage}: 03 found no baseline for the A/B of images ({chosen.reason}); this "
                             "arm has nothing to serve", stage=self.stage)
        return chosen.image

    def serving_image(self) -> ImageChoice | None:
        """For 03's image A/B: the image of the cluster's deployment, the newest earlier run whose 05 ended ok (its
        sealed record; a run dir this controller did not seal is passed over). None: nothing served before."""
        for run in runs_before(self.run_dir):
            try:
                if Manifest.read(run).served():
                    return state.load(run, ImageChoice, sealed=True)
            except (OSError, SparkbookError):  # no manifest, torn, foreign, or no 03 in it
                continue
        return None

    @property
    def bench_root(self) -> Path:
        """The dir whose bench/ holds this notebook's sweep points: the run dir, or the A/B baseline arm's own
        (so the run's bench/, which comparisons and the archive read, is always the params' own plan)."""
        return self.run_dir / AB_BASELINE if self.ab_arm == BASELINE else self.run_dir

    def _trusted(self, host: str, fingerprint: str) -> None:
        self.record("host_key_trusted", {"host": host, "fingerprint": fingerprint})

    # --- state carried between notebooks ------------------------------------------------------
    def remember(self, value: H) -> H:
        """Store a hand-off in state.json under its key (redacted) for the notebooks after this one."""
        state.store(self.run_dir, value, lambda d: relative_paths(self.redactor.data(d), self.run_dir), self.stage)
        return value

    def recall(self, kind: type[H]) -> H:
        """The hand-off of type `kind` an earlier notebook stored, validated (StateError when it cannot be)."""
        return state.load(self.run_dir, kind, self.stage)

    def record_outcome(self, outcome: StageOutcome) -> None:
        """Record what a stage's run returned: its logs, its decisions (shown) and events in their order, its
        hand-offs, what it learned about an image (kept beside the cluster's runs for later runs); then raise the
        error that ended it, so a failed stage's evidence is kept as a good one's."""
        for name, text in outcome.logs.items():
            self.write_log(name, text)
        for item in outcome.records:
            if isinstance(item, Event):
                self.record(item.kind, item.data)
            else:
                self.decide(item)
        for value in outcome.handoffs:
            self.remember(value)
        for learned in outcome.learned:
            imagememo.keep(self.run_dir, learned)
        if outcome.error is not None:
            raise outcome.error

    # --- what the stages return to keep, and what earlier runs recorded for them ---------------------
    def keep_sweep(self, points: Iterable[SweepPoint], depth: DepthSweep | None) -> list[Path]:
        """Write 06's sweep points (bench/c<concurrency>.json, vLLM-bench's form) and its depth points
        (bench/depth.json, where measured) under `bench_root`; the paths written."""
        paths = [write_point(self.bench_root, point) for point in points]
        return paths + ([depthsweep.write(self.bench_root, depth)] if depth is not None else [])

    def keep_reference(self, reference: Reference | None) -> Path | None:
        """Write the answer checks' reference 05 made beside the cluster's runs (outputs/<cluster>/quality/<key>.json),
        where later runs of the same model and plan compare with it; None: 05 made none."""
        return save_reference(self.run_dir, reference) if reference is not None else None

    def probed_before(self, refs: Iterable[str]) -> dict[str, ProbedBefore]:
        """For 03: the image ID the newest earlier run of the cluster probed under each of `refs`."""
        return probed_before(self.run_dir, refs)

    def images_before(self) -> dict[str, ProbedBefore]:
        """For 02: the image ID the cluster's last run (sealed) recorded under each candidate's name."""
        return images_before(self.run_dir)

    def earlier_sweep(self) -> EarlierSweep | None:
        """For 06: the earlier run's sweep to compare with, and this run's setup's history (None: no earlier run)."""
        return earlier_sweep(self.run_dir)

    # --- evidence -----------------------------------------------------------------------------
    def record(self, kind: str, payload: Any) -> None:
        event = {"at": now(), "stage": self.stage, "kind": kind,
                 "data": relative_paths(self.redactor.data(to_data(payload)), self.run_dir)}
        with (self.run_dir / EVENTS).open("a") as fh:
            fh.write(json.dumps(event) + "\n")

    def keep_files(self, files: Mapping[str, str]) -> None:
        """Write the files a stage hands over into the run dir (redacted), as it hands them: 01's restore plan, before
        it stops anything. Each whole, readable by its owner alone (they hold command lines); those the runbook acts
        on later (the restore plan) sealed."""
        for name, text in files.items():
            write = seal.write if name in SEALED else atomic.write
            write(self.run_dir / name, self.redactor.text(text), 0o600)

    def write_log(self, name: str, text: str) -> Path:
        path = self.run_dir / LOGS / name
        path.write_text(self.redactor.text(text))
        return path

    def _new_log(self, what: str, text: str) -> Path:
        """Write text to a log of its own (never overwriting another) and return its path."""
        base = _slug(f"{self.stage}-{what}" if self.stage else what)
        name, k = f"{base}.log", 1
        while (self.run_dir / LOGS / name).exists():
            k += 1
            name = f"{base}-{k}.log"
        return self.write_log(name, text)

    def decide(self, decision: Decision) -> Decision:
        self.record("decision", decision)
        data = self.redactor.data(to_data(decision))
        _display({"text/markdown": decision.markdown(self.redactor.text), DECISION_MIME: data})
        return decision

    def results(self, results: Iterable[Result], title: str = "") -> None:
        """Record command results and show them as a table with output tails."""
        rows = []
        for r in results:
            self.record("result", {**to_data(r), "stdout": tail(r.stdout, 200), "stderr": tail(r.stderr, 200)})
            row = {"node": r.node, "command": r.command, "exit": r.exit_code, "seconds": round(r.duration_s, 2),
                   "output (tail)": tail(r.stdout or r.stderr, 3)}
            if len((r.stdout + r.stderr).strip().splitlines()) > 3:
                row["full log"] = str(self._new_log(f"{r.node}-{r.argv[0] if r.argv else 'command'}",
                                                    f"$ {r.command}\n{r.stdout}\n--- stderr ---\n{r.stderr}"))
            rows.append(row)
        if any("full log" in row for row in rows):
            rows = [{**row, "full log": row.get("full log", "")} for row in rows]
        self.show(rows, title=title)

    def show(self, value: Any, title: str = "") -> None:
        """Display a value (rows, dataclasses, text) redacted: tables for rows, text for the rest."""
        if title:
            clean = self.redactor.text(title)
            _display({"text/markdown": f"**{markdown_text(clean)}**", "text/plain": clean})
        data = self.redactor.data(to_data(value))
        rows = table_rows(data)
        if rows is not None:
            _display_table(rows)
        elif isinstance(data, str) and len(data.splitlines()) > LONG_TEXT_LINES:
            path = self._new_log(title or "output", data)
            _display({"text/plain": f"… last {TAIL_LINES} of {len(data.splitlines())} lines; all of them in {path}\n"
                                    + tail(data, TAIL_LINES)})
        elif isinstance(data, str):
            _display({"text/plain": data})
        else:
            _display({"text/plain": json.dumps(data, indent=2, default=str)})

    def show_all(self, shown: Iterable[Shown]) -> None:
        """Show each of what a stage's preview or outcome lists, in its order."""
        for item in shown:
            self.show(item.value, title=item.title)

    def show_figures(self, figures: Mapping[str, Figure], where: Path) -> list[Path]:
        """Save each figure a stage returned as a PNG named by its key under `where` (a dir of the run dir) and
        show it; the paths written."""
        where.mkdir(parents=True, exist_ok=True)
        paths = []
        for name, figure in figures.items():
            path = where / name
            figure.savefig(path, dpi=110)
            _display({"image/png": base64.b64encode(path.read_bytes()).decode(), "text/plain": str(path)})
            paths.append(path)
        return paths

    def close(self) -> None:
        if self._cluster:
            self._cluster.close()


def _display(bundle: dict[str, Any]) -> None:
    try:
        from IPython import get_ipython
        from IPython.display import display
    except ImportError:
        get_ipython = None
    if get_ipython is not None and get_ipython() is not None:
        display(bundle, raw=True)  # type: ignore[no-untyped-call]
    else:
        print(bundle.get("text/plain") or bundle.get("text/markdown"))


def _display_table(rows: list[dict[str, Any]]) -> None:
    import pandas as pd

    frame = pd.DataFrame(rows)
    with pd.option_context("display.max_colwidth", 120, "display.width", 200):
        _display({"text/html": frame.to_html(index=False, escape=True).replace("\\n", "<br>"),
                  "text/plain": frame.to_string(index=False)})


def open_run(params_file: str | Path = "../params/lab.yaml", run_dir: str | Path = "", stage: str = "",
             ab_arm: str | None = None) -> Run:
    """Validate params and open the run dir (default: outputs/<cluster>/interactive next to params/). The A/B's
    baseline and kept arms (the driver passes them; core.values.abarm) run the params' A/B baseline (Params.ab_baseline)
    and record under `<stage>.ab-<arm>`; the image A/B's kept arm records the baseline image as the run's image."""
    params_file = Path(params_file).resolve()
    params = load_params(params_file)
    arm = _arm(ab_arm, params)
    if arm in (BASELINE, KEPT):
        params, stage = params.ab_baseline(), f"{stage}.ab-{arm}"
    if not run_dir:
        run_dir = params_file.parent.parent / "outputs" / params.cluster / INTERACTIVE
    run_dir = Path(run_dir).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    run = Run(params_file, params, run_dir, stage, arm)
    if arm == KEPT and (image := run.arm_image()) is not None:
        run.remember(image)  # the image the deployment serves from here on: `up`, `watch` and a rollback keep it
    return run


def _arm(ab_arm: str | None, params: Params) -> AbArm | None:
    """`ab_arm` as an arm of the params' A/B: "replicas" is no arm of `benchmark.ab: speculative`."""
    if ab_arm is None:
        return None
    if ab_arm not in AB_ARMS:
        raise ValueError(f"ab_arm: {ab_arm!r} is not an A/B arm (one of {', '.join(AB_ARMS)}, or None)")
    if params.benchmark.ab is None or ab_arm not in arms_of(params.benchmark.ab):
        raise ValueError(f"ab_arm: {ab_arm!r} is no arm of benchmark.ab: {params.benchmark.ab} (its arms: "
                         + (", ".join(arms_of(params.benchmark.ab)) if params.benchmark.ab else "none") + ")")
    return cast(AbArm, ab_arm)
