"""`sparkbook watch PARAMS`: keeps the cluster's deployment serving after the benchmark's green checks.

Every watch.interval_s it asks the deployment the operator commands find (operate.last_good: the newest run that
left one serving, so a later `sparkbook run` or `up` is followed) for /health and a one-token completion. A failure
is watch.failures_to_restart failed checks in a row; then it names the cause from the servers' logs in 05's
classifier's words (stages.serve.failures), waits the back-off (runbook.restarts) and brings the deployment back with
`operate.up`, the code path of `sparkbook up`: a run of 04 and 05 that holds the run lock while it restarts, so the
watch never races a `sparkbook run`. When the window's restarts are spent it gives up loudly (WatchGaveUp). While a
live run holds the lock, or after an operator's `sparkbook stop` (a partial one too), it restarts nothing; a lock it
judges stale by `run`'s rules is taken over where its holder is provably gone, and ends the watch loudly where it is
only old (as `run` refuses it). Every event goes to the cluster's
watch record (records.watchlog)."""
from __future__ import annotations

import dataclasses
import signal
import time
from collections.abc import Collection, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from types import FrameType
from typing import NoReturn

import httpx

from ..core.cluster.nodes import Node, NodeError
from ..core.cluster.nodestate import lock_path
from ..core.values.errors import SparkbookError
from ..core.values.evidence import EventsError, now, read_events
from ..core.values.params import bearer, load_params
from ..core.values.redact import Redactor
from ..core.values.rundir import WATCH_BUDGET
from ..records import archive, pages, watchlog
from ..records.watchlog import WatchEvent, WatchKind
from ..stages.serve.failures import SIGNATURES, FailureCause, classify
from ..stages.serve.memory import kernel_lines
from . import lock, operate, stoprecord
from .driver import Say, silent
from .operate import Deployment, NodeStatus
from .restarts import Restarts
from .session import Run, open_run

PROMPT = "The"  # any prompt: the check asks for one token, whatever it is (the lab's random model answers noise)
TAIL_BYTES = 20000  # of each serving node's log: the classifier reads the tail
EVIDENCE_CHARS = 300
PROCESS_GONE = "its `vllm serve` process is not running"  # its container stands: its log is there to read


class WatchGaveUp(SparkbookError):
    """The watch's restarts did not keep the deployment serving: a person has to look."""

    exit_kind = "gave_up"
    label = "WATCH GAVE UP"


def check(d: Deployment, timeout_s: float) -> str | None:
    """None when /health answers 200, a one-token completion comes back and, behind a router, every replica's own
    /health answers 200; else what failed (a green /health over a dead engine is caught by the completion, a dead
    replica the router routes around only by its own /health)."""
    if (health := operate.health(d.endpoint.base_url, d.endpoint.api_key_env)) is not None:
        return f"/health: {health}"
    if (answer := _completion(d, timeout_s)) is not None:
        return answer
    down = [f"the replica on {n} ({url}) /health: {why}" for n, url in d.endpoint.replicas.items()
            if (why := operate.health(url, d.endpoint.api_key_env)) is not None]
    return "; ".join(down) or None


def _completion(d: Deployment, timeout_s: float) -> str | None:
    """None when a one-token completion comes back from the endpoint; else what came instead."""
    url = d.endpoint.base_url.removesuffix("/v1") + "/v1/completions"
    body = {"model": d.endpoint.model, "prompt": PROMPT, "max_tokens": 1, "temperature": 0}
    try:
        r = httpx.post(url, json=body, headers=bearer(d.endpoint.api_key_env), timeout=timeout_s)
        choices = r.json().get("choices") if r.status_code == 200 else None
    except httpx.HTTPError as exc:
        return f"completion: {type(exc).__name__}: {exc}"[:200]
    except ValueError:
        return "completion: HTTP 200 with a body that is not JSON"
    if r.status_code != 200:
        return f"completion: HTTP {r.status_code} {r.text[:120]}"
    return None if choices else "completion: HTTP 200 without a choice"


def observed(nodes: list[NodeStatus], serving: Collection[str]) -> dict[str, str]:
    """What is seen gone without a log: a node unreachable, its container not running, a serving node's `vllm serve`
    exited (these explain a failure better than a consequence in another node's log)."""
    gone = {}
    for n in nodes:
        if n.container.startswith("unreachable"):
            gone[n.node] = n.container
        elif not n.container.startswith(("running", "no container")):
            gone[n.node] = f"its container is {n.container}"
        elif n.node in serving and n.server == "not running":
            gone[n.node] = PROCESS_GONE
    return gone


def diagnose(session: Run, d: Deployment, since_s: float) -> FailureCause:
    """Why the deployment stopped answering, in 05's classifier's words: every serving node's log tail, what is seen
    gone, and the kernel's recent lines where a node's server or container is gone (an OOM kill shows only there).
    Read before the restart: the restart's 05 writes the same log file again."""
    seen = observed(operate.status(session, d).nodes, d.endpoint.commands)
    ctx = session.context(d.image.on_nodes)
    readable = [ctx.cluster.nodes[n] for n in d.endpoint.commands if seen.get(n, PROCESS_GONE) == PROCESS_GONE]

    def read(node: Node) -> str:
        return ctx.runtime.read(node, ctx.places[node.name], operate.server_log(d, node.name), tail_bytes=TAIL_BYTES)

    outcomes = ctx.cluster.fan_out(read, readable, timeout=operate.PROBE_TIMEOUT_S)
    logs = {n: o.value if o.ok and o.value is not None else f"(log unreadable: {o.error})" for n, o in outcomes.items()}
    kernel = kernel_lines(ctx, [n for n, why in seen.items() if not why.startswith("unreachable")], since_s)
    for node, lines in kernel.items():
        if lines:
            logs[node] = logs.get(node, "") + f"\n--- kernel (dmesg) ---\n{lines}"
    return with_log_line(classify(logs, seen), logs, seen)


def with_log_line(cause: FailureCause, logs: dict[str, str], seen: dict[str, str]) -> FailureCause:
    """A cause whose evidence is a fact seen (a process gone) with its node's own log line of that cause beside it
    (the engine's "died unexpectedly"), which the classifier ranks below the fact."""
    if cause.node not in seen or cause.evidence != seen[cause.node]:
        return cause
    line = next((s.first_match(logs.get(cause.node, "")) for s in SIGNATURES if s.cause == cause.cause), None)
    return dataclasses.replace(cause, evidence=f"{cause.evidence}; its log: {line}") if line else cause


def _iso(run_id: str) -> str:
    """A run id's time as `now()` writes times (they compare as text)."""
    return datetime.strptime(run_id, "%Y%m%dT%H%M%SZ").replace(tzinfo=UTC).isoformat(timespec="seconds")


def stopped(d: Deployment, since: str | None) -> stoprecord.OperatorStop | None:
    """The `sparkbook stop` of this deployment (recorded in its run) that holds: a partial one whenever it came, a
    whole one after `since`, the last check that answered (None: since it began serving); None where nobody stopped
    it. A stop is an operator's decision that the watch must not undo."""
    return stoprecord.last(d.run_dir, since or (_iso(d.rolled_back_by) if d.rolled_back_by else ""))


class Watch:
    """One watch of one cluster: the checks' state (failed checks in a row, since when without service), the
    restarts made, and the record it appends to."""

    def __init__(self, params_file: Path, outputs: Path, say: Say = silent):
        self.params_file, self.outputs, self.say = params_file, outputs, say
        self.params = load_params(params_file)  # validated before anything remote
        self.settings = self.params.watch
        self.cluster_dir = outputs / self.params.cluster
        self.redactor = Redactor.from_env(self.params.secrets)
        self.restarts = Restarts.kept(self.settings, self.cluster_dir / WATCH_BUDGET)  # a watch restarted goes on
        self.checks = 0
        self.failed = 0  # checks failed in a row
        self.dark_since: float | None = None  # monotonic time of this failure's first failed check
        self.last_ok: str | None = None  # when a check last answered
        self.noted: str | None = None  # the deferral or pause last recorded (each is recorded once)
        self.up_run: str | None = None  # the run of the last restart that came up
        self.up_dir: Path | None = None  # its run dir
        self.terminated = False  # SIGTERM ended it (systemd's stop: exit 0), not Ctrl-C

    @contextmanager
    def sigterm_ends_it(self) -> Iterator[None]:
        """SIGTERM (systemd's stop) ends the watch the way Ctrl-C does while the body runs (in the main thread), so
        the end is recorded and a restart under way releases the run lock."""
        def terminate(signum: int, frame: FrameType | None) -> None:
            self.terminated = True
            raise KeyboardInterrupt

        previous = signal.signal(signal.SIGTERM, terminate)
        try:
            yield
        finally:
            signal.signal(signal.SIGTERM, previous)

    def record(self, kind: WatchKind, d: Deployment | None, text: str, **fields: str | float | int | None) -> None:
        """Append one event to the cluster's record (redacted), hand its line to `say`, refresh the cluster's page."""
        clean = {k: self.redactor.text(v) if isinstance(v, str) else v for k, v in fields.items()}
        event = WatchEvent.model_validate({"at": now(), "kind": kind, "run": d.run_id if d else None,
                                           "text": self.redactor.text(text), **clean})
        watchlog.append(self.cluster_dir, event)
        pages.write_cluster_index(self.cluster_dir)
        self.say(event.line())

    def run(self, *, checks: int | None = None, for_s: float | None = None) -> int:
        """Check until `checks` checks or `for_s` seconds are done (None: until SIGTERM or Ctrl-C, both recorded);
        the number of checks made. A bound ends the watch between checks: a restart under way finishes first."""
        d = operate.last_good(self.params, self.outputs)  # nothing deployed: refused before anything is recorded
        s = self.settings
        self.record("started", d, f"watching cluster {self.params.cluster}: the deployment of run {d.run_id} "
                    f"({d.endpoint.model} at {d.endpoint.base_url}) every {s.interval_s:g} s; a restart after "
                    f"{s.failures_to_restart} failed check(s) in a row, at most {s.max_restarts} in "
                    f"{s.restart_window_s:g} s ({self.restarts.recent(time.time())} made in it already)")
        end = None if for_s is None else time.monotonic() + for_s
        try:
            while True:
                again = self.round()
                if checks is not None and self.checks >= checks:
                    why = f"{checks} check(s) done (--checks)"
                    break
                left = None if end is None else end - time.monotonic()
                if left is not None and left <= 0:
                    why = f"{for_s:g} s done (--for)"
                    break
                if not again:
                    time.sleep(s.interval_s if left is None else min(left, s.interval_s))
        except KeyboardInterrupt:
            self.record("ended", None, f"watch ended by {'SIGTERM' if self.terminated else 'Ctrl-C'} after "
                        f"{self.checks} check(s)")
            raise
        self.record("ended", None, f"watch ended: {why}, {self.restarts.recent(time.time())} restart(s) in the last "
                    f"{s.restart_window_s:g} s")
        return self.checks

    def round(self) -> bool:
        """One check and what follows from it; True where the next check should come at once (after a restart)."""
        d = operate.last_good(self.params, self.outputs)
        self.checks += 1
        problem = check(d, self.settings.check_timeout_s)
        if problem is None:
            self._answered(d)
            return False
        self.failed += 1
        if self.failed == 1:
            self.dark_since = time.monotonic()
            self.record("check_failed", d, f"the deployment of run {d.run_id} does not answer: {problem}")
        else:
            self.say(f"{now()} check {self.failed} in a row failed: {problem}")
        return self.failed >= self.settings.failures_to_restart and self._failure(d)

    def _answered(self, d: Deployment) -> None:
        if self.dark_since is not None:
            dark = round(time.monotonic() - self.dark_since, 1)
            mine = self.up_run if self.up_run == d.run_id else None  # else another run brought it back, or itself
            by = f"the watch's restart, run {mine}" if mine else f"run {d.run_id}"
            seen = self._behind_front() if mine else None
            self.record("back", d, f"the deployment answers again ({by}) after {dark:g} s without service (from the "
                        "first failed check)" + (f"; behind the front, {seen}" if seen else ""), up_run=mine,
                        seconds_without_service=dark, redeploy=seen)
        self.failed, self.dark_since, self.noted, self.last_ok = 0, None, None, now()

    def _behind_front(self) -> str | None:
        """What the restart's own 05 recorded of its replacement behind the front (None: no front, or unreadable)."""
        try:
            return archive.redeploy(read_events(self.up_dir)) if self.up_dir else None
        except EventsError:
            return None

    def _note(self, kind: WatchKind, d: Deployment, text: str) -> None:
        """Record a deferral or a pause once, not at every check while it lasts."""
        if self.noted != text:
            self.record(kind, d, text)
            self.noted = text

    def _failure(self, d: Deployment) -> bool:
        """A confirmed failure: paused by an operator's stop, deferred to a run holding the lock, else the cause
        recorded and the deployment restarted (or the watch gives up)."""
        if stop := stopped(d, self.last_ok):
            self._note("paused", d, f"the deployment of run {d.run_id} was {stop.describe()}: not restarting it; "
                       f"`sparkbook up {self.params_file}` brings it back and the watch follows")
            return False
        session = open_run(self.params_file, d.run_dir, stage="watch")
        try:
            if (holder := self._lock_holder(session)) and self._waits_for(d, holder):
                return False
            since_s = time.monotonic() - (self.dark_since or time.monotonic()) + 2 * self.settings.interval_s
            cause = diagnose(session, d, since_s)
        finally:
            session.close()
        also = f" (also seen: {', '.join(cause.also)})" if cause.also else ""
        self.record("cause", d, (cause.summary() + also)[:2 * EVIDENCE_CHARS], cause=cause.cause, node=cause.node,
                    evidence=cause.evidence[-EVIDENCE_CHARS:], remediation=cause.remediation)
        wait = self.restarts.next_wait(time.time())
        if wait is None:
            self._give_up(d, cause)
        return self._restart(d, wait or 0.0)

    def _lock_holder(self, session: Run) -> lock.Holder | None:
        try:
            return lock.read(session.cluster.head, lock_path(session.cluster.head))
        except (lock.LockError, NodeError):
            return None  # unreadable here: `up` takes the lock itself and says why it cannot

    def _waits_for(self, d: Deployment, holder: lock.Holder) -> bool:
        """Whether the run lock's holder keeps the watch from restarting, judged by `run`'s rules (runbook.lock): a
        live holder is waited for; one provably gone (its PID on this controller gone or reused) is taken over by the
        restart's `up`, as a run takes it over; one stale only by its age is left to a person, as `run` leaves it:
        the watch gives up, naming the lock and `sparkbook unlock` (a stale lock kept a dark deployment dark)."""
        stale = lock.staleness(holder, self.params.run_lock.stale_after_s)
        if stale is None:
            self._note("deferred", d, f"not restarting while {holder.describe()} holds the run lock (its 04 or 05 "
                       "may be replacing the server)")
            return True
        if lock.dead_here(holder):
            self._note("stale_lock", d, f"the run lock of {holder.describe()} is stale ({stale}): the restart takes "
                       "it over, as `sparkbook run` does")
            return False
        self._stale_lock(d, holder, stale)

    def _stale_lock(self, d: Deployment, holder: lock.Holder, stale: str) -> NoReturn:
        line = (f"cluster {self.params.cluster}: the deployment of run {d.run_id} does not answer and the run lock of "
                f"{holder.describe()} is STALE ({stale}); its holder may run on another machine, so neither `run` nor "
                "the watch takes it over")
        todo = (f"if that run is gone, `sparkbook unlock {self.params_file}`; then `sparkbook up {self.params_file}` "
                "and start the watch again")
        self.record("gave_up", d, f"watch gave up: {line}: {todo}", remediation=todo)
        raise WatchGaveUp(self.redactor.text(line), remediation=self.redactor.text(todo))

    def _give_up(self, d: Deployment, cause: FailureCause) -> None:
        s = self.settings
        spent = (f"{self.restarts.recent(time.time())} restart(s) within {s.restart_window_s:g} s "
                 f"(watch.max_restarts {s.max_restarts}) did not keep it serving")
        line = (f"cluster {self.params.cluster}: the deployment of run {d.run_id} does not answer "
                f"and {spent}; cause: {cause.cause} on {cause.node or 'the cluster'}: {cause.evidence[-200:]!r}")
        todo = (f"{cause.remediation}; then `sparkbook up {self.params_file}` and start the watch again (its record: "
                f"{watchlog.path(self.cluster_dir)})")
        self.record("gave_up", d, f"watch gave up: {line}: {todo}", cause=cause.cause, node=cause.node,
                    remediation=todo)
        raise WatchGaveUp(self.redactor.text(line), remediation=self.redactor.text(todo))

    def _restart(self, d: Deployment, wait: float) -> bool:
        """`sparkbook up` after the back-off; False where it did not bring the deployment up (the next check
        decides what follows), True where it did."""
        if wait:
            self.say(f"{now()} back-off: {wait:g} s before the restart")
            time.sleep(wait)
            current = operate.last_good(self.params, self.outputs)
            if current.run_id != d.run_id or check(current, self.settings.check_timeout_s) is None:
                return True  # another run replaced it, or it answers again: the next check says which
        n = self.restarts.made(time.time())
        self.record("restart", d, f"restart {n} of at most {self.settings.max_restarts} in "
                    f"{self.settings.restart_window_s:g} s: `sparkbook up` (04 and 05 of run {d.run_id}'s plan, under "
                    "the run lock)", restart=n, wait_s=wait)
        try:
            run_dir, manifest, _ = operate.up(self.params_file, self.outputs, say=self.say)
        except lock.LockHeld as exc:
            self.restarts.withdraw()  # nothing was restarted: a run holds the cluster
            if exc.stale:
                self._stale_lock(d, exc.holder, exc.stale)
            self._note("deferred", d, f"restart {n} not made: {exc.holder.describe()} took the run lock first")
            return False
        except SparkbookError as exc:
            self.record("restart_failed", d, f"restart {n} failed: {exc}"[:600], restart=n)
            return False
        failed = [nb for nb in manifest.notebooks if nb.status == "failed"]
        if failed:
            exc_text = (failed[0].exception or {}).get("evalue", "")
            self.record("restart_failed", d, f"restart {n} failed at {failed[0].name} (run {run_dir.name}): "
                        f"{exc_text}"[:600], restart=n, up_run=run_dir.name)
            return False
        self.up_run, self.up_dir = run_dir.name, run_dir
        self.say(f"{now()} restart {n}: run {run_dir.name} brought the deployment up")
        return True
