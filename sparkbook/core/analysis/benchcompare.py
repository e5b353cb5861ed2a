"""Two runs' sweep points side by side: per concurrency and metric the change and its noise band, the params that
differ, the GPU clocks that ran apart. Pure over the run dirs' sweep points, params copies and state.json, so 06
(against the earlier run) and `sparkbook compare` (records.compare, over whole runs) judge a change the same way.

The noise band is core.analysis.benchstats.compare's: the figure's spread over repeats within the two runs where they
have them, else over the earlier runs of the same params and image; a move inside the band is neither worse nor better.
Two runs whose serving plan or image differ measure two setups: the comparison says so first, and no change between
them is called worse or better (a redeploy with a smaller max_num_seqs once read as a +109 % TTFT regression).
"""
from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import yaml

from ..values.errors import SparkbookError
from ..values.handoff import ImageChoice
from ..values.rundir import PARAMS_COPY, is_run_dir, params_hash
from ..values.state import StateError, load
from ..values.sweeppoint import SweepPoint, read_points
from . import depthsweep
from .benchstats import Delta, compare, spread_band_pct
from .depthsweep import DepthDelta

CLOCK_DIFF = 0.10  # a mean SM clock this much apart between two runs' points is named as a likely cause
# The sweep metrics compared per concurrency (vllm bench serve's names).
POINT_METRICS = ("output_throughput", "median_ttft_ms", "median_tpot_ms", "median_itl_per_token_ms", "p99_ttft_ms",
                 "p99_tpot_ms", "median_e2el_ms")


def fmt(value: Any, digits: int = 1) -> str:
    """A figure for a table (the comparisons and the records' pages): '-' when unknown."""
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    return str(value)


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


def flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    """Nested mappings and lists as {"a.b[0].c": leaf}; an empty mapping or list has no leaves."""
    if isinstance(value, dict):
        return {k: v for key, item in value.items()
                for k, v in flatten(item, f"{prefix}.{key}" if prefix else str(key)).items()}
    if isinstance(value, list):
        return {k: v for i, item in enumerate(value) for k, v in flatten(item, f"{prefix}[{i}]").items()}
    return {prefix: value}


def changes(a: dict[str, Any], b: dict[str, Any]) -> list[Change]:
    """Each key of two flattened mappings whose values differ, by name."""
    return [Change(k, a.get(k), b.get(k)) for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]


class UnreadableParams(SparkbookError):
    """A run's params copy is not a YAML mapping: nothing is compared against it."""

    exit_kind = "invalid"


def params_of(run_dir: Path) -> dict[str, Any] | None:
    """The params file the run copied, parsed (None: it kept none); UnreadableParams naming it where it is not a
    YAML mapping."""
    path = run_dir / PARAMS_COPY
    if not path.is_file():
        return None
    try:
        data = yaml.safe_load(path.read_bytes().decode())
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        raise UnreadableParams(f"{path}: not YAML ({type(exc).__name__})",
                               remediation="compare runs whose params copy is the one sparkbook wrote") from None
    if not isinstance(data, dict):
        raise UnreadableParams(f"{path}: not a YAML mapping of params",
                               remediation="compare runs whose params copy is the one sparkbook wrote")
    return data



def image_of(run_dir: Path) -> ImageChoice | None:
    """The image 03 chose in the run (None: 03 did not hand one on, or state.json cannot be read)."""
    try:
        return load(run_dir, ImageChoice, sealed=False)  # shown beside the figures, never acted on
    except StateError:
        return None


def points_of(run_dir: Path) -> list[SweepPoint]:
    """The run's sweep points ([] where it has none or they cannot be read)."""
    try:
        return read_points(run_dir)
    except (OSError, ValueError, KeyError):
        return []


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


def history_bands(runs: Iterable[list[SweepPoint]], metrics: Iterable[str] = POINT_METRICS
                  ) -> dict[tuple[int, str], float]:
    """Per concurrency and metric, the spread of the figure over these runs' points (the run-to-run noise where
    the two runs compared have no repeats; the caller picks the runs of the same params and image)."""
    values: dict[tuple[int, str], list[float]] = {}
    for points in runs:
        for p in points:
            for m in metrics:
                figure = p.figure(m)
                if figure is not None:
                    values.setdefault((p.max_concurrency, m), []).append(float(figure))
    return {k: band for k, v in values.items() if (band := spread_band_pct(v)) is not None}


def same_setup_runs(a_dir: Path, b_dir: Path) -> list[list[SweepPoint]]:
    """The sweep points of the sibling runs before both A and B with B's params (hash) and image (A and B left
    out: their own difference is what is judged); none where B kept no params or names no image."""
    digest, image = params_hash(b_dir), image_of(b_dir)
    if not digest or image is None or not b_dir.parent.is_dir():
        return []
    first = min(a_dir.name, b_dir.name)
    same = [d for d in sorted(b_dir.parent.iterdir()) if is_run_dir(d) and d.name < first
            and params_hash(d) == digest and (i := image_of(d)) is not None and i.ref == image.ref]
    return [p for p in map(points_of, same) if p]


def band(d: Delta) -> str:
    """The noise band as said beside a change: its width and where it comes from, or why there is none."""
    return f"noise +-{d.noise_pct:.1f} % from {d.noise_from}" if d.noise_pct is not None else \
        f"no noise estimate: {d.noise_from}"


def delta_rows(deltas: list[Delta]) -> list[dict[str, Any]]:
    """The sweep deltas as table rows (rounded)."""
    return [{"concurrency": d.max_concurrency, "metric": d.metric, "earlier": round(d.earlier, 2),
             "now": round(d.now, 2), "change %": round(d.change_pct, 1),
             "noise %": None if d.noise_pct is None else round(d.noise_pct, 1), "noise from": d.noise_from,
             "verdict": d.verdict} for d in deltas]


def delta_lines(deltas: list[Delta]) -> list[str]:
    """The sweep deltas as the comparison's text writes them (B against A), each with its noise band."""
    lines = ["sweep points (B against A; noise band = the figure's spread over repeats, within the runs, "
             "else over earlier runs of the same params and image):"]
    reasons = sorted({d.noise_from for d in deltas if d.noise_pct is None})
    lines += [f"  no noise estimate ({r}): such changes are not judged" for r in reasons]
    lines += [f"  c={d.max_concurrency} {d.metric}: {d.earlier:,.2f} -> {d.now:,.2f}  {d.change_pct:+.1f} %: "
              + d.verdict + (f" (noise +-{d.noise_pct:.1f} % from {d.noise_from})" if d.noise_pct is not None else "")
              for d in deltas] or ["  no concurrency measured in both"]
    return lines


def clock_lines(causes: list[str]) -> list[str]:
    return ["GPU clocks:"] + [f"  {c}" for c in causes or [
        "no point of both runs has clocks clearly apart (or one run did not sample them)"]]


def change_lines(title: str, found: list[Change], none: str) -> list[str]:
    """A titled list of changes, `A -> B` each, or the line saying there are none."""
    return [f"{title}:"] + ([f"  {c.what}: {fmt(c.a)} -> {fmt(c.b)}" for c in found] or [f"  {none}"])


# The params that shape what serves, and so what the figures measure: the model, vLLM's serve settings and the GPUs
# and environment it runs with. serve's settings of 05's own checks, of how it gets there (timeouts, retries, the
# front's switch-over) and of where it listens are not.
SERVING = re.compile(r"model\.(path|hf_id)|serve\..+|nodes\[\d+\]\.gpus(\[\d+\])?|runtime\.env\..+")
NOT_SERVING = re.compile(r"serve\.(smoke|quality|smoke_max_tokens|port|replica_port|host|master_port|api_key_env|"
                         r"ready_timeout_s|retry_with_remediation|max_remedies|settle_gib|settle_timeout_s|"
                         r"utilization_step|rollback_on_failure|switch|hold_s|drain_timeout_s)\b.*")


def serving(key: str) -> bool:
    """Whether a params key (flattened, as `serve.max_num_seqs`) shapes what serves."""
    return bool(SERVING.fullmatch(key)) and not NOT_SERVING.fullmatch(key)


@dataclass(frozen=True)
class Setups:
    """What two runs served with that differs: the serving plan's params (and executor) and the image; where either
    does, their figures measure two setups, not one setup twice."""

    plan: list[Change]
    image: list[Change]

    @property
    def differ(self) -> bool:
        return bool(self.plan or self.image)

    def line(self) -> str | None:
        """The sentence a comparison starts with where the setups differ (None: the same setup)."""
        parts = [f"{name} ({', '.join(f'{c.what} {fmt(c.a)} -> {fmt(c.b)}' for c in found)})"
                 for name, found in (("plan", self.plan), ("image", self.image)) if found]
        return (f"These runs differ in {' and '.join(parts)}: their figures are not a regression test of each other"
                if parts else None)


def setups(params: list[Change], image: list[Change]) -> Setups:
    """The serving params among a comparison's changed params (named without their 'params.' prefix) and the image
    changes both runs record."""
    plan = [Change(key, c.a, c.b) for c in params if c.what.startswith("params.")
            and serving(key := c.what.removeprefix("params."))]
    return Setups(plan, [c for c in image if c.differs])


D = TypeVar("D", Delta, DepthDelta)


def judged(deltas: list[D], between: Setups) -> list[D]:
    """The deltas as the two setups let them be judged: each marked across setups where they differ."""
    return [dataclasses.replace(d, across_setups=True) for d in deltas] if between.differ else deltas


@dataclass(frozen=True)
class SweepComparison:
    """Run B's sweep against run A's (06: this run against the earlier one): what differs in the params file and
    the image that could explain a change, and each point's metrics against the noise."""

    a: Path
    b: Path
    params: list[Change]  # params keys that differ (none where a run kept no params: see params_note)
    params_note: str | None
    image_differences: list[Change]  # the image 03 chose, its ID and versions, where they differ
    setups: Setups  # the plan and image differences among those: the deltas are not judged where there are any
    deltas: list[Delta]
    clock_causes: list[str]
    depth_deltas: list[DepthDelta] = field(default_factory=list)  # per depth and figure, B against A
    prefix_ratios: tuple[float | None, float | None] = (None, None)  # the prefix-cache ratio of A and of B

    def text(self) -> str:
        """What changed between the runs, in plain text (the sweep and depth points are `rows`, tables)."""
        differ = self.setups.line()
        lines = ([differ, ""] if differ else []) + [f"A: {self.a}", f"B: {self.b}", ""]
        lines += change_lines("params", self.params, self.params_note or "the same")
        lines += ["", *change_lines("image and versions", self.image_differences, "the same (or not recorded)"), ""]
        lines += [f"prefix cache, second TTFT / first: {depthsweep.ratio_text(self.prefix_ratios)}", ""]
        return "\n".join(lines + clock_lines(self.clock_causes))

    def rows(self) -> list[dict[str, Any]]:
        return delta_rows(self.deltas)

    def depth_rows(self) -> list[dict[str, object]]:
        return depthsweep.delta_rows(self.depth_deltas)


def image_differences(a: ImageChoice | None, b: ImageChoice | None) -> list[Change]:
    """The image and its versions where both runs name them and they differ (the same ones left out)."""
    def facts(i: ImageChoice | None) -> dict[str, Any]:
        return {} if i is None else {"image": i.ref, "image id": i.id, "vllm": i.vllm_version, "ray": i.ray_version}
    return [c for c in changes(facts(a), facts(b)) if c.differs]


@dataclass(frozen=True)
class RunSweep:
    """One run's sweep as a comparison reads it: its dir, the params file it copied, the image 03 chose, its sweep
    points and depth points (each None or empty where the run kept none)."""

    run_dir: Path
    params: dict[str, Any] | None
    image: ImageChoice | None
    points: list[SweepPoint]
    depth: depthsweep.DepthSweep | None


def recorded_sweep(run_dir: Path) -> RunSweep:
    """The sweep a run dir recorded."""
    return RunSweep(run_dir, params_of(run_dir), image_of(run_dir), points_of(run_dir), depthsweep.read(run_dir))


def compare_sweeps(a: RunSweep, b: RunSweep, history: list[list[SweepPoint]]) -> SweepComparison:
    """Run B's sweep against run A's (A the earlier), with the params and image differences beside them; `history`:
    the sweeps of the earlier runs of B's setup, for the noise where the two have no repeats."""
    missing = [r.run_dir.name for r in (a, b) if r.params is None]
    note = f"run(s) {', '.join(missing)} did not keep their params file ({PARAMS_COPY})" if missing else None
    found = [] if missing else changes(flatten({"params": a.params}), flatten({"params": b.params}))
    image = image_differences(a.image, b.image)
    between = setups(found, image)
    return SweepComparison(a.run_dir, b.run_dir, found, note, image, between,
                           judged(compare(b.points, a.points, POINT_METRICS, history_bands(history)), between),
                           clock_causes(a.points, b.points), judged(depthsweep.compare(a.depth, b.depth), between),
                           depthsweep.ratios(a.depth, b.depth))


def compare_dirs(a_dir: Path, b_dir: Path) -> SweepComparison:
    """Run B's sweep points against run A's (A the earlier), as both run dirs recorded them."""
    return compare_sweeps(recorded_sweep(a_dir), recorded_sweep(b_dir), same_setup_runs(a_dir, b_dir))


@dataclass(frozen=True)
class EarlierSweep:
    """What 06 compares the sweep it measures with (records.earlier.earlier_sweep reads it): the earlier run's sweep,
    this run as recorded before 06 (its params file and image), and the sweeps of the runs before both of its setup."""

    earlier: RunSweep
    now: RunSweep
    history: list[list[SweepPoint]]

    def compared(self, points: list[SweepPoint], depth: depthsweep.DepthSweep | None) -> SweepComparison:
        """This run's fresh sweep against the earlier run's, as compare_dirs judges two recorded ones."""
        now = RunSweep(self.now.run_dir, self.now.params, self.now.image, points, depth)
        return compare_sweeps(self.earlier, now, self.history)
