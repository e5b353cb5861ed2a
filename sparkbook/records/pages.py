"""Static HTML pages of the archive: a run's index.html, a cluster's index.html over its runs, a comparison."""
from __future__ import annotations

import html
import os
from pathlib import Path, PurePosixPath
from typing import Any
from urllib.parse import quote

from ..core.analysis.benchstats import SINGLE_STREAM, TPOT_DECODE, decode_tok_s
from ..core.analysis.depthsweep import ratio_text
from ..core.values.rundir import BENCH, INDEX, MANIFEST, PARAMS_COPY, SOAK_FIGURE, SOAK_SERIES, STATE, WATCH
from ..core.values.stagelist import DIAGNOSE
from . import watchlog
from .archive import RUNS_REMEDIATION, STATUSES, RunRecord, fmt, outputs_tree, row, runs
from .compare import Comparison, band
from .watchlog import WatchEvent

SEVERITIES = ("blocker", "warning", "fact")
WATCH_SHOWN = 30  # of the watch record's events on the cluster's page
STYLE = """body{font-family:sans-serif;margin:2em}td,th{padding:4px 8px;border-bottom:1px solid #ddd;vertical-align:top;
text-align:left}tr.failed td{background:#fdd}tr.partial td,tr.running td{background:#ffd}tr.unreadable td{color:#888}
span.ok{color:green}span.failed{color:#a00}li.blocker{color:#a00}li.warning{color:#a60}pre{background:#f6f6f6;padding:6px;white-space:pre-wrap}
.worse{color:#a00;font-weight:bold}.better{color:green;font-weight:bold}li.resolved{color:#666}
p.cause{font-size:1.15em}"""


def e(value: Any) -> str:
    return html.escape(str(value))


def _page(title: str, body: str) -> str:
    return (f'<!doctype html><html><head><meta charset="utf-8"><title>{e(title)}</title><style>{STYLE}</style>'
            f"</head><body>{body}</body></html>")


def _table(rows: list[dict[str, str]], raw: tuple[str, ...] = (), classes: list[str] | None = None) -> str:
    """Rows as an HTML table; the columns named in `raw` are HTML already, the rest are escaped."""
    if not rows:
        return "<p>none</p>"
    head = "".join(f"<th>{e(k)}</th>" for k in rows[0])
    body = "".join((f'<tr class="{e(cls)}" data-kind="{e(cls)}">' if cls else "<tr>")
                   + "".join(f"<td>{v if k in raw else e(v)}</td>" for k, v in r.items())
                   + "</tr>" for r, cls in zip(rows, classes or [""] * len(rows), strict=False))
    return f"<table><tr>{head}</tr>{body}</table>"


def _inside(name: str) -> bool:
    """Whether a name from a record may be a link target: a relative path that stays in the run dir (a crafted
    manifest's `/etc/passwd` or `../..` is not)."""
    path = PurePosixPath(name)
    return bool(name) and not path.is_absolute() and ".." not in path.parts


def _href(target: str) -> str:
    """A relative path as an href: percent-encoded, so `javascript:alert(1)` is a file of that name, never a scheme."""
    return quote(target)


def _link(run_dir: Path, name: str, text: str | None = None, prefix: str = "") -> str:
    """A link to a file inside the run dir when it exists, else the plain name (no broken links, none out of it)."""
    label = e(text or name)
    return f'<a href="{_href(prefix + name)}">{label}</a>' if _inside(name) and (run_dir / name).exists() else label


def notebook_link(r: RunRecord, name: str, text: str | None = None, prefix: str = "") -> str:
    """A notebook as its nbconvert page where the run rendered one (a browser shows .ipynb as raw JSON), with the
    .ipynb beside it; the plain name when neither was written."""
    page = name.removesuffix(".ipynb") + ".html"
    if not (r.run_dir / page).exists():
        return _link(r.run_dir, name, text, prefix)
    raw = f' <small>({_link(r.run_dir, name, "ipynb", prefix)})</small>' if (r.run_dir / name).exists() else ""
    return _link(r.run_dir, page, text or name.removesuffix(".ipynb"), prefix) + raw


def _runtime(image: str | None) -> str:
    """What the places ran: a Docker image, or a Python environment (its interpreter's path stands for it)."""
    if image is None:
        return "not recorded"
    return f"Python environment {image}" if image.startswith("/") else f"Docker image {image}"


def key_figures(r: RunRecord) -> list[dict[str, str]]:
    versions = ", ".join(f"{k} {v}" for k, v in r.versions.items() if v)
    changed = {True: " (changed from the run before)", False: " (same as the run before)", None: ""}[r.image_changed]
    return [{"figure": k, "value": "not recorded" if v == "-" else v} for k, v in (
        ("runtime", _runtime(r.image) + changed + (f" — {versions}" if versions else "")),
        ("executor", fmt(r.executor)),
        ("layout (serve.layout)", fmt(r.layout)),
        ("time to ready", fmt(r.ready_s) + " s" if r.ready_s is not None else "-"),
        ("clients reach the API at", "; ".join(r.addresses) or "-"),
        (SINGLE_STREAM, fmt(r.single_tok_s)), (TPOT_DECODE, fmt(decode_tok_s(r.single_point()))),
        ("peak output tok/s", fmt(r.peak_tok_s) + (f" at concurrency {r.peak_concurrency}"
                                                   if r.peak_concurrency else "")),
        ("% of single-stream roofline (the TPOT-based decode rate against it)", fmt(r.roofline_pct)),
        *((("serving after the A/B (benchmark.ab)", r.ab_kept),) if r.ab_kept else ()),
        ("failure cause", fmt(r.cause) if r.failing_cell else "none: no notebook failed"))]


def _finding(f: dict[str, Any]) -> str:
    resolved = f" <i>(resolved by {e(f['resolved_by'])})</i>" if f.get("resolved_by") else ""
    cls = "resolved" if resolved else e(f.get("severity"))
    return f'<li class="{cls}"><b>{e(f.get("severity"))}</b> [{e(f.get("topic"))}] {e(f.get("text"))}{resolved}</li>'


def _findings(r: RunRecord) -> str:
    by = {s: [f for f in r.findings if f.get("severity") == s] for s in SEVERITIES}
    other = [f for f in r.findings if f.get("severity") not in SEVERITIES]
    items = [_finding(f) for s in SEVERITIES for f in by[s]]
    items += [f"<li>{e(f)}</li>" for f in other]
    counts = ", ".join(f"{len(by[s])} {s}(s)" for s in SEVERITIES)
    resolved = sum(1 for f in r.findings if f.get("resolved_by"))
    counts += f"; {resolved} resolved by a later stage" if resolved else ""
    if r.findings:
        return f"<h2>Findings</h2><p>{counts}</p><ul>{''.join(items)}</ul>"
    if not any(DIAGNOSE.owns(nb.get("name", "")) for nb in r.notebooks):
        why = f"{DIAGNOSE.name} did not run in this run dir"
    elif (r.run_dir / STATE).exists():
        why = f"{DIAGNOSE.name} found nothing to report"
    else:
        why = f"this run dir keeps no {STATE}: the findings are in {DIAGNOSE.notebook}"
    return f"<h2>Findings</h2><p>none recorded ({e(why)})</p>"


def _decision(d: dict[str, Any]) -> str:
    alts = "".join(f"<li>rejected <b>{e(a.get('option'))}</b>: {e(a.get('rejected_because'))}</li>"
                   for a in d.get("alternatives") or [])
    evidence = f"<br><small>evidence: {e('; '.join(d['evidence']))}</small>" if d.get("evidence") else ""
    return (f"<li><b>{e(d.get('question'))}</b>: {e(d.get('choice'))} — {e(d.get('reason'))}{evidence}"
            + (f"<ul>{alts}</ul>" if alts else "") + "</li>")


def _failing(r: RunRecord) -> str:
    """The failure first: the notebook and cell, the classified cause, each stage log's first error with the lines
    around it (the evidence that decides the cause), links to the logs and the failing notebook."""
    c = r.failing_cell
    if not c:
        return ""
    source = f"<details><summary>the failing cell</summary><pre>{e(c['source'])}</pre></details>" \
        if c.get("source") else ""
    first = r.first_errors[0] if r.first_errors else None
    cause = (f'<p class="cause">Cause: <b>{e(fmt(r.cause))}</b>'
             + (f"; first error in the logs: <code>{e(first.error)}</code>" if first else "; no log of this stage "
                "reports an error") + "</p>")
    logs = "".join(f"<p>{_link(r.run_dir, x.log)} line {x.line_no}:</p><pre>{e(chr(10).join(x.lines))}</pre>"
                   for x in r.first_errors)
    return (f'<h2 class="failed">Failed: {notebook_link(r, c["notebook"])}, cell {e(fmt(c.get("cell_index")))}</h2>'
            f"{cause}{logs}<pre>{e(c.get('ename'))}: {e(str(c.get('evalue') or '')[:2000])}</pre>{source}")


def _timeline(r: RunRecord) -> str:
    """What the run changed on the cluster, in order (records.timeline)."""
    rows = [{"time": s.at, "node": s.node, "action": s.action, "detail": s.detail} for s in r.timeline]
    return f"<h2>Timeline</h2>{_table(rows) if rows else '<p>no action recorded (no events.jsonl or none acted)</p>'}"


def _soak(r: RunRecord) -> str:
    """06's soak over time, where the run soaked (its figure in the run dir's bench/)."""
    name = f"{BENCH}/{SOAK_FIGURE}"
    if not (r.run_dir / name).exists():
        return ""
    return (f"<h2>Soak</h2><p>{_link(r.run_dir, name, 'the soak over time')} (its samples: "
            f"{_link(r.run_dir, f'{BENCH}/{SOAK_SERIES}')})</p><img src=\"{_href(name)}\" alt=\"the soak over time\" "
            'style="max-width:100%">')


def _written_by(r: RunRecord) -> str:
    if r.sparkbook_version is None and r.sparkbook_commit is None:
        return "written by a sparkbook not recorded (a manifest older than the version field)"
    return f"written by sparkbook {e(fmt(r.sparkbook_version))}, commit {e(fmt(r.sparkbook_commit)[:12])}"


def _duration(value: Any) -> str:
    """A notebook's duration as the manifest holds it; a value that is not a number is said so, never formatted."""
    if value is None:
        return ""
    if isinstance(value, int | float) and not isinstance(value, bool):
        return f"{value:.0f} s"
    return f"{e(str(value)[:40])} (not a number: the manifest is not as sparkbook wrote it)"


def _notebook_rows(r: RunRecord) -> list[dict[str, str]]:
    rows = []
    for nb in r.notebooks:
        exc = nb.get("exception") or {}
        duration = _duration(nb.get("duration_s"))
        if nb.get("cell_limit_s"):
            duration += f"<br><small>cell limit {e(nb['cell_limit_s'])} s: {e(nb.get('cell_limit_reason', ''))}</small>"
        status = f'<span class="{e(nb.get("status"))}">{e(nb.get("status"))}</span>'
        rows.append({"notebook": notebook_link(r, nb["name"]), "status": status,
                     "duration": duration,
                     "exception": e(f"{exc.get('ename', '')}: {exc.get('evalue', '')}"[:400]) if exc else "",
                     "decisions": f"<ul>{''.join(_decision(d) for d in nb.get('decisions') or [])}</ul>"})
    return rows


SWEEP_PLOTS = (("throughput.png", "output tok/s by concurrency"), ("latency.png", "TTFT, TPOT and ITL by concurrency"),
               ("depth.png", "TTFT and decode tok/s by context depth"))


def _plots(r: RunRecord) -> str:
    """06's plots that the run dir holds, embedded from its bench/ (relative paths inside the run dir only)."""
    found = [(f"{BENCH}/{name}", title) for name, title in SWEEP_PLOTS if (r.run_dir / BENCH / name).is_file()]
    if not found:
        return ""
    return "<h2>Benchmark plots</h2>" + "".join(
        f'<figure><img src="{_href(path)}" alt="{e(title)}" style="max-width:100%">'
        f"<figcaption>{e(title)} ({_link(r.run_dir, path)})</figcaption></figure>" for path, title in found)


def run_page(r: RunRecord, extra: str = "") -> str:
    """A run's own page: status, key figures, findings, the failing cell, what did not run, each notebook with
    its decisions; `extra` (HTML) is appended (the Restore section)."""
    not_run = (f"<p>Not run: {', '.join(e(n) for n in r.not_run)}</p>" if r.not_run else "")
    params = (f"params {_link(r.run_dir, PARAMS_COPY)} ({e(fmt(r.params_hash))}"
              + (f", copied from <code>{e(r.params_source)}</code>)" if r.params_source else ")")
              if r.params_hash else "params: none kept")
    notebooks = _table(_notebook_rows(r), raw=("notebook", "status", "duration", "exception", "decisions"),
                       classes=[nb.get("status", "") for nb in r.notebooks])
    body = (f"<h1>sparkbook run {e(r.run_id)} — {e(fmt(r.cluster))}</h1>"
            f"<p>Status: <b>{e(r.status)}</b>; started {e(fmt(r.started))}, finished {e(fmt(r.finished))}; "
            f"{params}; <a href=\"{MANIFEST}\">manifest.json</a>; "
            f'{_written_by(r)}; <a href="../index.html">all runs of {e(fmt(r.cluster))}</a></p>{not_run}'
            f"{_failing(r)}<h2>Key figures</h2>{_table(key_figures(r))}{_findings(r)}{_timeline(r)}"
            f"{_plots(r)}{_soak(r)}<h2>Notebooks</h2>{notebooks}"
            f"{extra}")
    return _page(f"sparkbook {r.cluster} {r.run_id}", body)


def _cluster_row(r: RunRecord) -> dict[str, str]:
    out = {k: e(v) for k, v in row(r).items()}
    out["run"] = _link(r.run_dir, INDEX, r.run_id, prefix=f"{r.run_dir.name}/")
    out["notebooks"] = " ".join(notebook_link(r, nb["name"], nb["name"][:2], prefix=f"{r.run_dir.name}/")
                                for nb in r.notebooks)
    return out


FILTER = """<p>Show: <select id="status" onchange="for (const tr of document.querySelectorAll('tr[data-kind]'))
tr.style.display = (this.value === 'all' || tr.dataset.kind === this.value) ? '' : 'none'">
<option>all</option>{options}</select></p>"""


def cluster_page(cluster: str, records: list[RunRecord], watched: list[WatchEvent] | None = None) -> str:
    """Every run of a cluster, newest first, with a status filter; then what `sparkbook watch` recorded."""
    rows = [_cluster_row(r) for r in records]
    table = _table(rows, raw=tuple(rows[0]) if rows else (), classes=[r.kind for r in records])
    options = "".join(f"<option>{s}</option>" for s in STATUSES)
    body = (f"<h1>sparkbook runs of {e(cluster)}</h1><p>{len(records)} run(s), newest first. Status: ok, failed at "
            f"the notebook named, partial (only the notebooks named ran: --only/--from), running (or interrupted), "
            f"unreadable (why).</p>{FILTER.format(options=options)}{table}{_watch_section(watched or [])}")
    return _page(f"sparkbook runs of {cluster}", body)


def _watch_section(watched: list[WatchEvent]) -> str:
    """The watch record's last events, newest first (the whole record is watch.jsonl beside this page)."""
    if not watched:
        return ""
    shown = watched[-WATCH_SHOWN:][::-1]
    rows = [{"at": w.at, "event": w.kind, "deployment's run": w.run or "-", "what": w.text} for w in shown]
    return (f"<h2>Watch</h2><p>the last {len(shown)} of {len(watched)} event(s) of `sparkbook watch`, newest first; "
            f"all of them in {WATCH}</p>{_table(rows)}")


def write_cluster_index(cluster_dir: Path) -> Path:
    """outputs/<cluster>/index.html over every run dir in it; a dir that is no cluster's outputs is refused before
    anything is written (NotOutputs)."""
    path = outputs_tree(cluster_dir, RUNS_REMEDIATION) / INDEX
    path.write_text(cluster_page(cluster_dir.name, runs(cluster_dir), watchlog.read(cluster_dir)))
    return path


def compare_page(c: Comparison, here: Path) -> str:
    """The comparison as a page written in `here` (its links are relative to it)."""
    def link(r: RunRecord) -> str:
        target = _relative(r.run_dir / INDEX, here)
        return f'<a href="{_href(target)}">{e(r.run_id)}</a>' if (r.run_dir / INDEX).exists() else e(r.run_id)

    params = [{"key": x.what, "A": fmt(x.a), "B": fmt(x.b)} for x in c.params]
    image = [{"what": x.what, "A": fmt(x.a), "B": fmt(x.b), "changed": "yes" if x.differs else ""} for x in c.setup]
    decisions = [{"decision": x.what, "A": fmt(x.a), "B": fmt(x.b)} for x in c.decisions]
    figures = [{"figure": f.name, "A": fmt(f.a), "B": fmt(f.b),
                "change %": f"{f.change_pct:+.1f}" if f.change_pct is not None else "-"} for f in c.figures]
    deltas = [{"concurrency": str(d.max_concurrency), "metric": d.metric, "A": f"{d.earlier:,.2f}",
               "B": f"{d.now:,.2f}", "change %": f"{d.change_pct:+.1f}", "noise band": band(d),
               "verdict": f'<span class="{e(d.verdict)}">{e(d.verdict)}</span>'} for d in c.deltas]
    differ = c.setups.line()
    top = f'<p class="setups"><b>{e(differ)}</b></p>' if differ else ""
    body = (f"<h1>sparkbook compare</h1>{top}<p>A: {link(c.a)} ({e(c.a.status)}) — B: {link(c.b)} "
            f"({e(c.b.status)})</p>"
            f"<h2>Params that differ</h2>{'<p>' + e(c.params_note) + '</p>' if c.params_note else ''}"
            f"{_table(params)}<h2>Image and versions</h2>{_table(image)}<h2>Decisions that differ</h2>"
            f"{_table(decisions)}<h2>Figures</h2>{_table(figures)}<h2>Sweep points</h2><p>noise band: the figure's "
            f"spread (max - min) over the points' repeats where the runs have them, else over earlier runs of the "
            f"same params and image; never the spread of single requests. Worse or better only outside the band; "
            f"with no estimate, or between different setups (the line at the top), the change is not judged.</p>"
            f"{_table(deltas, raw=('verdict',))}{_depth_comparison(c)}<h2>GPU clocks</h2>"
            + ("<ul>" + "".join(f"<li>{e(x)}</li>" for x in c.clock_causes) + "</ul>" if c.clock_causes else
               "<p>no point of both runs has clocks clearly apart (or one run did not sample them)</p>"))
    return _page(f"sparkbook compare {c.a.run_id} {c.b.run_id}", body)


def _depth_comparison(c: Comparison) -> str:
    """The context-depth figures of both runs (single stream) and their prefix-cache ratios."""
    rows = [{"depth": str(d.depth), "metric": d.metric, "A": f"{d.earlier:,.2f}", "B": f"{d.now:,.2f}",
             "change %": f"{d.change_pct:+.1f}", "noise band": "-" if d.noise_pct is None else f"+-{d.noise_pct:.1f} %",
             "verdict": f'<span class="{e(d.verdict)}">{e(d.verdict)}</span>'} for d in c.depth_deltas]
    return (f"<h2>Context depth</h2><p>single stream at each depth both runs measured (noise band: the spread over "
            f"each point's repeats); prefix cache, second TTFT / first: {e(ratio_text(c.prefix_ratios))}</p>"
            f"{_table(rows, raw=('verdict',))}")


def _relative(target: Path, here: Path) -> str:
    return os.path.relpath(target.resolve(), here.resolve())


def write_compare(c: Comparison, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(compare_page(c, path.parent))
    return path
