"""01's plan: the running allow-listed targets (and the containers their owners run) in stop order, dependents
first, each with the command that stops it and the one that brings it back; and the decision to act on it."""
from __future__ import annotations

import fnmatch
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Literal

from ...core.values.errors import SparkbookError
from ...core.values.evidence import Alternative, Decision
from ...core.values.params import CleanupTargets
from ...core.values.stagelist import CLEANUP
from . import boot
from .guard import Spared
from .inventory import Inventory, Process, matching
from .relaunch import Relaunch, RunAs, recorded, unknown_secret

STOP_GRACE_S = 10
TargetKind = Literal["container", "unit", "process"]
FIELDS: dict[str, str] = {"container": "cleanup.containers", "unit": "cleanup.systemd_units",
                                 "process": "cleanup.processes"}
NO_SECRETS: Mapping[str, str] = MappingProxyType({})
RELAUNCHED = "relaunched from its recorded argv, working directory and user (not its environment)"


class PatternTooBroad(SparkbookError):
    """A cleanup pattern matches more targets than `cleanup.max_targets` allows: nothing is planned."""

    stage = CLEANUP.name


@dataclass(frozen=True)
class CleanupTarget:
    """One thing the plan stops, with the command that stops it and the one that brings it back."""

    node: str
    kind: TargetKind
    name: str
    pattern: str
    depends_on: list[str]
    stop: str
    restore: str | None
    restore_note: str = ""
    ports: list[int] = field(default_factory=list)  # what it held when 01 inventoried it
    health_url: str = ""
    memory_mib: float = 0.0
    gpu_mib: int = 0
    owner: str = ""  # NODE/TARGET of the unit or managed process that owns this container (stopping it stops this)
    stop_timeout_s: float = STOP_GRACE_S
    launch: Relaunch | None = None  # a process's relaunch (secrets by name); restore finds it again by its argv
    cannot_restore: str | None = None  # why restore cannot bring it back (None: it can, or its owner does)

    def holds(self) -> str:
        """What restore checks it gets back: ports (and the health URL that answered), memory."""
        parts = [f"ports {', '.join(map(str, self.ports))}" if self.ports else "no listening port",
                 self.health_url or "no health URL answered", f"{self.memory_mib:.0f} MiB"]
        return "; ".join(parts + ([f"GPU {self.gpu_mib} MiB"] if self.gpu_mib else []))


@dataclass(frozen=True)
class Plan:
    targets: list[CleanupTarget]
    warnings: list[str] = field(default_factory=list)

    def rows(self) -> list[dict[str, object]]:
        return [{"step": i, "node": t.node, "kind": t.kind, "name": t.name, "matched": t.pattern,
                 "owned by": t.owner, "depends on": ", ".join(t.depends_on), "stop": t.stop,
                 "restore": t.restore or f"(none: {t.cannot_restore or t.restore_note})", "holds": t.holds()}
                for i, t in enumerate(self.targets, 1)]


LIVE = ("running", "restarting", "paused")


def relaunch(pr: Process, secrets: Mapping[str, str], session_uid: int | None) -> Relaunch:
    """How a stopped process is launched again: its exact argv, from its working directory, detached, as the user
    that ran it, each known secret by its variable's name (its environment is not recorded: it may hold secrets)."""
    user = RunAs(*pr.user) if pr.user and pr.user[0] != session_uid else None
    return recorded(pr.cwd, pr.argv, secrets, user)


def cannot_relaunch(pr: Process, secrets: Mapping[str, str], session_uid: int | None) -> str | None:
    """Why restore cannot launch it again: /proc did not show how it was launched or by whom, the SSH user is not
    root and did not run it (only root relaunches as another user), or its command line carried a secret the
    controller does not know (names -> values: `secrets`). None where it can."""
    if not pr.argv:
        return f"started as `{pr.args[:120]}`; /proc did not show how: restart it by hand"
    if pr.user is None or session_uid is None:
        return "/proc did not show which user ran it (a relaunch as another user is no restore): restart it by hand"
    if pr.user[0] != session_uid and session_uid != 0:
        return (f"it ran as uid {pr.user[0]}, and the SSH user (uid {session_uid}) can relaunch neither as that user "
                "nor without root: restart it by hand as its user")
    return unknown_secret(pr.argv, secrets)


def _process(inv: Inventory, pr: Process, t: CleanupTargets, secrets: Mapping[str, str]) -> CleanupTarget:
    pattern = matching(pr.comm, t.processes) or matching(pr.args, t.processes) or "?"
    why = cannot_relaunch(pr, secrets, inv.session_uid)
    how = None if why else relaunch(pr, secrets, inv.session_uid)
    return CleanupTarget(inv.node, "process", f"{pr.comm}[{pr.pid}]", pattern, [], f"kill -TERM {pr.pid}",
                         how.command() if how else None, RELAUNCHED if how else "", *inv.held_by(pr.family or [pr.pid]),
                         stop_timeout_s=t.unit_stop_timeout_s, launch=how, cannot_restore=why)


def _candidates(inv: Inventory, t: CleanupTargets, secrets: Mapping[str, str]) -> list[CleanupTarget]:
    out = []
    for c in inv.containers:
        if c.state in LIVE and (p := matching(c.name, t.containers)):
            out.append(CleanupTarget(inv.node, "container", c.name, p, c.depends_on, f"docker stop {c.name}",
                              f"docker start {c.name}", "", *inv.held_by(c.pids)))
    for u in inv.units:
        if u.active == "active" and u.name not in inv.spared_units() and (p := matching(u.name, t.systemd_units)):
            out.append(CleanupTarget(inv.node, "unit", u.name, p, [], boot.stop_command(u.name, u.file_state),
                              boot.start_command(u.name, u.file_state), "", *inv.held_by(u.pids),
                              stop_timeout_s=max(t.unit_stop_timeout_s, u.stop_timeout_s or 0)))
    return out + [_process(inv, pr, t, secrets) for pr in inv.processes]


def _owner_pids(inv: Inventory, t: CleanupTargets) -> list[tuple[str, set[int], str]]:
    """(target name, the processes it owns, the unit name a container label may carry) per allow-listed owner."""
    out = [(u.name, set(u.pids), u.name) for u in inv.units
           if u.active == "active" and u.name not in inv.spared_units() and matching(u.name, t.systemd_units)]
    return out + [(f"{pr.comm}[{pr.pid}]", set(pr.family or [pr.pid]), "") for pr in inv.processes]


def _daemon_node(address: str, inv: Inventory, inventories: list[Inventory]) -> Inventory | None:
    """The inventory of the node a docker client talks to ("" = its own node); None: not a node of this cluster."""
    if not address:
        return inv
    return next((i for i in inventories if address in i.addresses or address == i.node), None)


def owned(inv: Inventory, inventories: list[Inventory], t: CleanupTargets) -> list[CleanupTarget]:
    """The live containers (on any node) that each allow-listed unit or managed process of this node owns: its
    docker run/start clients name them, or (a unit) their labels name the unit. Stopping the owner stops them."""
    out: list[CleanupTarget] = []
    for owner, pids, unit in _owner_pids(inv, t):
        refs = [(node, c.ref) for c in inv.clients if c.pid in pids
                if (node := _daemon_node(c.host, inv, inventories)) is not None]
        found = [(node, c) for node, ref in refs for c in node.containers if ref in (c.name, c.id)
                 or (len(ref) >= 12 and ref.startswith(c.id))]
        found += [(i, c) for i in inventories for c in i.containers if unit and unit in c.labels.values()]
        by = f"{inv.node}/{owner}"
        timeout = max(t.unit_stop_timeout_s, next((u.stop_timeout_s or 0 for u in inv.units if u.name == unit), 0))
        for node, c in found:
            if c.state in LIVE and not any(o.node == node.node and o.name == c.name for o in out):
                out.append(CleanupTarget(node.node, "container", c.name, f"owned by {by}", [], f"stops with {by}", None,
                                  f"comes back with {by}", *node.held_by(c.pids), owner=by, stop_timeout_s=timeout))
    return out


def _unit_dependents(invs: list[Inventory]) -> dict[tuple[str, str], list[str]]:
    """(node, unit) -> the units that Require it (they are stopped first)."""
    return {(i.node, u.name): u.requires for i in invs for u in i.units if u.requires}


def plan(inventories: list[Inventory], targets: CleanupTargets, secrets: Mapping[str, str] = NO_SECRETS) -> Plan:
    """Running allow-listed targets; `order` patterns first, then dependents before their dependencies; each
    container a unit or managed process owns right after its owner (it stops with it, not on its own). `secrets`:
    the known secrets (name -> value), which a process's relaunch records by name; a target that cannot be
    brought back is a warning."""
    by_owner = [o for inv in inventories for o in owned(inv, inventories, targets)]
    taken = {(o.node, o.name) for o in by_owner}
    found = [c for inv in inventories for c in _candidates(inv, targets, secrets) if (c.node, c.name) not in taken]
    refuse_broad(found, targets.max_targets, [(inv.node, s) for inv in inventories for s in inv.spared])
    deps = {(c.node, c.name): set(c.depends_on) for c in found}
    for (node, unit), by in _unit_dependents(inventories).items():
        for dependent in by:
            deps.setdefault((node, dependent), set()).add(unit)

    def rank(c: CleanupTarget) -> int:
        return next((i for i, p in enumerate(targets.order) if fnmatch.fnmatchcase(c.name, p)), len(targets.order))

    ordered: list[CleanupTarget] = []
    for r in sorted({rank(c) for c in found}):
        ordered += _dependents_first([c for c in found if rank(c) == r], deps)
    spared = [s.line(inv.node) for inv in inventories for s in inv.spared]
    lost = [f"{c.node}/{c.name} cannot be restored: {c.cannot_restore}" for c in ordered if c.cannot_restore]
    return Plan(_under_owners(ordered, by_owner), _order_conflicts(ordered, deps) + spared + lost)


def refuse_broad(found: list[CleanupTarget], limit: int, spared: list[tuple[str, Spared]]) -> None:
    """Refuse the plan where one pattern matches more than `limit` targets on one node, those it spares (node,
    what) counted too: a typo (`*`, `*python*`) would otherwise plan half the node, and only confirm_cleanup would
    stand between it and the kill; counted after sparing, `*` on a quiet node would pass and plan the rest."""
    by: dict[tuple[str, str, str], list[str]] = {}
    for c in found:
        by.setdefault((c.node, c.kind, c.pattern), []).append(c.name)
    for node, s in spared:
        by.setdefault((node, s.kind, s.pattern), []).append(f"{s.name} (never stopped)")
    broad = [f"{FIELDS[kind]} pattern {pattern!r} matches {len(names)} targets on {node}: {', '.join(names)}"
             for (node, kind, pattern), names in by.items() if len(names) > limit]
    if broad:
        raise PatternTooBroad(f"{'; '.join(broad)}; more than cleanup.max_targets ({limit}): nothing is planned",
                              remediation="narrow the pattern, or raise cleanup.max_targets where every one of them "
                                          "belongs to the old deployment")


def _under_owners(ordered: list[CleanupTarget], by_owner: list[CleanupTarget]) -> list[CleanupTarget]:
    return [x for t in ordered for x in [t, *[o for o in by_owner if o.owner == f"{t.node}/{t.name}"]]]


def _dependents_first(group: list[CleanupTarget], deps: dict[tuple[str, str], set[str]]) -> list[CleanupTarget]:
    """Topological order where a target comes before everything it depends on (stable otherwise)."""
    left, out = list(group), []
    while left:
        needed = {d for c in left for d in deps.get((c.node, c.name), set())}
        ready = [c for c in left if c.name not in needed] or left[:1]  # a cycle: break it in list order
        out.append(ready[0])
        left.remove(ready[0])
    return out


def _order_conflicts(ordered: list[CleanupTarget], deps: dict[tuple[str, str], set[str]]) -> list[str]:
    seen: dict[tuple[str, str], int] = {}
    warnings = []
    for i, c in enumerate(ordered):
        for d in deps.get((c.node, c.name), set()):
            if (c.node, d) in seen:
                warnings.append(f"{c.node}: {d} is stopped (step {seen[(c.node, d)] + 1}) before {c.name} "
                                f"(step {i + 1}), which depends on it: cleanup.order asks for that")
        seen[(c.node, c.name)] = i
    return warnings


def decision(p: Plan, confirmed: bool, unreached: list[str]) -> Decision:
    """Whether this run stops the plan's targets, and on what evidence."""
    what = f"{len(p.targets)} target(s): " + ", ".join(f"{t.node}/{t.name}" for t in p.targets)
    evidence = [what, *p.warnings] + [f"not inventoried (unreachable): {n}" for n in unreached]
    if confirmed and p.targets:
        return Decision("Stop the old deployment now?", "stop, in plan order",
                        "confirm_cleanup is true; every target is allow-listed or owned by an allow-listed unit or "
                        "process, and the restore plan is written before the first stop",
                        [Alternative("show the plan only", "the parameter confirms the stop")], evidence)
    why = "nothing allow-listed is running" if not p.targets else "confirm_cleanup is false"
    return Decision("Stop the old deployment now?", "show the plan only", why,
                    [Alternative("stop, in plan order", why)], evidence)

