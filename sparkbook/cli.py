"""`sparkbook check | run | unlock | lab | restore | runs | compare | up | status | logs | stop | watch`: the command
line.

Exit codes: 0 done; 1 a notebook, a restore step or a command on a node failed (and any other expected
failure); 2 invalid params or run request (unknown parameter, notebook selection, host key not vouched for);
3 the run lock is held, or cannot be taken or cleared; 4 a node cannot be reached or used (SSH, host key, its
Docker daemon); 5 `watch` gave up (its own code, so a service manager restarting it on failure can leave it down);
130 interrupted (Ctrl-C). An expected failure prints one line to stderr (the message and what
to do; invalid params: one line per problem), never a traceback.
`restore` exits 1 when it is refused (each conflict is named; nothing was restored) or a restored target does not
come back (one the plan cannot relaunch is skipped, saying why), 2 when a target to relaunch reads a secret this
environment does not set (named; nothing was restored). `status` exits 0 when every node's server runs and
/health answers, 1 otherwise (a stopped or dark cluster: the table still says what each node shows); `up`, `logs`,
`stop` exit 1 when no run of the cluster deployed a server. `watch` exits 0 at its bound (--checks, --for) or on
SIGTERM, 5 when it gives up (its restarts did not keep the deployment serving), 1 when nothing is deployed.
"""
from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from .core.cluster.nodes import CommandFailed, NodeError
from .core.values.errors import SparkbookError
from .core.values.params import ParamsError, load_params
from .core.values.rundir import INDEX, MANIFEST, PARAMS_COPY, RESTORE_PLAN
from .core.values.stagelist import CLEANUP
from .runbook import driver, lock, operate, watch
from .runbook.manifest import Manifest
from .stages.cleanup.restore import RestorePlanError, SecretUnset
from .stages.serve import endpoints

if TYPE_CHECKING:
    from .runbook.session import Run
    from .stages.cleanup.restore import RestoreOutcome

EXIT_FAILED = 1
EXIT_INVALID = 2
EXIT_LOCKED = 3
EXIT_NODE = 4
EXIT_GAVE_UP = 5
EXIT_INTERRUPTED = 130

# Each kind of expected failure: its exit code and the word its line starts with (most specific first).
EXITS: tuple[tuple[type[SparkbookError], int, str], ...] = (
    (ParamsError, EXIT_INVALID, "invalid params"),
    (driver.RunbookError, EXIT_INVALID, "error"),
    (RestorePlanError, EXIT_INVALID, "invalid restore plan"),
    (SecretUnset, EXIT_INVALID, "refused"),
    (lock.LockError, EXIT_LOCKED, "refused"),
    (watch.WatchGaveUp, EXIT_GAVE_UP, "WATCH GAVE UP"),
    (CommandFailed, EXIT_FAILED, "error"),
    (NodeError, EXIT_NODE, "node unusable"),
    (SparkbookError, EXIT_FAILED, "error"),
)


def _positive_int(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of at least 1")
    return int(text)


def _parameter(text: str) -> tuple[str, Any]:
    name, sep, value = text.partition("=")
    if not sep or not name.isidentifier():
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE, got {text!r}")
    return name, yaml.safe_load(value)


def cmd_check(args: argparse.Namespace) -> int:
    params = load_params(args.params)
    print(f"{args.params}: ok — cluster {params.cluster}, {len(params.nodes)} node(s), head {params.head.name}, "
          f"runtime {params.runtime.kind}, TP={params.serve.tensor_parallel_size} "
          f"PP={params.serve.pipeline_parallel_size} executor={params.serve.executor or 'chosen by 05'} "
          f"layout={params.serve.layout}")
    warning = endpoints.listen_warning(params)
    if warning:
        print(f"warning: {warning}", file=sys.stderr)
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    run_dir, manifest = driver.run(Path(args.params), out_root=Path(args.outputs), resume=args.resume,
                                    start=args.start, only=args.only, upto=args.upto,
                                    parameters=dict(args.parameter or []),
                                    break_lock=args.break_lock)
    print(f"run dir: {run_dir}\nindex:   {run_dir / INDEX}")
    if args.archive:
        print(f"archive: {driver.pack_run(run_dir)}")
    failed = [nb for nb in manifest.notebooks if nb.status == "failed"]
    if failed:
        nb, exc = failed[0], failed[0].exception or {}
        print(f"FAILED at {nb.name} (cell {exc.get('cell_index')}): {exc.get('ename')}: "
              f"{exc.get('evalue', '')[:500]}\nresume with: sparkbook run {args.params} --resume {run_dir}",
              file=sys.stderr)
        return 1
    return 0


def cmd_unlock(args: argparse.Namespace) -> int:
    from .core.cluster.nodes import Cluster

    params = load_params(args.params)
    cluster = Cluster(params)
    try:
        done = lock.unlock(params, cluster.head, force=args.force)
    except NodeError as exc:
        raise lock.LockError(f"cannot reach the run lock on the head: {exc}") from None
    finally:
        cluster.close()
    where = f"{params.run_lock.path} on {params.head.name}"
    if done.holder is None:
        print(f"{where}: no lock; nothing to clear")
    else:
        print(f"{where}: {'removed' if done.removed else 'could NOT remove'} the lock of {done.holder.describe()}"
              + (f" (stale: {done.stale})" if done.stale else ""))
    return 0 if done.holder is None or done.removed else 1


def cmd_lab(args: argparse.Namespace) -> int:
    from . import lab

    try:
        if args.action == "up":
            print(lab.up(nodes=args.nodes, progress=print))
        elif args.action == "down":
            lab.down(progress=print)
        elif args.action == "reset":  # back to the initial state (the old deployment serving) without a restart
            print(lab.reset(progress=print, keep_worker_images=args.keep_worker_images))
        else:
            print(lab.status())
    except lab.LabError as exc:  # the lab keeps its own root; here it is one more expected failure
        raise SparkbookError(str(exc), stage="lab") from None
    return 0


def cmd_restore(args: argparse.Namespace) -> int:
    from .core.values.evidence import read_events
    from .runbook.session import open_run
    from .stages.cleanup import restore
    from .stages.cleanup.act import CleanupError

    run_dir = Path(args.run_dir)
    plan_file = run_dir / RESTORE_PLAN
    manifest = run_dir / MANIFEST
    if plan_file.is_file():
        plan = restore.read_plan(plan_file)
        params_file, steps = plan.params_file, plan.steps
    elif read_events(run_dir, "cleanup_plan"):  # 01 ran here and stopped nothing
        if not manifest.is_file():  # a notebook's own run dir: nothing to record the restore against
            _print_restore(run_dir, restore.RestoreOutcome("nothing to restore"))
            return 0
        own = run_dir / PARAMS_COPY  # the run's own copy, which loads wherever the source has moved
        params_file, steps = str(own) if own.is_file() else Manifest.read(run_dir).params_file, []
    else:
        raise driver.RunbookError(f"{plan_file} not found: {CLEANUP.name} writes it after it stops something")
    # the run dir's own params.yaml, which the driver writes relative to the run dir once the run ends
    run = open_run(run_dir / params_file, run_dir, stage="restore")
    out = restore.RestoreOutcome("nothing to restore")
    try:
        with _locked(run, f"restore-{run_dir.name}") if steps else nullcontext():  # nothing to restore: no node
            for event in restore.restore_deployment(run.context(), steps, run.params.cleanup, args.stop_new):
                run.record(event.kind, event.data)  # each step as it is taken: one that fails later keeps the earlier
                if isinstance(event.data, restore.RestoreOutcome):
                    out = event.data
    finally:
        run.close()
        if manifest.is_file():
            driver.write_index(run_dir, Manifest.read(run_dir))
    _print_restore(run_dir, out)
    if out.result == "refused":
        raise restore.RestoreRefused(
            f"refused, nothing was restored: {'; '.join(c.line() for c in out.conflicts) or 'see the lines above'}",
            remediation=f"clear each one, or `sparkbook restore {run_dir} --stop-new` to stop this runbook's "
                        "node containers (its Ray and vLLM server) first")
    if not out.ok:
        bad = [f"{c.node}/{c.name}: {', '.join(c.problems)}" for c in out.checks if not c.ok]
        raise CleanupError(f"restore failed: {'; '.join(bad) or 'a restore step failed'}",
                                   stage="restore", remediation="see each target's log tail above")
    return 0


def _print_restore(run_dir: Path, out: RestoreOutcome) -> None:
    """What the restore did, step by step, and each target's verdict with the log tail of a failed one."""
    if out.result == "nothing to restore":
        print(f"{run_dir}: {CLEANUP.name} stopped nothing in this run: nothing to restore; nothing was changed")
    for con in out.conflicts:
        print(f"in the way: {con.line()}")
    if out.unread_ports:
        print(f"{CLEANUP.id} saw no listening port of {', '.join(out.unread_ports)} (still starting, or none): a "
              "conflict on their ports cannot be found before acting")
    for a in [*out.stopped_new, *out.actions]:
        print(f"{a.node:12} {a.name:24} {'ok' if a.ok else 'FAILED'}  {a.command}  {a.detail}")
    for c in out.checks:
        print(f"{c.node:12} {c.name:24} {'verified' if c.ok else 'NOT BACK'}  {c.state}; health {c.health}; "
              f"memory {c.memory}" + "".join(f"\n    {p}" for p in c.problems)
              + ("\n    log tail:\n      " + c.log_tail.replace("\n", "\n      ") if c.log_tail else ""))
    if out.checks:
        print(f"{out.result}: {sum(c.ok for c in out.checks)}/{len(out.checks)} target(s) back and verified")


def _locked(run: Run, what: str) -> AbstractContextManager[lock.RunLock]:
    """The cluster's run lock for an operator command on `run`: a restore or a stop racing a run (or each other)
    would act on a cluster another command is changing."""
    return lock.held(run.params, run.cluster.head, lock.me(what, run.params_file), params_file=str(run.params_file),
                     say=print)


def _operated(args: argparse.Namespace) -> tuple[Run, operate.Deployment]:
    """The cluster's last good deployment and a Run on its dir (what the operator commands act on and record in)."""
    from .runbook.session import open_run

    params = load_params(args.params)
    d = operate.last_good(params, Path(args.outputs))
    return open_run(args.params, d.run_dir, stage="operator"), d


def cmd_status(args: argparse.Namespace) -> int:
    import pandas as pd

    run, d = _operated(args)
    try:
        st = operate.status(run, d)
    finally:
        run.cluster.close()
    print("\n".join(st.lines()))
    with pd.option_context("display.max_colwidth", 60, "display.width", 250):
        print(pd.DataFrame([n.row(d) for n in st.nodes]).to_string(index=False))
    print("serving" if st.serving else "NOT serving: `sparkbook up " + args.params + "` brings the deployment back")
    return 0 if st.serving else EXIT_FAILED


def cmd_logs(args: argparse.Namespace) -> int:
    run, d = _operated(args)
    try:
        operate.logs(run, d, args.node or run.params.head.name, follow=args.follow, say=print, router=args.router)
    finally:
        run.cluster.close()
    return 0


def cmd_stop(args: argparse.Namespace) -> int:
    run, d = _operated(args)
    try:
        with _locked(run, f"stop-{d.run_id}"):
            done = operate.stop(run, d, keep_ray=args.keep_ray)
    finally:
        run.cluster.close()
    for s in done:
        print(f"{s.node:12} vllm serve {s.server}; node container {s.container}")
    print(f"stopped the deployment of run {d.run_id} (recorded there); `sparkbook up {args.params}` brings it back")
    return 0


def cmd_up(args: argparse.Namespace) -> int:
    run_dir, manifest, d = operate.up(Path(args.params), Path(args.outputs))
    print(f"run dir: {run_dir}\nindex:   {run_dir / INDEX}")
    failed = [nb for nb in manifest.notebooks if nb.status == "failed"]
    if failed:
        exc = failed[0].exception or {}
        print(f"FAILED at {failed[0].name}: {exc.get('ename')}: {exc.get('evalue', '')[:500]}", file=sys.stderr)
        return EXIT_FAILED
    print(f"up: the deployment of run {d.run_id} serves again (plan {d.plan_hash})")
    return 0


def cmd_watch(args: argparse.Namespace) -> int:
    def say(line: str) -> None:
        print(line, flush=True)  # a journal line as it happens, not when a pipe's buffer fills

    watcher = watch.Watch(Path(args.params), Path(args.outputs), say=say)  # params validated here, nothing remote
    try:
        with watcher.sigterm_ends_it():
            watcher.run(checks=args.checks, for_s=args.for_s)
    except KeyboardInterrupt:
        if watcher.terminated:
            return 0  # systemd's stop: the end was recorded
        raise
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    import pandas as pd

    from .core.cluster.context import Context
    from .core.cluster.nodes import Cluster
    from .core.cluster.runtimes import runtime_for
    from .core.values.evidence import table_rows, to_data
    from .core.values.redact import Redactor
    from .runbook.previews import preview, showed_what_it_could

    params = load_params(args.params)
    cluster, redactor = Cluster(params), Redactor.from_env(params.secrets)
    try:  # nothing is written: the context's run dir is only where the cluster's runs are read from
        parts = preview(Context(params, cluster, runtime_for(params), Path(args.outputs) / params.cluster),
                        Path(args.outputs))
    finally:
        cluster.close()
    for p in parts:
        print(f"\n== {p.stage.name}")
        if p.why:
            print(f"   {redactor.text(p.why)}")
        for shown in p.shown:
            data = redactor.data(to_data(shown.value))
            rows = table_rows(data)
            print(f"-- {redactor.text(shown.title)}")
            with pd.option_context("display.max_colwidth", 2000, "display.width", 10000):
                print(pd.DataFrame(rows).to_string(index=False) if rows is not None else
                      data if isinstance(data, str) else json.dumps(data, indent=2, default=str))
    return 0 if showed_what_it_could(parts) else EXIT_FAILED


def _refused(exc: SparkbookError) -> int:
    """`runs` and `compare` refuse a dir that is no cluster's outputs as invalid input: one line, exit 2."""
    print(f"refused: {exc}", file=sys.stderr)
    return EXIT_INVALID


def cmd_runs(args: argparse.Namespace) -> int:
    import pandas as pd

    from .records import archive, pages, watchlog

    try:
        folders = archive.cluster_dirs(args.target, Path(args.outputs))
    except archive.NotOutputs as exc:
        return _refused(exc)
    for folder in folders:
        records = archive.runs(folder)
        shown = [r for r in records if args.status in (None, r.kind)]
        print(f"{folder.name}: {len(shown)} of {len(records)} run(s), newest first; page: "
              f"{pages.write_cluster_index(folder)}")
        if shown:
            with pd.option_context("display.max_colwidth", 60, "display.width", 250):
                print(pd.DataFrame([archive.row(r) for r in shown]).to_string(index=False))
        watched = watchlog.read(folder)
        if watched:
            print(f"watch: {len(watched)} event(s) in {watchlog.path(folder)}; the last: {watched[-1].line()}")
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    from .records import archive, compare, pages

    outputs = Path(args.outputs)
    a, b = archive.find_run(args.run_a, outputs), archive.find_run(args.run_b, outputs)
    comparison = compare.compare_runs(a, b)
    try:
        page = Path(args.html) if args.html else compare.page_path(comparison.a, comparison.b)
    except archive.NotOutputs as exc:
        return _refused(exc)
    print(comparison.text())
    print(f"\npage: {pages.write_compare(comparison, page)}")
    return 0


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="sparkbook", description=__doc__)
    sub = top.add_subparsers(dest="command", required=True)

    check = sub.add_parser("check", help="validate a params file; touches no node")
    check.add_argument("params")
    check.set_defaults(func=cmd_check)

    run = sub.add_parser("run", help="execute the notebooks in order with papermill")
    run.add_argument("params")
    run.add_argument("-p", "--parameter", type=_parameter, action="append", metavar="NAME=VALUE",
                     help="notebook parameter, e.g. -p confirm_cleanup=true")
    run.add_argument("--from", dest="start", metavar="NN", help="start at notebook NN")
    run.add_argument("--to", dest="upto", metavar="NN", help="stop after notebook NN (with --from: NN..MM)")
    run.add_argument("--only", metavar="NN", help="run only notebook NN")
    run.add_argument("--resume", type=Path, metavar="RUN_DIR", help="continue a run at its first failed notebook")
    run.add_argument("--outputs", default="outputs", help="where run dirs go (default: outputs/)")
    run.add_argument("--archive", action="store_true", help="also write RUN_DIR.tar.gz")
    run.add_argument("--break-lock", action="store_true",
                     help="clear a stale run lock (its holder is gone or too old) before taking it")
    run.set_defaults(func=cmd_run)

    unlock = sub.add_parser("unlock", help="clear the run lock on the head node (after a killed run)")
    unlock.add_argument("params")
    unlock.add_argument("--force", action="store_true", help="even when its holder still runs on this host")
    unlock.set_defaults(func=cmd_unlock)

    lab = sub.add_parser("lab", help="the local multi-node test cluster")
    lab.add_argument("action", choices=["up", "down", "reset", "status"])
    lab.add_argument("--nodes", type=int, default=2)
    lab.add_argument("--keep-worker-images", action="store_true",
                     help="reset: leave the workers the images earlier runs copied (the next 03 copies nothing)")
    lab.set_defaults(func=cmd_lab)

    restore = sub.add_parser("restore", help="bring back what 01-cleanup stopped (its run dir's restore plan)")
    restore.add_argument("run_dir")
    restore.add_argument("--stop-new", action="store_true",
                         help="first stop the node containers this run started (by name and recorded ID)")
    restore.set_defaults(func=cmd_restore)

    runs = sub.add_parser("runs", help="every archived run of a cluster, newest first (and its index.html)")
    runs.add_argument("target", nargs="?", metavar="PARAMS|CLUSTER",
                      help="a params file, a cluster name or its outputs dir (default: every cluster)")
    runs.add_argument("--status", choices=["ok", "failed", "partial", "running", "unreadable"],
                      help="only the runs of this status")
    runs.add_argument("--outputs", default="outputs", help="where run dirs are (default: outputs/)")
    runs.set_defaults(func=cmd_runs)

    comp = sub.add_parser("compare", help="what changed between two runs: params, image, decisions, figures")
    comp.add_argument("run_a", metavar="RUN_A", help="the baseline: a run dir, or a run id under --outputs")
    comp.add_argument("run_b", metavar="RUN_B", help="the run to compare with it")
    comp.add_argument("--outputs", default="outputs", help="where run dirs are (default: outputs/)")
    comp.add_argument("--html", metavar="FILE", help="the page to write (default: compare/RUN_A-vs-RUN_B.html in "
                                                     "RUN_B's cluster outputs)")
    comp.set_defaults(func=cmd_compare)

    def operator(name: str, text: str, func: Callable[[argparse.Namespace], int]) -> argparse.ArgumentParser:
        cmd = sub.add_parser(name, help=text)
        cmd.add_argument("params")
        cmd.add_argument("--outputs", default="outputs", help="where run dirs are (default: outputs/)")
        cmd.set_defaults(func=func)
        return cmd

    operator("plan", "what each stage would do: cleanup targets, memory fit, copies, docker run / ray start / vllm "
                     "serve argv (env by name); read-only probes only", cmd_plan)
    operator("up", "bring back the cluster's last good deployment (04 + 05 from its record; no cleanup, no copies)",
             cmd_up)
    operator("status", "per node: container, Ray, server, model, image, plan, the run that started it, /health",
             cmd_status)
    logs = operator("logs", "a node's vLLM server log (the file 05 writes; docker logs is empty)", cmd_logs)
    logs.add_argument("--node", help="the node (default: the head)")
    logs.add_argument("--follow", "-f", action="store_true", help="keep printing new lines until Ctrl-C")
    logs.add_argument("--router", action="store_true", help="the router's log (serve.layout replicas), on the head")
    watching = operator("watch", "keep the deployment serving: /health and a one-token completion every "
                     "watch.interval_s; on a failure the cause from the logs, `up` with back-off, then give up "
                     "(exit 5); every event in outputs/<cluster>/watch.jsonl", cmd_watch)
    bound = watching.add_mutually_exclusive_group()
    bound.add_argument("--checks", type=_positive_int, metavar="N", help="end after N checks (tests, cron)")
    bound.add_argument("--for", dest="for_s", type=float, metavar="SECONDS", help="end after SECONDS (between checks)")
    stop = operator("stop", "stop the deployment (server and node containers); recorded; `up` brings it back",
                    cmd_stop)
    stop.add_argument("--keep-ray", action="store_true", help="stop only the server; keep the containers and Ray")
    return top


def failure(exc: SparkbookError) -> tuple[int, str]:
    """The exit code of an expected failure and what to print: one line (a params file: one per problem)."""
    code, word = next((code, word) for kind, code, word in EXITS if isinstance(exc, kind))
    if isinstance(exc, ParamsError):
        return code, "\n".join([f"{word} ({len(exc.problems)} problem(s)):", *(f"  {p}" for p in exc.problems)])
    where = f" ({exc.stage})" if exc.stage else ""
    return code, f"{word}{where}: {exc}"


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        code: int = args.func(args)
        return code
    except SparkbookError as exc:
        code, text = failure(exc)
        print(text, file=sys.stderr)
        return code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
