"""The archive: what each run dir under outputs/<cluster>/ holds, read into one record per run.

A run dir (its layout: core.values.rundir) holds manifest.json (runbook.manifest), state.json (core.values.state: the
hand-offs), events.jsonl (runbook.session: decisions, serve attempts, the roofline) and bench/c*.json (06). Older run
dirs lack some of these: a missing value is None (shown as '-'); a run dir that cannot be read at all becomes a record
that says why.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from ..core.analysis.benchcompare import UnreadableParams, fmt, params_of
from ..core.values.abarm import BASELINE, serves
from ..core.values.errors import SparkbookError
from ..core.values.evidence import read_events
from ..core.values.handoff import AbVerdict
from ..core.values.rundir import MANIFEST, STATE, is_run_dir, params_hash
from ..core.values.stagelist import BENCH, IMAGES, SERVE, stage_of
from ..core.values.sweeppoint import SweepPoint, read_points
from .failure import LogExcerpt, excerpts
from .timeline import Step, steps

STATUSES = ("ok", "failed", "partial", "running", "unreadable")
# A finding's topic and the notebook that resolves it when it runs ok (02 reports that the installed image cannot
# serve the model; 03 picks one that can).
RESOLVED_BY = {"image": IMAGES.id}


class ArchiveError(SparkbookError):
    """A cluster's outputs or a run cannot be found as named."""


@dataclass
class RunRecord:
    """One run as its dir records it; None where that run dir does not say."""

    run_dir: Path
    run_id: str
    kind: str = "unreadable"  # one of STATUSES, or "interactive" (a notebook's own run dir, never listed)
    status: str = "unreadable"  # ok | failed at NN | partial: NN, NN | running | unreadable: why
    cluster: str | None = None
    started: str | None = None
    finished: str | None = None
    params_source: str | None = None  # the params file it copied, relative to the repo (None: outside it, or unknown)
    params_hash: str | None = None
    image: str | None = None
    versions: dict[str, str | None] = field(default_factory=dict)  # image id, image digest, vllm, ray
    image_changed: bool | None = None  # against the run before it (None: nothing to compare with)
    executor: str | None = None
    layout: str | None = None  # serve.layout of its params copy ("tp" where they name none; None: no copy kept)
    ready_s: float | None = None
    addresses: list[str] = field(default_factory=list)  # "network: URL" clients use (05's endpoint), as recorded
    ab_kept: str | None = None  # benchmark.ab: which configuration stays serving and why (06's verdict)
    redeploy: str | None = None  # behind the front: the way 05's replacement went and what a client saw (front_held)
    single_tok_s: float | None = None
    peak_tok_s: float | None = None
    peak_concurrency: int | None = None
    roofline_pct: float | None = None
    cause: str | None = None
    notebooks: list[dict[str, Any]] = field(default_factory=list)  # the manifest's entries
    not_run: list[str] = field(default_factory=list)
    findings: list[dict[str, Any]] = field(default_factory=list)  # severity, topic, text
    failing_cell: dict[str, Any] | None = None  # notebook, cell_index, ename, evalue, source
    bench: list[SweepPoint] = field(default_factory=list)  # bench/c*.json, by concurrency
    parameters: dict[str, Any] = field(default_factory=dict)
    sparkbook_version: str | None = None  # what wrote the manifest (None: a manifest older than the field)
    sparkbook_commit: str | None = None
    first_errors: list[LogExcerpt] = field(default_factory=list)  # the failing stage's logs around their first error
    timeline: list[Step] = field(default_factory=list)

    def single_point(self) -> SweepPoint | None:
        """The sweep point at concurrency 1 (None: 06 did not measure one)."""
        return next((p for p in self.bench if p.max_concurrency == 1), None)

    def decisions(self) -> list[dict[str, Any]]:
        """Every decision of the run with its notebook, in notebook order."""
        return [{**d, "notebook": nb["name"]} for nb in self.notebooks for d in nb.get("decisions") or []]


def _json(path: Path) -> Any:
    return json.loads(path.read_text()) if path.is_file() else None


def status_of(notebooks: list[dict[str, Any]], manifest_status: str) -> tuple[str, str]:
    """(kind, text): failed at the first failed notebook, partial when some did not run, else the manifest's."""
    if manifest_status == "interactive":
        return "interactive", "interactive (no manifest: the notebooks' own run dir)"
    failed = [nb["name"][:2] for nb in notebooks if nb.get("status") == "failed"]
    if failed:
        return "failed", f"failed at {failed[0]}"
    if manifest_status == "running":
        return "running", "running (or interrupted)"
    ran = [nb["name"][:2] for nb in notebooks if nb.get("status") == "ok"]
    if len(ran) < len(notebooks):
        return "partial", "partial: " + (", ".join(ran) or "none") + " ran"
    return "ok", "ok"


def _decision(notebooks: list[dict[str, Any]], key: str, question_start: str) -> str | None:
    """The choice of the decision recorded under `key`; in run dirs written before decisions had keys, of the one
    whose question starts with `question_start`."""
    decisions = [d for nb in notebooks for d in nb.get("decisions") or []]
    keyed = next((d["choice"] for d in decisions if d.get("key") == key), None)
    if keyed is not None:
        return str(keyed)
    return next((str(d["choice"]) for d in decisions if not d.get("key")
                 and str(d.get("question", "")).startswith(question_start)), None)


def _failing_cell(run_dir: Path, notebooks: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The first failed notebook's error and, where the executed notebook is readable, the cell's source."""
    nb = next((nb for nb in notebooks if nb.get("status") == "failed"), None)
    if nb is None:
        return None
    exc = nb.get("exception") or {}
    cell = {"notebook": nb["name"], "cell_index": exc.get("cell_index"), "ename": exc.get("ename"),
            "evalue": exc.get("evalue"), "source": None}
    try:
        cells = json.loads((run_dir / nb["name"]).read_text())["cells"]
        cell["source"] = "".join(cells[exc["cell_index"]]["source"])
    except (OSError, ValueError, KeyError, IndexError, TypeError):
        pass  # the notebook was not written, or papermill named no cell: the error alone is shown
    return cell


def _cause(record: RunRecord, events: list[dict[str, Any]]) -> str | None:
    """The failure's named cause: 05's classified serve failure, else the failing cell's exception."""
    if record.failing_cell is None:
        return None
    if SERVE.owns(record.failing_cell["notebook"]):
        attempts = [a for e in events if e["kind"] == "serve_attempts" for a in e["data"]]
        causes = [str(a["cause"]) for a in attempts if a.get("cause")]
        if causes:
            return causes[-1]
    evalue = str(record.failing_cell.get("evalue") or "").strip().splitlines()
    return f"{record.failing_cell.get('ename')}: {evalue[0][:160] if evalue else ''}"



def _figures(record: RunRecord, state: dict[str, Any], events: list[dict[str, Any]]) -> None:
    """Single stream, peak and roofline share: 06's summary in state.json, else its bench files and events."""
    summary = state.get("benchmark") or {}
    points = record.bench
    single = next((p for p in points if p.max_concurrency == 1), None)
    peak = max(points, key=lambda p: p.output_throughput or 0, default=None)
    record.single_tok_s = summary.get("single_stream_output_tok_s", single.output_throughput if single else None)
    record.peak_tok_s = summary.get("peak_output_tok_s", peak.output_throughput if peak else None)
    record.peak_concurrency = summary.get("peak_at_concurrency", peak.max_concurrency if peak else None)
    roof = next((e["data"].get("roofline") or {} for e in reversed(events) if e["kind"] == "roofline"), {})
    record.roofline_pct = summary.get("roofline_percent", roof.get("percent_of_ceiling"))


def bandwidth_findings(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """06's line where the params' memory bandwidth is far from the card's datasheet figure (its last roofline
    event's; none where the figures agree, or no card was reported)."""
    roof: Any = next((e["data"] for e in reversed(events) if e["kind"] == "roofline"), None)
    bandwidth = roof.get("bandwidth") if isinstance(roof, dict) else None
    finding = bandwidth.get("finding") if isinstance(bandwidth, dict) else None
    return [{**finding, "resolved_by": None}] if isinstance(finding, dict) else []


FIELD_ROW = re.compile(r"<tr>\s*<td>([^<]+)</td>\s*<td>([^<]*)</td>\s*</tr>")


def notebook_field(run_dir: Path, notebook: str, name: str) -> float | None:
    """A figure the executed notebook displayed in a field/value table (`ready_s` in 05's endpoint,
    `percent_of_ceiling` in 06's roofline): for run dirs that kept their notebooks but no state.json or events."""
    try:
        cells = json.loads((run_dir / notebook).read_text())["cells"]
    except (OSError, ValueError, KeyError):
        return None
    for cell in cells:
        for out in cell.get("outputs") or []:
            page = out.get("data", {}).get("text/html")
            rows = dict(FIELD_ROW.findall("".join(page) if isinstance(page, list) else str(page or "")))
            if name in rows:
                try:
                    return float(rows[name])
                except ValueError:
                    return None
    return None


def _notebook_dir(events: list[dict[str, Any]]) -> dict[str, Any]:
    """A manifest for a notebook's own run dir (no `sparkbook run`): each notebook that recorded events, with its
    decisions."""
    stages = list(dict.fromkeys(e["stage"] for e in events if e.get("stage")))
    return {"status": "interactive", "notebooks": [
        {"name": f"{stage}.ipynb", "status": "ran", "decisions": [e["data"] for e in events
                                                                 if e["stage"] == stage and e["kind"] == "decision"]}
        for stage in stages]}


def redeploy(events: list[dict[str, Any]]) -> str | None:
    """The last replacement behind the front (05's front_held event): its way, the seconds a client went unanswered,
    and the asks held, refused and failed; None where the run replaced nothing behind a front."""
    held = next((e["data"] for e in reversed(events) if e["kind"] == "front_held"), None)
    if not isinstance(held, dict):
        return None
    dark = held.get("seconds without service (as a client saw it)")
    drain = f", drain {held['drain_timeout_s']} s at most" if held.get("drain_timeout_s") else ""
    return (f"{held.get('way')}: {fmt(dark)} s without service, {fmt(held.get('held'))} held, "
            f"{fmt(held.get('refused'))} refused, {fmt(held.get('failed'))} failed{drain}")


def _read(run_dir: Path, manifest: dict[str, Any] | None) -> RunRecord:
    manifest = manifest if manifest is not None else _json(run_dir / MANIFEST)
    state = _json(run_dir / STATE) or {}
    events = read_events(run_dir)
    if manifest is None and (state or events):
        manifest = _notebook_dir(events)
    if not isinstance(manifest, dict):
        raise ValueError(f"no {MANIFEST}" if manifest is None else f"{MANIFEST} is not an object")
    notebooks = list(manifest["notebooks"])
    for nb in notebooks:
        if not isinstance(nb, dict) or not isinstance(nb.get("name"), str) \
                or not all(isinstance(d, dict) for d in nb.get("decisions") or []):
            raise ValueError(f"{MANIFEST}: a notebook entry without a name or with malformed decisions: {nb!r}"[:200])
    kind, status = status_of(notebooks, manifest.get("status", "running"))
    record = RunRecord(run_dir, manifest.get("run_id", run_dir.name), kind, status, manifest.get("cluster"),
                       manifest.get("started"), manifest.get("finished"), manifest.get("params_source"),
                       params_hash(run_dir),
                       notebooks=notebooks, parameters=manifest.get("parameters") or {})
    record.not_run = [nb["name"] for nb in notebooks if nb.get("status") not in ("ok", "failed", "running")]
    record.sparkbook_version, record.sparkbook_commit = manifest.get("sparkbook_version"), \
        manifest.get("sparkbook_commit")
    image = state.get("image") or {}
    record.image = image.get("ref") or _decision(notebooks, "image", "Which image")
    probes = [e["data"].get("facts") or {} for e in events if e["kind"] == "image_probe"]
    probe = next((f for f in probes if f.get("image") == record.image), {})
    digests = image.get("digests") or probe.get("repo_digests") or [None]
    record.versions = {"image id": image.get("id") or probe.get("image_id"), "image digest": digests[0],
                       "vllm": image.get("vllm_version") or probe.get("vllm_version"),
                       "ray": image.get("ray_version") or probe.get("ray_version")}
    endpoint = state.get("endpoint") or {}
    record.executor = endpoint.get("executor") or _decision(notebooks, "executor", "Which distributed executor")
    verdict = ab_verdict(state.get("ab"))
    record.layout = served_layout(layout_of(run_dir), verdict)
    ready = [a for e in events if e["kind"] == "serve_attempts" for a in e["data"] if a.get("ready")]
    record.ready_s = endpoint.get("ready_s", ready[-1].get("seconds") if ready else None)
    addresses = endpoint.get("addresses")
    record.addresses = [f"{net}: {url}" for net, url in addresses.items()] if isinstance(addresses, dict) else []
    if record.ready_s is None and not state and not events:
        record.ready_s = notebook_field(run_dir, SERVE.notebook, "ready_s")
    record.ab_kept = ab_kept(verdict)
    record.redeploy = redeploy(events)
    record.findings = _resolved(list((state.get("diagnosis") or {}).get("findings") or []), notebooks)
    record.findings += bandwidth_findings(events)
    record.bench = read_points(run_dir)
    _figures(record, state, events)
    if record.roofline_pct is None and not state and not events:
        record.roofline_pct = notebook_field(run_dir, BENCH.notebook, "percent_of_ceiling")
    record.failing_cell = _failing_cell(run_dir, notebooks)
    record.cause = _cause(record, events)
    if record.failing_cell:
        record.first_errors = excerpts(run_dir, record.failing_cell["notebook"])
    failure = Step(str(manifest.get("finished") or "-"), "-", "failure",
                   f"{record.failing_cell['notebook']}: {record.cause}") if record.failing_cell else None
    record.timeline = steps(events, failure)
    return record


def layout_of(run_dir: Path) -> str | None:
    """The layout the run's params asked for: serve.layout, "tp" where they name none (params before the field
    knew no other layout); None where the run kept no readable params copy."""
    try:
        params = params_of(run_dir)
    except (OSError, UnreadableParams):
        return None
    if params is None:
        return None
    serve = params.get("serve")
    layout = serve.get("layout") if isinstance(serve, dict) else None
    return str(layout) if layout else "tp"


def ab_verdict(data: Any) -> AbVerdict | None:
    """06's A/B verdict as state.json holds it (records of the speculative A/B alone included); None where the run
    had no A/B, or its record does not read."""
    try:
        return AbVerdict.model_validate(data) if isinstance(data, dict) else None
    except ValidationError:
        return None


def served_layout(asked: str | None, verdict: AbVerdict | None) -> str | None:
    """The layout the run left serving: the params' (`asked`), or the one a layout A/B kept, said as such
    ("tp (kept by the A/B)": its params ask for replicas, and tp serves)."""
    if verdict is None or verdict.ab != "layout":
        return asked
    return f"{'tp' if verdict.kept == BASELINE else 'replicas'} (kept by the A/B)"


def ab_kept(verdict: AbVerdict | None) -> str | None:
    """06's A/B verdict in a line: the configuration that stays serving, why, and where the arms cross."""
    if verdict is None:
        return None
    kept = serves(verdict.ab, verdict.kept)
    return f"{kept}: {verdict.reason}" + (f"; {verdict.crossing_words()}" if verdict.crossing else "")


def _resolved(findings: list[dict[str, Any]], notebooks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The findings, each marked `resolved_by` the later notebook that resolved it (None: still open)."""
    ok = {s.id for nb in notebooks if nb.get("status") == "ok" and (s := stage_of(nb["name"]))}
    return [{**f, "resolved_by": RESOLVED_BY.get(str(f.get("topic"))) if RESOLVED_BY.get(str(f.get("topic"))) in ok
             else None} for f in findings]


def read_run(run_dir: Path, manifest: dict[str, Any] | None = None) -> RunRecord:
    """The record of one run dir (its manifest.json, or `manifest` as given); never raises: a dir that cannot be
    read is a record with kind 'unreadable' and the reason."""
    try:
        return _read(run_dir, manifest)
    except Exception as exc:  # any malformed file: the archive lists it as unreadable instead of failing
        reason = f"{type(exc).__name__}: {exc}"[:300]
        return RunRecord(run_dir, run_dir.name, status=f"unreadable: {reason}")


def _same_image(a: RunRecord, b: RunRecord) -> bool:
    ids = a.versions.get("image id"), b.versions.get("image id")
    return ids[0] == ids[1] if all(ids) else a.image == b.image


def runs(cluster_dir: Path) -> list[RunRecord]:
    """Every run of a cluster's outputs, newest first, each marked whether its image changed from the run before."""
    records = sorted((read_run(d) for d in cluster_dir.iterdir() if is_run_dir(d)), key=lambda r: r.run_id)
    before: RunRecord | None = None
    for record in records:
        if record.image:
            record.image_changed = None if before is None else not _same_image(before, record)
            before = record
    return records[::-1]


class NotOutputs(ArchiveError):
    """A dir `runs` or `compare` would write into holds no run dir sparkbook wrote: refused, nothing written."""

    exit_kind = "invalid"
    label = "refused"


def written_by_sparkbook(run_dir: Path) -> bool:
    """Whether run_dir holds a manifest as `sparkbook run` writes it (an object with a run id and its notebooks), not
    just any file of that name (a web app's manifest.json)."""
    try:
        data = json.loads((run_dir / MANIFEST).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and isinstance(data.get("run_id"), str) and isinstance(data.get("notebooks"), list)


def holds_runs(cluster_dir: Path) -> bool:
    """Whether a dir is a cluster's outputs: it holds a run dir sparkbook wrote."""
    return cluster_dir.is_dir() and any(written_by_sparkbook(d) for d in cluster_dir.iterdir() if d.is_dir())


def outputs_tree(cluster_dir: Path, remediation: str) -> Path:
    """cluster_dir where it is a cluster's outputs, which sparkbook may write into; refused (NotOutputs) otherwise,
    so no page of a command overwrites a file of some other dir (a user's own index.html)."""
    if not holds_runs(cluster_dir):
        raise NotOutputs(f"{cluster_dir} is no cluster's outputs: it holds no run dir with sparkbook's {MANIFEST}",
                         remediation=remediation)
    return cluster_dir


RUNS_REMEDIATION = "name a cluster's outputs dir (outputs/<cluster>), a cluster, or a params file that has runs"


def cluster_dirs(target: str | None, outputs: Path) -> list[Path]:
    """The cluster output dirs a `runs` argument names: a params file, a cluster name or a dir; all when None. A dir
    that holds no run sparkbook wrote is refused (NotOutputs)."""
    if target is None:
        found = sorted(d for d in outputs.iterdir() if holds_runs(d)) if outputs.is_dir() else []
        if not found:
            raise ArchiveError(f"no run dirs under {outputs}", remediation="run the runbook: sparkbook run PARAMS")
        return found
    path = Path(target)
    if path.is_file():
        from ..core.values.params import load_params

        return [outputs_tree(outputs / load_params(path).cluster, RUNS_REMEDIATION)]
    dirs = [d for d in (path, outputs / target) if d.is_dir()]
    if dirs:
        return [next((d for d in dirs if holds_runs(d)), None) or outputs_tree(dirs[0], RUNS_REMEDIATION)]
    raise ArchiveError(f"{target!r} is neither a params file, a cluster under {outputs}, nor a dir",
                       remediation=f"name a params file, a cluster ({', '.join(_clusters(outputs)) or 'none yet'}) "
                                   "or pass --outputs")


def _clusters(outputs: Path) -> list[str]:
    return sorted(d.name for d in outputs.iterdir() if d.is_dir()) if outputs.is_dir() else []


def find_run(target: str, outputs: Path) -> Path:
    """A run named by its dir, or by its run id within one cluster's outputs."""
    path = Path(target)
    if is_run_dir(path):
        return path
    hits = sorted(outputs.glob(f"*/{target}")) if outputs.is_dir() else []
    hits = [h for h in hits if is_run_dir(h)]
    if len(hits) == 1:
        return hits[0]
    where = "several clusters: " + ", ".join(map(str, hits)) if hits else f"no run dir of that id under {outputs}"
    raise ArchiveError(f"{target!r} names {where}", remediation="pass the run dir itself (outputs/<cluster>/<run-id>)")





def row(r: RunRecord) -> dict[str, str]:
    """A run as one table row (terminal and cluster index)."""
    changed = {True: " (changed)", False: "", None: ""}[r.image_changed]
    return {"run": r.run_id, "params": fmt(r.params_hash), "status": r.status,
            "image": (r.image or "-") + changed, "executor": fmt(r.executor),
            "layout": fmt(r.layout), "ready s": fmt(r.ready_s),
            "single tok/s": fmt(r.single_tok_s), "peak tok/s": fmt(r.peak_tok_s) + (
                f" @{r.peak_concurrency}" if r.peak_tok_s is not None and r.peak_concurrency else ""),
            "% roofline": fmt(r.roofline_pct), "redeploy": fmt(r.redeploy), "cause": fmt(r.cause)}
