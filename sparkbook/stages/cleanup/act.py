"""01's acting: stop each planned target in plan order (each a recorded Action), then verify that every target
stopped and nothing outside the plan changed; what 01 hands on."""
from __future__ import annotations

import shlex
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tenacity import Retrying, retry_if_result, stop_after_delay, wait_fixed

from ...core.cluster.context import Context
from ...core.cluster.docker_ssh import docker_client
from ...core.cluster.nodes import Node, shell
from ...core.values.errors import SparkbookError
from ...core.values.handoff import Action, Stopped
from ...core.values.stagelist import CLEANUP
from . import boot
from .inventory import PROBE_TIMEOUT_S, Inventory, vanished
from .planning import STOP_GRACE_S, CleanupTarget, Plan


class CleanupError(SparkbookError):
    """A cleanup or restore step cannot be done; the message says which and why."""

    stage = CLEANUP.name


@dataclass(frozen=True)
class Verification:
    stopped: list[dict[str, object]]
    memory: list[dict[str, object]]
    untouched_changes: list[str]
    not_ours: list[str]  # changes cleanup cannot make (an exited container removed): someone else's work

    @property
    def ok(self) -> bool:
        return all(r["stopped"] for r in self.stopped) and not self.untouched_changes

    def summary(self) -> str:
        bad = [r["name"] for r in self.stopped if not r["stopped"]]
        return (f"{len(self.stopped) - len(bad)}/{len(self.stopped)} targets stopped"
                + (f" (still running: {bad})" if bad else "")
                + (f"; touched outside the allow-lists: {self.untouched_changes}" if self.untouched_changes
                   else "; nothing outside the allow-lists was stopped")
                + (f"; meanwhile, not by cleanup: {self.not_ours}" if self.not_ours else ""))


def _stop_one(node: Node, t: CleanupTarget) -> str:
    match t.kind:
        case "container" if t.owner:
            return _gone_with_owner(node, t)
        case "container":
            client = docker_client(node, timeout=STOP_GRACE_S + PROBE_TIMEOUT_S)
            try:
                client.containers.get(t.name).stop(timeout=STOP_GRACE_S)
            except Exception as exc:
                if not vanished(exc):
                    raise
                return f"gone already ({type(exc).__name__})"
            return "stopped"
        case "unit":
            done = node.run(shlex.split(t.stop), timeout=t.stop_timeout_s + PROBE_TIMEOUT_S, check=True)
            return f"stopped; {boot.links(done.stdout + done.stderr).describe()}"
        case "process":
            pid = t.stop.split()[-1]
            node.run(shell("kill -TERM {pid}; for i in $(seq 1 {grace}); do kill -0 {pid} 2>/dev/null || exit 0; "
                           "sleep 1; done; echo still running; exit 1", pid=pid, grace=int(t.stop_timeout_s)),
                     timeout=t.stop_timeout_s + PROBE_TIMEOUT_S, check=True)
            return "exited"


def _gone_with_owner(node: Node, t: CleanupTarget) -> str:
    """An owned container: its owner stopped it (a `--rm` one is removed); wait for that, up to the owner's
    stop timeout."""
    client = docker_client(node, timeout=PROBE_TIMEOUT_S)

    def live() -> bool:
        return any(c.name == t.name for c in client.containers.list(filters={"name": f"^{t.name}$"},
                                                                       ignore_removed=True))

    if Retrying(stop=stop_after_delay(t.stop_timeout_s), wait=wait_fixed(1), retry=retry_if_result(bool),
                retry_error_callback=lambda state: state.outcome.result() if state.outcome else None)(live):
        raise CleanupError(f"{t.name} still runs {t.stop_timeout_s:.0f} s after {t.owner} stopped",
                           node=node.name, remediation=f"stop it by hand: docker stop {t.name}")
    return f"gone with {t.owner}"


def _stopping(t: CleanupTarget) -> Callable[[Node], str]:
    return lambda node: _stop_one(node, t)


def stop(ctx: Context, p: Plan) -> list[Action]:
    """Stop every target in plan order; a failure is recorded and the rest still run."""
    return [act(ctx.cluster.nodes[t.node], t.name, t.stop, _stopping(t)) for t in p.targets]


def act(node: Node, name: str, command: str, do: Callable[[Node], str]) -> Action:
    """`do` on the node as one recorded Action (stop or restore): how it went and how long it took."""
    t0 = time.monotonic()
    try:
        return Action(node.name, name, command, True, do(node).strip()[-200:], round(time.monotonic() - t0, 2))
    except Exception as exc:  # reported per target, never hidden
        return Action(node.name, name, command, False, f"{type(exc).__name__}: {exc}"[-300:],
                      round(time.monotonic() - t0, 2))


def verify(p: Plan, before: list[Inventory], after: list[Inventory]) -> Verification:
    """Every target stopped, memory before/after per node, and nothing outside the plan changed state."""
    b, a = {i.node: i for i in before}, {i.node: i for i in after}
    planned = {(t.node, t.name) for t in p.targets}
    stopped = [{"node": t.node, "name": t.name, "stopped": not _running(a[t.node], t)} for t in p.targets
               if t.node in a]
    changes: list[str] = []
    elsewhere: list[str] = []
    for node, inv in b.items():
        if node not in a:
            changes.append(f"{node}: no inventory after cleanup")
            continue
        now = {c.name: c.state for c in a[node].containers} | {u.name: u.active for u in a[node].units}
        for name, state, live in [(c.name, c.state, "running") for c in inv.containers] + \
                                 [(u.name, u.active, "active") for u in inv.units]:
            if (node, name) in planned or now.get(name) == state:
                continue
            line = f"{node}: {name} {state} -> {now.get(name, 'gone')}"
            (changes if state == live else elsewhere).append(line)  # cleanup only ever stops what runs
    memory = [{"node": n, **b[n].memory.delta(a[n].memory)} for n in b if n in a]
    return Verification(stopped, memory, changes, elsewhere)


def _running(inv: Inventory, t: CleanupTarget) -> bool:
    match t.kind:
        case "container":
            return any(c.name == t.name and c.state == "running" for c in inv.containers)
        case "unit":
            return any(u.name == t.name and u.active == "active" for u in inv.units)
        case "process":
            return any(f"{p.comm}[{p.pid}]" == t.name for p in inv.processes)


def outcome(actions: list[Action], restore_plan: Path) -> Stopped:
    """What 01 leaves in the run state: the stops that succeeded and where their restore plan is."""
    return Stopped(stopped=[a for a in actions if a.ok], restore_plan=str(restore_plan))
