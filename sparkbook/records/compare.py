"""Two runs side by side: what changed (params, image and versions, decisions) and what it did to the figures.

The sweep points are compared by core.analysis.benchcompare (06 shares it): per concurrency and metric the % change and
the noise band, the figure's spread over repeats (within the two runs where they have them, else over the earlier
runs of the same params and image); a move inside the band is neither worse nor better, and without any estimate
it says so. Runs whose serving plan or image differ are said to at the top, and their changes are not judged.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ..core.analysis import depthsweep
from ..core.analysis.benchcompare import (
    CLOCK_DIFF,
    POINT_METRICS,
    Change,
    Setups,
    band,
    change_lines,
    changes,
    clock_causes,
    clock_lines,
    delta_lines,
    delta_rows,
    flatten,
    history_bands,
    judged,
    mean_sm_mhz,
    params_of,
    points_of,
    setups,
)
from ..core.analysis.benchstats import SINGLE_STREAM, Delta, compare
from ..core.analysis.depthsweep import DepthDelta
from ..core.values.rundir import PARAMS_COPY, is_run_dir
from ..core.values.sweeppoint import SweepPoint
from .archive import RunRecord, fmt, outputs_tree, read_run

__all__ = ["CLOCK_DIFF", "POINT_METRICS", "Change", "Comparison", "FigurePair", "band", "clock_causes",
           "compare_runs", "delta_rows", "flatten", "history", "mean_sm_mhz", "page_path", "params_changes"]

COMPARE_DIR = "compare"  # under outputs/<cluster>/: the comparison pages, never beside the run dirs
COMMITTED = "examples"  # outputs/examples/: the records git tracks

RECORD_FIGURES = (("time to ready s", "ready_s"), (SINGLE_STREAM, "single_tok_s"), ("peak tok/s", "peak_tok_s"),
           ("peak at concurrency", "peak_concurrency"), ("% of roofline", "roofline_pct"))
IMAGE_FACTS = ("image", "image id", "vllm", "ray")  # of setup_side_by_side's rows, those of the image


@dataclass(frozen=True)
class FigurePair:
    name: str
    a: float | None
    b: float | None

    @property
    def change_pct(self) -> float | None:
        return 100.0 * (self.b - self.a) / abs(self.a) if self.a and self.b is not None else None


@dataclass(frozen=True)
class Comparison:
    a: RunRecord
    b: RunRecord
    params: list[Change]  # the params keys (and -p parameters) that differ
    params_note: str | None  # why the params could not be compared (None: they were)
    setup: list[Change]  # image, its ID and versions, executor, layout: all of them, changed or not
    setups: Setups  # the serving plan and image differences: the deltas are not judged where there are any
    decisions: list[Change]  # "notebook: question" whose choice differs
    figures: list[FigurePair]
    deltas: list[Delta]  # per concurrency and metric, B against A
    clock_causes: list[str]  # points whose GPUs ran at clearly different SM clocks in A and B
    depth_deltas: list[DepthDelta] = field(default_factory=list)  # per depth and figure, B against A
    prefix_ratios: tuple[float | None, float | None] = (None, None)  # the prefix-cache ratio of A and of B

    def text(self, sweep: bool = True) -> str:
        """The comparison as plain text (the terminal; 06 shows the sweep points as a table instead)."""
        differ = self.setups.line()
        lines = ([differ, ""] if differ else []) + [f"A: {self.a.run_dir} ({self.a.status})",
                                                    f"B: {self.b.run_dir} ({self.b.status})", ""]
        lines += change_lines("params", self.params, self.params_note or "the same")
        lines += ["", "image and versions:"]
        lines += [f"  {c.what}: {fmt(c.a)}  (same)" if c.a == c.b else f"  {c.what}: {fmt(c.a)} -> {fmt(c.b)}  "
                  + ("(changed)" if c.differs else "(not recorded by one run)") for c in self.setup]
        lines += ["", *change_lines("decisions that differ", self.decisions, "none"), "", "figures (A -> B, change):"]
        lines += [f"  {f.name}: {fmt(f.a)} -> {fmt(f.b)}"
                  + (f"  ({f.change_pct:+.1f} %)" if f.change_pct is not None else "") for f in self.figures]
        if sweep:
            lines += ["", *delta_lines(self.deltas), "", *depthsweep.delta_lines(self.depth_deltas, self.prefix_ratios),
                      "", *clock_lines(self.clock_causes)]
        return "\n".join(lines)


def page_path(a: RunRecord, b: RunRecord, outputs: Path) -> Path:
    """Where `sparkbook compare` writes its page: compare/ in the cluster's outputs that hold run B, named by the two
    run dirs' own names, never by a manifest's run id or cluster (`run_id: ../../x` would lead out of the tree). Only
    a cluster dir of `outputs` (the command's) is written into: for run B elsewhere or in a committed examples tree
    (any .../examples/<cluster>), the page goes under `outputs`/<cluster>/compare/ (`outputs` being examples/: the
    outputs that hold it), never into or beside what git tracks."""
    cluster = outputs_tree(b.run_dir.resolve().parent, "name the page to write with --html FILE")
    mine = outputs.resolve()
    own = cluster.is_relative_to(mine) and cluster.parent.name != COMMITTED
    root = cluster if own else (mine.parent if mine.name == COMMITTED else mine) / cluster.name
    return root / COMPARE_DIR / f"{a.run_dir.resolve().name}-vs-{b.run_dir.resolve().name}.html"


def history(a: RunRecord, b: RunRecord, metrics: tuple[str, ...] = POINT_METRICS) -> dict[tuple[int, str], float]:
    """Per concurrency and metric, the spread of the figure over the runs before both A and B with B's params
    (hash) and image: the run-to-run noise where the two runs have no repeats (A and B themselves are left out:
    their own difference is what is judged)."""
    if not b.params_hash or not b.image or not b.run_dir.parent.is_dir():
        return {}
    first = min(a.run_id, b.run_id)
    same = [r for r in (read_run(d) for d in b.run_dir.parent.iterdir() if is_run_dir(d) and d.name < first)
            if r.params_hash == b.params_hash and r.image == b.image and r.bench]
    return history_bands((r.bench for r in same), metrics)


def params_changes(a: RunRecord, b: RunRecord) -> tuple[list[Change], str | None]:
    """The params keys and notebook parameters that differ, and a note when a run did not keep its params."""
    pa, pb = params_of(a.run_dir), params_of(b.run_dir)
    missing = [r.run_id for r, p in ((a, pa), (b, pb)) if p is None]
    flat_a = flatten({"params": pa or {}, "parameters": a.parameters})
    flat_b = flatten({"params": pb or {}, "parameters": b.parameters})
    if missing:  # compare only the -p parameters: the params file itself is unknown for one of them
        flat_a = {k: v for k, v in flat_a.items() if not k.startswith("params")}
        flat_b = {k: v for k, v in flat_b.items() if not k.startswith("params")}
    note = (f"run(s) {', '.join(missing)} did not keep their params file ({PARAMS_COPY}): only the notebook "
            "parameters are compared") if missing else None
    return changes(flat_a, flat_b), note


def setup_side_by_side(a: RunRecord, b: RunRecord) -> list[Change]:
    """What each run served with (image, its ID and versions, executor, layout), the same ones too: the
    comparison shows every row, so a figure's change is read beside what did not change."""
    return [Change("image", a.image, b.image),
            *(Change(k, a.versions.get(k), b.versions.get(k)) for k in ("image id", "vllm", "ray")),
            Change("executor", a.executor, b.executor), Change("layout", a.layout, b.layout)]


def setups_of(params: list[Change], setup: list[Change]) -> Setups:
    """What makes the two runs two setups: the serving params, the executor 05 chose, and the image."""
    found = setups(params, [c for c in setup if c.what in IMAGE_FACTS])
    return Setups(found.plan + [c for c in setup if c.what == "executor" and c.differs], found.image)


def decision_changes(a: RunRecord, b: RunRecord) -> list[Change]:
    """Each question either run decided whose choice is not the same in both."""
    def choices(r: RunRecord) -> dict[str, str | None]:
        return {f"{d['notebook'][:2]}: {d.get('question')}": d.get("choice") for d in r.decisions()}

    ca, cb = choices(a), choices(b)
    return [Change(q, ca.get(q), cb.get(q)) for q in sorted(set(ca) | set(cb)) if ca.get(q) != cb.get(q)]


def _points(run: RunRecord) -> list[SweepPoint]:
    """The sweep points, also of a run dir without a manifest (a notebook's own run dir)."""
    return run.bench or points_of(run.run_dir)


def compare_runs(a_dir: Path, b_dir: Path) -> Comparison:
    """Run B against run A (A the earlier or the baseline)."""
    a, b = read_run(a_dir), read_run(b_dir)
    da, db = depthsweep.read(a_dir), depthsweep.read(b_dir)
    params, note = params_changes(a, b)
    figures = [FigurePair(name, getattr(a, attr), getattr(b, attr)) for name, attr in RECORD_FIGURES]
    setup = setup_side_by_side(a, b)
    between = setups_of(params, setup)
    return Comparison(a, b, params, note, setup, between, decision_changes(a, b),
                      [f for f in figures if f.a is not None or f.b is not None],
                      judged(compare(_points(b), _points(a), POINT_METRICS, history(a, b)), between),
                      clock_causes(_points(a), _points(b)), judged(depthsweep.compare(da, db), between),
                      depthsweep.ratios(da, db))

