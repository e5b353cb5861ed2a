"""Two runs side by side: what changed (params, image and versions, decisions) and what it did to the figures.

The sweep points are compared by core.benchstats.compare: per concurrency and metric the % change and the noise
band, the figure's spread over repeats (within the two runs where they have them, else over the earlier runs of the
same params and image); a move inside the band is neither worse nor better, and without any estimate it says so.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from ..core.benchstats import SINGLE_STREAM, Delta, compare, spread_band_pct
from ..core.rundir import PARAMS_COPY, is_run_dir
from ..core.sweeppoint import SweepPoint, read_points
from .archive import RunRecord, fmt, read_run

CLOCK_DIFF = 0.10  # a mean SM clock this much apart between two runs' points is named as a likely cause
COMPARE_DIR = "compare"  # under outputs/<cluster>/: the comparison pages, never beside the run dirs
COMMITTED = "examples"  # outputs/examples/: the records git tracks

# The sweep metrics compared per concurrency (vllm bench serve's names).
POINT_METRICS = ("output_throughput", "median_ttft_ms", "median_tpot_ms", "median_itl_per_token_ms", "p99_ttft_ms",
                 "p99_tpot_ms", "median_e2el_ms")
FIGURES = (("time to ready s", "ready_s"), (SINGLE_STREAM, "single_tok_s"), ("peak tok/s", "peak_tok_s"),
           ("peak at concurrency", "peak_concurrency"), ("% of roofline", "roofline_pct"))


@dataclass(frozen=True)
class Change:
    """One named value in run A and in run B (None: that run does not record it)."""

    what: str
    a: Any
    b: Any

    @property
    def differs(self) -> bool:
        """Both runs record it and the values differ (one that a run does not record is not a change)."""
        return self.a is not None and self.b is not None and self.a != self.b


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
    image: list[Change]  # image, its ID and versions, executor: all of them, changed or not
    decisions: list[Change]  # "notebook: question" whose choice differs
    figures: list[FigurePair]
    deltas: list[Delta]  # per concurrency and metric, B against A
    clock_causes: list[str]  # points whose GPUs ran at clearly different SM clocks in A and B

    def text(self, sweep: bool = True) -> str:
        """The comparison as plain text (the terminal; 06 shows the sweep points as a table instead)."""
        lines = [f"A: {self.a.run_dir} ({self.a.status})", f"B: {self.b.run_dir} ({self.b.status})", "", "params:"]
        lines += [f"  {c.what}: {fmt(c.a)} -> {fmt(c.b)}" for c in self.params] or [
            f"  {self.params_note or 'the same'}"]
        lines += ["", "image and versions:"]
        lines += [f"  {c.what}: {fmt(c.a)}  (same)" if c.a == c.b else f"  {c.what}: {fmt(c.a)} -> {fmt(c.b)}  "
                  + ("(changed)" if c.differs else "(not recorded by one run)") for c in self.image]
        lines += ["", "decisions that differ:"]
        lines += [f"  {c.what}: {fmt(c.a)} -> {fmt(c.b)}" for c in self.decisions] or ["  none"]
        lines += ["", "figures (A -> B, change):"]
        lines += [f"  {f.name}: {fmt(f.a)} -> {fmt(f.b)}"
                  + (f"  ({f.change_pct:+.1f} %)" if f.change_pct is not None else "") for f in self.figures]
        if not sweep:
            return "\n".join(lines)
        lines += ["", "sweep points (B against A; noise band = the figure's spread over repeats, within the runs, "
                      "else over earlier runs of the same params and image):"]
        reasons = sorted({d.noise_from for d in self.deltas if d.noise_pct is None})
        lines += [f"  no noise estimate ({r}): such changes are not judged" for r in reasons]
        lines += [f"  c={d.max_concurrency} {d.metric}: {d.earlier:,.2f} -> {d.now:,.2f}  {d.change_pct:+.1f} %: "
                  + (f"{d.verdict} (noise +-{d.noise_pct:.1f} % from {d.noise_from})" if d.noise_pct is not None
                     else "no noise estimate") for d in self.deltas] or [
            "  no concurrency measured in both"]
        lines += ["", "GPU clocks:"] + [f"  {c}" for c in self.clock_causes or [
            "no point of both runs has clocks clearly apart (or one run did not sample them)"]]
        return "\n".join(lines)


def band(d: Delta) -> str:
    """The noise band as said beside a change: its width and where it comes from, or why there is none."""
    return f"noise +-{d.noise_pct:.1f} % from {d.noise_from}" if d.noise_pct is not None else \
        f"no noise estimate: {d.noise_from}"


def page_path(outputs: Path, a: RunRecord, b: RunRecord) -> Path:
    """Where `sparkbook compare` writes its page: <outputs>/<cluster>/compare/, apart from the run dirs; for the
    committed records (--outputs outputs/examples) under outputs/<cluster>/compare/, never into what git tracks."""
    cluster = b.cluster or b.run_dir.parent.name
    root = outputs.parent if outputs.name == COMMITTED else outputs
    return root / cluster / COMPARE_DIR / f"{a.run_id}-vs-{b.run_id}.html"


def history(a: RunRecord, b: RunRecord, metrics: tuple[str, ...] = POINT_METRICS) -> dict[tuple[int, str], float]:
    """Per concurrency and metric, the spread of the figure over the runs before both A and B with B's params
    (hash) and image: the run-to-run noise where the two runs have no repeats (A and B themselves are left out:
    their own difference is what is judged)."""
    if not b.params_hash or not b.image or not b.run_dir.parent.is_dir():
        return {}
    first = min(a.run_id, b.run_id)
    same = [r for r in (read_run(d) for d in b.run_dir.parent.iterdir() if is_run_dir(d) and d.name < first)
            if r.params_hash == b.params_hash and r.image == b.image and r.bench]
    values: dict[tuple[int, str], list[float]] = {}
    for r in same:
        for p in r.bench:
            for m in metrics:
                if p.figure(m) is not None:
                    values.setdefault((p.max_concurrency, m), []).append(float(p.figure(m) or 0.0))
    return {k: band for k, v in values.items() if (band := spread_band_pct(v)) is not None}


def mean_sm_mhz(point: SweepPoint) -> float | None:
    """The mean SM clock over a point's GPUs (None: not sampled)."""
    means = [c.sm_mean_mhz for c in point.sparkbook.clocks if c.sm_mean_mhz is not None]
    return sum(means) / len(means) if means else None


def clock_causes(a: list[SweepPoint], b: list[SweepPoint]) -> list[str]:
    """Each concurrency both runs measured whose GPUs' mean SM clock differs by more than CLOCK_DIFF: named as a
    likely cause of a change in its figures (throughput follows the clocks)."""
    before = {p.max_concurrency: p for p in a}
    out = []
    for point in b:
        old = before.get(point.max_concurrency)
        ma, mb = (mean_sm_mhz(old), mean_sm_mhz(point)) if old else (None, None)
        if ma and mb and abs(mb - ma) > CLOCK_DIFF * ma:
            out.append(f"c={point.max_concurrency}: mean SM clock {ma:,.0f} MHz in A, {mb:,.0f} MHz in B "
                       f"({100 * (mb - ma) / ma:+.0f} %): a likely cause of the change in its figures")
    return out


def flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    """Nested mappings and lists as {"a.b[0].c": leaf}; an empty mapping or list has no leaves."""
    if isinstance(value, dict):
        return {k: v for key, item in value.items()
                for k, v in flatten(item, f"{prefix}.{key}" if prefix else str(key)).items()}
    if isinstance(value, list):
        return {k: v for i, item in enumerate(value) for k, v in flatten(item, f"{prefix}[{i}]").items()}
    return {prefix: value}


def _params(run: RunRecord) -> dict[str, Any] | None:
    path = run.run_dir / PARAMS_COPY
    return yaml.safe_load(path.read_text()) if path.is_file() else None


def params_changes(a: RunRecord, b: RunRecord) -> tuple[list[Change], str | None]:
    """The params keys and notebook parameters that differ, and a note when a run did not keep its params."""
    pa, pb = _params(a), _params(b)
    missing = [r.run_id for r, p in ((a, pa), (b, pb)) if p is None]
    flat_a = flatten({"params": pa or {}, "parameters": a.parameters})
    flat_b = flatten({"params": pb or {}, "parameters": b.parameters})
    if missing:  # compare only the -p parameters: the params file itself is unknown for one of them
        flat_a = {k: v for k, v in flat_a.items() if not k.startswith("params")}
        flat_b = {k: v for k, v in flat_b.items() if not k.startswith("params")}
    changes = [Change(k, flat_a.get(k), flat_b.get(k)) for k in sorted(set(flat_a) | set(flat_b))
               if flat_a.get(k) != flat_b.get(k)]
    note = (f"run(s) {', '.join(missing)} did not keep their params file ({PARAMS_COPY}): only the notebook "
            "parameters are compared") if missing else None
    return changes, note


def image_changes(a: RunRecord, b: RunRecord) -> list[Change]:
    return [Change("image", a.image, b.image),
            *(Change(k, a.versions.get(k), b.versions.get(k)) for k in ("image id", "vllm", "ray")),
            Change("executor", a.executor, b.executor)]


def decision_changes(a: RunRecord, b: RunRecord) -> list[Change]:
    """Each question either run decided whose choice is not the same in both."""
    def choices(r: RunRecord) -> dict[str, str | None]:
        return {f"{d['notebook'][:2]}: {d.get('question')}": d.get("choice") for d in r.decisions()}

    ca, cb = choices(a), choices(b)
    return [Change(q, ca.get(q), cb.get(q)) for q in sorted(set(ca) | set(cb)) if ca.get(q) != cb.get(q)]


def _points(run: RunRecord) -> list[SweepPoint]:
    """The sweep points, also of a run dir without a manifest (a notebook's own run dir)."""
    if run.bench:
        return run.bench
    try:
        return read_points(run.run_dir)
    except (OSError, ValueError, KeyError):
        return []


def compare_runs(a_dir: Path, b_dir: Path) -> Comparison:
    """Run B against run A (A the earlier or the baseline)."""
    a, b = read_run(a_dir), read_run(b_dir)
    params, note = params_changes(a, b)
    figures = [FigurePair(name, getattr(a, attr), getattr(b, attr)) for name, attr in FIGURES]
    return Comparison(a, b, params, note, image_changes(a, b), decision_changes(a, b),
                      [f for f in figures if f.a is not None or f.b is not None],
                      compare(_points(b), _points(a), POINT_METRICS, history(a, b)),
                      clock_causes(_points(a), _points(b)))


def delta_rows(deltas: list[Delta]) -> list[dict[str, Any]]:
    """The sweep deltas as table rows (rounded)."""
    return [{"concurrency": d.max_concurrency, "metric": d.metric, "earlier": round(d.earlier, 2),
             "now": round(d.now, 2), "change %": round(d.change_pct, 1),
             "noise %": None if d.noise_pct is None else round(d.noise_pct, 1), "noise from": d.noise_from,
             "verdict": d.verdict} for d in deltas]
