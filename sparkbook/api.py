"""The library contract: one typed function per operation of the command line (run, plan, check, status, logs, stop,
up, watch, restore, unlock, runs, compare), each taking typed options and returning a typed result.

None prints and none exits: a long operation (run, up, watch, logs) hands each line of progress to the `say` its
caller passes (dropped by default), and every failure is a SparkbookError whose `exit_kind`, `node`, `stage` and
`remediation` say what kind it is, where, and what to do. The command line (sparkbook.cli) only parses and renders
this."""
from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path

from .core.cluster.context import Context
from .core.cluster.nodes import Cluster, NodeError
from .core.cluster.nodestate import lock_path
from .core.cluster.runtimes import runtime_for
from .core.values.errors import ExitKind, SparkbookError
from .core.values.evidence import Shown, to_data
from .core.values.params import Params, ParamsError, load_params
from .core.values.redact import Redactor
from .records import archive, pages, watchlog
from .records.archive import RunRecord
from .records.compare import Comparison, compare_runs, page_path
from .records.watchlog import WatchEvent
from .runbook import driver, lock, operate, previews, watchlock
from .runbook.driver import RunbookError, RunOptions, Say, silent
from .runbook.lock import LockError, Unlocked
from .runbook.manifest import Manifest, NotebookRun
from .runbook.operate import Deployment, NodeStopped, NothingDeployed, Status
from .runbook.previews import StagePlan
from .runbook.restoration import restore_run
from .runbook.watch import Watch, WatchGaveUp
from .stages.cleanup.restore import RestoreFailed, RestoreOutcome, RestoreRefused
from .stages.serve import endpoints

OUTPUTS = Path("outputs")  # where run dirs go unless a caller says otherwise

__all__ = [
    "ExitKind", "SparkbookError", "ParamsError", "RunbookError", "LockError", "NothingDeployed", "WatchGaveUp",
    "RestoreRefused", "RestoreFailed", "Say", "RunOptions", "LogsOptions", "WatchOptions",
    "Checked", "RunResult", "StagePlan", "PlanResult", "Status", "StopResult", "UpResult", "WatchEnd",
    "RestoreOutcome", "UnlockResult", "ClusterRuns", "Compared",
    "Manifest", "NotebookRun", "Shown", "Deployment", "NodeStopped", "Unlocked", "RunRecord", "Comparison",
    "WatchEvent",
    "check", "run", "plan", "status", "logs", "stop", "up", "watch", "restore", "unlock", "runs", "compare",
]


# check
@dataclass(frozen=True)
class Checked:
    """A params file that validates: the params, and a warning where the endpoint listens where clients may not
    reach it (None: nothing to warn of)."""

    params: Params
    listen_warning: str | None


def check(params_file: Path) -> Checked:
    """Validate a params file; touches no node (ParamsError naming every problem)."""
    params = load_params(params_file)
    return Checked(params, endpoints.listen_warning(params))


# run
@dataclass(frozen=True)
class RunResult:
    """A run of the runbook: its dir, its manifest (each notebook's status), and its archive where one was asked."""

    run_dir: Path
    manifest: Manifest
    archive: Path | None = None

    @property
    def failed(self) -> NotebookRun | None:
        return self.manifest.first_failed()


def run(params_file: Path, options: RunOptions | None = None, *, archive: bool = False,
        say: Say = silent) -> RunResult:
    """Execute the notebooks in order under the cluster's run lock; with `archive`, also pack the run dir as
    RUN_DIR.tar.gz. A notebook that fails ends the run: the result names it (`failed`), it is not raised."""
    run_dir, manifest = driver.execute(params_file, options or RunOptions(), say)
    return RunResult(run_dir, manifest, driver.pack_run(run_dir) if archive else None)


# plan
@dataclass(frozen=True)
class PlanResult:
    """Each stage's part of the plan, redacted, each shown value as plain data."""

    stages: list[StagePlan]

    @property
    def showed_what_it_could(self) -> bool:
        return previews.showed_what_it_could(self.stages)


def plan(params_file: Path, outputs: Path = OUTPUTS) -> PlanResult:
    """What each stage would do, read-only probes only; nothing is written (the cluster's runs under `outputs` are
    read for the image a redeploy keeps)."""
    params = load_params(params_file)
    cluster, redactor = Cluster(params), Redactor.from_env(params.secrets)
    try:
        parts = previews.preview(Context(params, cluster, runtime_for(params), outputs / params.cluster), outputs)
    finally:
        cluster.close()

    def said(text: str | None) -> str | None:
        return redactor.text(text) if text else None

    return PlanResult([StagePlan(p.stage, [Shown(redactor.text(s.title), redactor.data(to_data(s.value)))
                                              for s in p.shown], said(p.unknown), said(p.failed))
                       for p in parts])


# the operator's commands on the cluster's last good deployment
def status(params_file: Path, outputs: Path = OUTPUTS) -> Status:
    """Every node's container, Ray and server and the endpoint's /health, read-only (NothingDeployed where no run
    deployed a server)."""
    session, d = operate.opened(params_file, outputs)
    try:
        return operate.status(session, d)
    finally:
        session.close()


@dataclass(frozen=True)
class LogsOptions:
    """Whose log: a node's vLLM server (None: the head's) or the router's; `follow`: new lines until interrupted."""

    outputs: Path = OUTPUTS
    node: str | None = None
    follow: bool = False
    router: bool = False


def logs(params_file: Path, options: LogsOptions | None = None, *, say: Say = silent) -> None:
    """Hand the log's tail to `say`, then with `follow` each new part until KeyboardInterrupt."""
    o = options or LogsOptions()
    session, d = operate.opened(params_file, o.outputs)
    try:
        operate.logs(session, d, o.node or session.params.head.name, follow=o.follow, say=say, router=o.router)
    finally:
        session.close()


@dataclass(frozen=True)
class StopResult:
    deployment: Deployment
    nodes: list[NodeStopped]


def stop(params_file: Path, outputs: Path = OUTPUTS, *, keep_ray: bool = False, say: Say = silent) -> StopResult:
    """Stop the deployment's servers (and unless `keep_ray` its node containers) under the run lock; recorded in
    its run, so `up` brings it back."""
    session, d = operate.opened(params_file, outputs)
    try:
        with operate.operator_lock(session, f"stop-{d.run_id}", say):
            done = operate.stop(session, d, keep_ray=keep_ray)
    finally:
        session.close()
    return StopResult(d, done)


@dataclass(frozen=True)
class UpResult:
    """The run of 04 and 05 that brought the deployment back (or failed at `failed`), and the deployment."""

    run_dir: Path
    manifest: Manifest
    deployment: Deployment

    @property
    def failed(self) -> NotebookRun | None:
        return self.manifest.first_failed()


def up(params_file: Path, outputs: Path = OUTPUTS, *, say: Say = silent) -> UpResult:
    """The cluster's last good deployment again: a run of 04 and 05 from its hand-offs (no cleanup, no copies)."""
    return UpResult(*operate.up(params_file, outputs, say=say))


@dataclass(frozen=True)
class WatchOptions:
    """When the watch ends: after `checks` checks or `for_s` seconds (None: only when stopped). `sigterm_ends`:
    SIGTERM ends it as Ctrl-C does, recorded (a service manager's stop; only from the main thread)."""

    outputs: Path = OUTPUTS
    checks: int | None = None
    for_s: float | None = None
    sigterm_ends: bool = False


@dataclass(frozen=True)
class WatchEnd:
    checks: int
    by_sigterm: bool  # True: SIGTERM ended it, False: its bound


def watch(params_file: Path, options: WatchOptions | None = None, *, say: Say = silent) -> WatchEnd:
    """Keep the deployment serving, restarting it on a confirmed failure; WatchGaveUp where its restarts did not,
    WatchRunning where another watch of the cluster runs. Ctrl-C is recorded and raised as KeyboardInterrupt."""
    o = options or WatchOptions()
    watcher = Watch(params_file, o.outputs, say=say)  # params validated here, nothing remote
    try:
        with watchlock.held(watcher.cluster_dir, params_file, say), \
                watcher.sigterm_ends_it() if o.sigterm_ends else nullcontext():
            return WatchEnd(watcher.run(checks=o.checks, for_s=o.for_s), by_sigterm=False)
    except KeyboardInterrupt:
        if watcher.terminated:
            return WatchEnd(watcher.checks, by_sigterm=True)
        raise


# restore and the run lock
def restore(run_dir: Path, *, stop_new: bool = False, say: Say = silent) -> RestoreOutcome:
    """Bring back what the run's 01 stopped; RestoreRefused or RestoreFailed carry the outcome where it is not ok."""
    return restore_run(run_dir, stop_new=stop_new, say=say)


@dataclass(frozen=True)
class UnlockResult:
    where: str  # the lock's path and node
    done: Unlocked

    @property
    def cleared(self) -> bool:
        """No lock is left: there was none, or it was removed."""
        return self.done.holder is None or self.done.removed


def unlock(params_file: Path, *, force: bool = False) -> UnlockResult:
    """Clear the run lock on the head (after a killed run); one whose holder still runs here only with `force`."""
    params = load_params(params_file)
    cluster = Cluster(params)
    try:
        done = lock.unlock(params, cluster.head, force=force)
        where = f"{lock_path(cluster.head)} on {params.head.name}"
    except NodeError as exc:
        raise LockError(f"cannot reach the run lock on the head: {exc}") from None
    finally:
        cluster.close()
    return UnlockResult(where, done)


# the records
@dataclass(frozen=True)
class ClusterRuns:
    """One cluster's archived runs, newest first: all of them, those of the status asked, its index page, and its
    watch record."""

    folder: Path
    runs: list[RunRecord]
    shown: list[RunRecord]
    page: Path
    watched: list[WatchEvent] = field(default_factory=list)

    def rows(self) -> list[dict[str, str]]:
        return [archive.row(r) for r in self.shown]

    @property
    def watch_record(self) -> Path:
        return watchlog.path(self.folder)


def runs(target: str | None = None, outputs: Path = OUTPUTS, *, status: str | None = None) -> list[ClusterRuns]:
    """Every archived run of the clusters `target` names (a params file, a cluster, its outputs dir; None: every
    cluster), each cluster's index page written; NotOutputs where a dir is no cluster's outputs."""
    found = []
    for folder in archive.cluster_dirs(target, outputs):
        records = archive.runs(folder)
        found.append(ClusterRuns(folder, records, [r for r in records if status in (None, r.kind)],
                                 pages.write_cluster_index(folder), watchlog.read(folder)))
    return found


@dataclass(frozen=True)
class Compared:
    comparison: Comparison
    page: Path


def compare(run_a: str, run_b: str, outputs: Path = OUTPUTS, *, html: Path | None = None) -> Compared:
    """What changed between two runs (dirs, or run ids under `outputs`), its page written to `html` (None: beside
    run B's cluster outputs)."""
    comparison = compare_runs(archive.find_run(run_a, outputs), archive.find_run(run_b, outputs))
    page = html or page_path(comparison.a, comparison.b, outputs)
    return Compared(comparison, pages.write_compare(comparison, page))
