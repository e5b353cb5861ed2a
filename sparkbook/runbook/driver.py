"""Execute the notebooks in order with papermill under the run lock; resume at a failure; write the run's page.
Progress goes to the caller's `say` (the command line prints it; a library caller may keep it or drop it)."""
from __future__ import annotations

import os
import shutil
import tarfile
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from ..core.cluster.nodes import Cluster, HostKeyMismatch
from ..core.cluster.progress import Progress
from ..core.values import abarm, atomic, seal, state
from ..core.values.errors import SparkbookError
from ..core.values.evidence import now, read_events
from ..core.values.params import Params, ParamsError, load_params
from ..core.values.redact import Redactor, text_files
from ..core.values.rundir import (
    INDEX,
    MANIFEST,
    PARAMS_COPY,
    SEALED,
    STATE,
    new_run_id,
    params_hash,
    relative_text,
)
from ..core.values.stagelist import RAYCLUSTER, SERVE, STAGES
from ..records import pages
from ..records.archive import read_run
from ..records.restore_section import restore_section
from . import arms, fallback, lock
from .carry import carry
from .limits import cell_limit
from .manifest import Manifest, NotebookRun, sparkbook_version

if TYPE_CHECKING:
    from traitlets.config import Config

NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"
# what the driver passes every notebook itself (_run_notebooks; ab_arm: arms.parameters): never the caller's to set
DRIVER_PARAMETERS = ("params_file", "run_dir", "ab_arm")

Say = Callable[[str], None]  # where a line of progress goes


def silent(line: str) -> None:
    """Progress nobody asked for: dropped."""


@dataclass(frozen=True)
class RunOptions:
    """How to execute the runbook: which notebooks (`start`..`upto`, or `only`; NN prefixes), where run dirs go, a run
    dir to resume, notebook parameters, whether to clear a stale run lock, and `seed`: a run dir whose hand-offs
    (state.json) the new run starts from, the notebooks before the selected ones marked skipped (`sparkbook up`)."""

    out_root: Path = Path("outputs")
    resume: Path | None = None
    start: str | None = None
    upto: str | None = None
    only: str | None = None
    parameters: Mapping[str, Any] = field(default_factory=dict)
    break_lock: bool = False
    seed: Path | None = None
    folder: Path = NOTEBOOKS


class RunbookError(SparkbookError):
    """The run cannot start as asked (parameters, notebook selection, host keys); nothing ran."""

    exit_kind = "invalid"


def notebook_names(folder: Path = NOTEBOOKS) -> list[str]:
    """The folder's notebooks in the stage list's order (a test's folder holds its own notebooks for a few stages)."""
    names = sorted(p.name for p in folder.glob("*.ipynb"))
    return [n for stage in STAGES for n in names if stage.owns(n)]


def declared_parameters(notebook: Path) -> set[str]:
    """The names the notebook's `parameters` cell declares, as papermill reads them (what it may inject)."""
    import papermill  # slow to import: only when notebooks are checked or run

    declared = set(papermill.inspect_notebook(str(notebook)))
    if not declared:
        raise RunbookError(f"{notebook.name} declares no parameters (no cell tagged `parameters`, or it assigns "
                           "nothing)")
    return declared


def parameters_for(notebook: Path, parameters: dict[str, Any]) -> dict[str, Any]:
    """Of `parameters`, those `notebook` declares: papermill is passed no other (it warns of unknown ones)."""
    declared = declared_parameters(notebook)
    return {name: value for name, value in parameters.items() if name in declared}


def check_parameters(parameters: dict[str, Any], folder: Path = NOTEBOOKS) -> None:
    """Refuse the driver's own parameters and any no notebook declares, before anything touches a node."""
    own = [name for name in DRIVER_PARAMETERS if name in parameters]
    if own:
        raise RunbookError(f"-p {', '.join(own)}: set by the driver itself (each notebook is given the run dir's own "
                           "params copy, whose cluster is the one locked, its run dir under outputs, and its A/B arm)",
                           remediation="drop them: name the params file as `sparkbook run PARAMS`, where runs go as "
                                       "--outputs")
    known = set().union(*(declared_parameters(folder / n) for n in notebook_names(folder)))
    unknown = sorted(set(parameters) - known)
    if unknown:
        raise RunbookError(f"unknown parameter(s) {unknown}; the notebooks take: {sorted(known)}")


def select(names: list[str], start: str | None = None, only: str | None = None, upto: str | None = None) -> list[str]:
    """The notebooks to run: all, from NN on (up to MM), or only NN (NN: a prefix like '03')."""
    def index(prefix: str) -> int:
        hits = [i for i, n in enumerate(names) if n.startswith(prefix)]
        if len(hits) != 1:
            raise RunbookError(f"{prefix!r} names no single notebook of {names}")
        return hits[0]
    if only:
        return [names[index(only)]]
    return names[index(start) if start else 0:index(upto) + 1 if upto else None]


def execute(params_file: Path, options: RunOptions, say: Say = silent) -> tuple[Path, Manifest]:
    """Execute notebooks into a run dir under the cluster's run lock; stop at the first failure (then fall back to the
    deployment before it where its 04 set that aside); return the run dir and manifest."""
    o = options
    out_root, resume, start, only, upto, seed, folder = o.out_root, o.resume, o.start, o.only, o.upto, o.seed, o.folder
    params_file = params_file.resolve()
    params = load_params(params_file)
    parameters = dict(o.parameters)
    check_parameters(parameters, folder)
    names = notebook_names(folder)
    carried = None  # a new run past 01: the hand-offs it starts from
    if resume:
        run_dir = resume.resolve()
        manifest = _resumed(run_dir, params, names)
        recorded = [nb.name for nb in manifest.notebooks]
        first_bad = next((nb.name for nb in manifest.notebooks if nb.status != "ok"), None)
        if not first_bad and not start and not only:
            say(f"{run_dir}: every notebook already ran ok; nothing to resume")
            return run_dir, manifest
        # from the first that did not run ok, in the recorded order (an A/B's arms included)
        todo = recorded[recorded.index(first_bad):] if first_bad and not start and not only \
            else arms.with_arms(select(names, start, only, upto), params)
        parameters = {**manifest.parameters, **parameters}
        check_parameters(parameters, folder)  # the manifest's too: it never sets the driver's own
        run_id = manifest.run_id
    else:
        run_id = new_run_id()
        run_dir = (out_root / params.cluster / run_id).resolve()
        chosen = select(names, start, only, upto)
        todo, listed = arms.with_arms(chosen, params), arms.with_arms(names, params)
        if seed is not None and (kept := _kept_again(seed, chosen, todo, params)) is not None:
            todo, listed = [kept if SERVE.owns(n) else n for n in todo], [*listed, kept]
            say(f"run {seed.name} serves the baseline its A/B kept: {kept} serves it again")
        carried = carry(out_root / params.cluster, todo) if (start or only) and not seed else None
        manifest = Manifest(params.cluster, run_id, str(params_file), parameters, now(),
                            params_source=params_source(params_file, out_root),
                            notebooks=[NotebookRun(n, "pending" if n in todo or not seed else "skipped")
                                       for n in listed])
    with _run_lock(params, params_file, run_id, resumed=resume is not None, break_lock=o.break_lock, say=say):
        run_dir.mkdir(parents=True, exist_ok=resume is not None)
        if seed:
            seal.write(run_dir / STATE, seal.read(seed / STATE))  # only a state this runbook sealed
            say(f"{run_dir.name}: starts from the hand-offs of run {seed.name}; {', '.join(todo)} run")
        elif carried is not None:
            for value, _ in carried.values:
                state.store(run_dir, value, lambda d: d)  # as the earlier run stored it: redacted already
            say(f"{run_dir.name}: starts from " + ("; ".join(carried.lines()) or "no earlier hand-off"))
        _run_notebooks(params, run_dir, manifest, todo, parameters, params_file, folder, say, only)
    aside = fallback.waiting_aside(run_dir) if Manifest.read(run_dir).status == "failed" else None
    if aside is not None and params.serve.rollback_on_failure:  # after the lock: the rollback run takes it again
        fallback.redeploy_previous(params_file, run_dir, aside, lambda seed: execute(
            seed / PARAMS_COPY, RunOptions(out_root=run_dir.parent.parent, seed=seed, start=RAYCLUSTER.id,
                                           upto=SERVE.id, folder=folder), say), say)
        write_index(run_dir, Manifest.read(run_dir))
        pages.write_cluster_index(run_dir.parent)
    return run_dir, Manifest.read(run_dir)


def _kept_again(seed: Path, chosen: list[str], todo: list[str], params: Params) -> str | None:
    """05's output name where a run seeded from a deployment and serving without an A/B of its own (`up`, a
    rollback) brings back the baseline that deployment's A/B kept (arms.serving_again); None: its own name."""
    if todo != chosen or not any(SERVE.owns(n) for n in todo):
        return None
    return arms.serving_again(seed, params)


def _resumed(run_dir: Path, params: Params, names: list[str]) -> Manifest:
    """The manifest of the run dir `--resume` names, sealed by this runbook and within its schema: the params'
    cluster, notebooks of the stage list only (`names`, the folder's). RunbookError where it is no run dir or its
    manifest is torn or foreign; nothing runs."""
    path = run_dir / MANIFEST
    try:
        manifest = Manifest.read(run_dir)
    except FileNotFoundError:
        raise RunbookError(f"--resume {run_dir}: no run dir (it holds no {MANIFEST})",
                           remediation="name a run dir: `sparkbook runs PARAMS` lists the cluster's") from None
    except OSError as exc:
        raise RunbookError(f"--resume {run_dir}: its {MANIFEST} cannot be read ({type(exc).__name__})",
                           remediation="start a new run instead: `sparkbook run PARAMS`") from None
    if manifest.cluster != params.cluster:
        raise RunbookError(f"--resume {run_dir}: {path} is cluster {manifest.cluster!r}'s, the params' is "
                           f"{params.cluster!r}", remediation="resume it with that cluster's params file")
    foreign = [nb.name for nb in manifest.notebooks if not arms.known(nb.name, names)]
    if foreign:
        raise RunbookError(f"--resume {run_dir}: {path} names notebooks that are not the runbook's: "
                           f"{', '.join(map(repr, foreign))[:200]}; nothing ran",
                           remediation="start a new run instead: `sparkbook run PARAMS`")
    return manifest


@contextmanager
def _run_lock(params: Params, params_file: Path, run_id: str, *, resumed: bool, break_lock: bool,
              say: Say) -> Iterator[None]:
    """Hold the head's run lock while the notebooks run; release it however the run ends (Ctrl-C too)."""
    cluster = Cluster(params, progress=Progress)
    try:
        verify_host_keys(cluster, params_file)
        with lock.held(params, cluster.head, lock.me(run_id, params_file), params_file=str(params_file), say=say,
                       break_stale=break_lock, same_run=run_id if resumed else None) as held:
            say(f"run lock: {held.path} on {held.node.name}, run {run_id}")
            yield
    finally:
        cluster.close()


def verify_host_keys(cluster: Cluster, params_file: Path) -> None:
    """Before any command: an SSH handshake with every node, so a host key that known_hosts does not vouch
    for stops the run naming the node. A node that does not answer is left to the stages to report."""
    ssh = [n for n in cluster if n.spec.transport == "ssh"]
    outcomes = cluster.fan_out(lambda n: n.connect(), ssh, timeout=cluster.params.ssh.connect_timeout_s + 15)
    bad = [o.error for o in outcomes.values() if isinstance(o.error, HostKeyMismatch)]
    if bad:
        raise RunbookError(f"{params_file}: ssh.known_hosts: " + "; ".join(str(e) for e in bad)
                           + ". Nothing ran on any node.")


def copy_params(params_file: Path, params: Params, run_dir: Path) -> Path:
    """The run dir's own params.yaml, what its notebooks load and its page names (for `sparkbook compare` too): the
    source's text, or, where the source names its ssh files relative to itself, the params with those paths resolved,
    so the copy loads from the run dir as the source did."""
    copy = run_dir / PARAMS_COPY
    shutil.copyfile(params_file, copy)
    try:
        same = load_params(copy) == params
    except ParamsError:  # a relative ssh file, which does not lie beside the copy
        same = False
    if not same:
        copy.write_text(yaml.safe_dump(params.model_dump(mode="json"), sort_keys=False))
    return copy


def params_source(params_file: Path, out_root: Path) -> str | None:
    """The params file relative to the repo that holds the outputs (`params/lab.yaml`); None where it lies outside
    it (a test's temporary file), whose path would tell a reader nothing they can open."""
    repo = out_root.resolve().parent
    return str(params_file.relative_to(repo)) if params_file.is_relative_to(repo) else None


def _run_notebooks(params: Params, run_dir: Path, manifest: Manifest, todo: list[str], parameters: dict[str, Any],
                   params_file: Path, folder: Path, say: Say, only: str | None = None) -> None:
    import papermill  # slow to import: only when notebooks really run

    manifest.status, manifest.finished = "running", None
    manifest.sparkbook_version, manifest.sparkbook_commit = sparkbook_version()
    own_params = copy_params(params_file, params, run_dir)
    manifest.params_hash = params_hash(run_dir)
    manifest.write(run_dir)
    os.environ["SPARKBOOK_HEADLESS"] = "1"
    by_name = {nb.name: nb for nb in manifest.notebooks}
    todo, i = list(todo), 0
    while i < len(todo):
        name, i = todo[i], i + 1
        entry = by_name[name]
        if (why := arms.skipped(run_dir, name, params.benchmark.ab)) is not None:
            entry.status = why
            say(f"[{i}/{len(todo)}] {name} {why}")
            continue
        ran = [n for n, e in by_name.items() if not e.status.startswith("skipped")]  # an A/B's arms: this run's
        entry.cell_limit_s, entry.cell_limit_reason = cell_limit(params, name)
        say(f"[{i}/{len(todo)}] {name} … (a cell may run {entry.cell_limit_s} s: {entry.cell_limit_reason})")
        entry.started, t0 = now(), time.monotonic()
        entry.status, entry.exception = "running", None
        manifest.write(run_dir)
        try:
            source = folder / arms.source(name)
            with _ipc_kernel() as kernel:
                papermill.execute_notebook(
                    str(source), str(run_dir / name), kernel_name="python3", cwd=str(folder),
                    parameters=parameters_for(source, {"params_file": str(own_params), "run_dir": str(run_dir),
                                                       **parameters,
                                                       **arms.parameters(name, ran, params.benchmark.ab)}),
                    progress_bar=False, execution_timeout=entry.cell_limit_s, report_mode=False, config=kernel)
            entry.status = "ok"
        except papermill.PapermillExecutionError as exc:
            entry.status = "failed"
            entry.exception = {"ename": exc.ename, "evalue": str(exc.evalue)[:2000], "cell_index": exc.cell_index,
                               "exec_count": exc.exec_count}
        except Exception as exc:  # a dead kernel or papermill itself: still a recorded failure
            entry.status = "failed"
            entry.exception = {"ename": type(exc).__name__, "evalue": str(exc)[:2000], "cell_index": None}
        entry.duration_s = round(time.monotonic() - t0, 1)
        entry.decisions = _decisions(run_dir, name)
        entry.html = _to_html(run_dir, name, say)
        manifest.write(run_dir)
        say(f"[{i}/{len(todo)}] {name} {entry.status} in {entry.duration_s:.0f} s"
            + (f": {entry.exception['ename']}: {entry.exception['evalue'][:300]}" if entry.exception else ""))
        if entry.status == "failed":
            break
        ab = params.benchmark.ab
        if ab is not None and (more := arms.follow_up(run_dir, name, ran, notebook_names(folder), ab)):
            say(f"the A/B keeps its baseline ({abarm.serves(ab, abarm.BASELINE)}): {' and '.join(more)} "
                f"{'serves' if len(more) == 1 else 'serve'} it again")
            todo.extend(more)
            for added in more:
                by_name[added] = NotebookRun(added)
                manifest.notebooks.append(by_name[added])
    manifest.close(todo, only)
    manifest.finished = now()
    manifest.write(run_dir)
    write_index(run_dir, manifest)
    _scrub(run_dir, Redactor.from_env(params.secrets))
    pages.write_cluster_index(run_dir.parent)


@contextmanager
def _ipc_kernel() -> Iterator[Config]:
    """nbclient's config for a kernel on IPC sockets in a private directory: it talks to the driver through files
    only they can reach, not over TCP, so ipykernel has no cause to print its warning of unencrypted TCP (once per
    notebook, amid the runbook's own lines). Its own directory: IPC names its sockets by fixed numbers (1-5)."""
    from traitlets.config import Config  # with papermill: only when notebooks really run

    with tempfile.TemporaryDirectory(prefix="sparkbook-kernel-") as sockets:
        yield Config({"KernelManager": {"transport": "ipc", "ip": str(Path(sockets) / "kernel")}})


def _decisions(run_dir: Path, notebook: str) -> list[dict[str, Any]]:
    stage = notebook.removesuffix(".ipynb")
    return [r["data"] for r in read_events(run_dir, "decision") if r["stage"] == stage]


NOTEBOOK_STYLE = ("body{font-family:sans-serif;margin:2em;max-width:1400px}pre{background:#f6f6f6;padding:6px;"
                  "overflow-x:auto}div.input_area pre,div.jp-InputArea pre{background:#eef}"
                  "table{border-collapse:collapse}td,th{border:1px solid #ddd;padding:2px 6px}")


def _to_html(run_dir: Path, name: str, say: Say) -> str | None:
    """The executed notebook as a static HTML page beside it (a browser shows .ipynb as raw JSON); nbconvert's
    basic template in a small page of our own (its full templates embed ~300 KB of CSS per notebook). None when it
    was not written or nbconvert fails (said, not fatal: the notebook itself is the record)."""
    try:
        from nbconvert import HTMLExporter  # slow to import: only when notebooks really ran
    except ImportError as exc:  # a controller without Jupyter's converter still keeps the notebooks as the record
        say(f"{name}: no HTML page ({exc}); the notebook is the record")
        return None

    source, target = run_dir / name, run_dir / name.replace(".ipynb", ".html")
    if not source.is_file():
        return None
    try:
        body, _ = HTMLExporter(template_name="basic").from_filename(str(source))
    except Exception as exc:  # a notebook nbconvert cannot read: the page links the .ipynb instead
        say(f"{name}: no HTML rendering ({type(exc).__name__}: {str(exc)[:200]})")
        return None
    target.write_text(f'<!doctype html><html><head><meta charset="utf-8"><title>{name}</title>'
                      f'<style>{NOTEBOOK_STYLE}</style></head><body><p><a href="index.html">the run</a> · '
                      f'<a href="{name}">{name}</a></p>{body}</body></html>')
    return target.name


def _scrub(run_dir: Path, redactor: Redactor) -> None:
    """Last line of defence: redact every text file the run wrote (notebooks, logs, state, restore.sh: any suffix);
    and write the paths into the run dir relative to it (papermill's injected run_dir, a cell's "written to ..."), so
    the dir can move."""
    for path, text in text_files(run_dir):
        clean = relative_text(redactor.text(text), run_dir)
        if clean == text:
            continue
        if path.parent == run_dir and path.name in SEALED and seal.problem(path) is None:
            seal.write(path, clean)  # sealed again only where the seal held before
        else:
            path.write_text(clean)


def write_index(run_dir: Path, manifest: Manifest) -> Path:
    """A static page a person can open: status (ok / failed at NN / partial), key figures, findings, the failing
    cell, each notebook with its decisions, and the Restore section."""
    return atomic.write(run_dir / INDEX, pages.run_page(read_run(run_dir, manifest.data()), restore_section(run_dir)))


def pack_run(run_dir: Path) -> Path:
    """run_dir as a .tar.gz beside it (already scrubbed of secrets)."""
    target = run_dir.with_suffix(".tar.gz")
    with tarfile.open(target, "w:gz") as tar:
        tar.add(run_dir, arcname=run_dir.name)
    return target
