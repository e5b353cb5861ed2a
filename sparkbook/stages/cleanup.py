"""Cleanup: inventory what the old deployment holds, plan its stop (dependents first), act, verify, restore
(after finding what stands in the way of each target, and verifying what came back)."""
from __future__ import annotations

import fnmatch
import json
import re
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

from ..core.docker_ssh import docker_client, unavailable
from ..core.handoff import Action, CleanupOutcome, RayCluster
from ..core.errors import SparkbookError
from ..core.hostfacts import FANOUT_TIMEOUT_S, GpuApp, Memory, gpu_apps, meminfo, memory_from, sections
from ..core.nodes import Cluster, Node, Outcome, shell
from ..core.params import CleanupTargets
from ..core.record import Alternative, Decision, Run, tail
from ..core.state import MissingState

DEPENDS_LABELS = ("org.sparkbook.lab.depends-on", "com.docker.compose.depends_on")
NO_SYSTEMD = ("not been booted with systemd", "Failed to connect to bus", "No such file or directory")
RESTORE_FILE = "restore-plan.json"
STOP_GRACE_S = 10
PROBE_TIMEOUT_S = 20
HEALTH_PATH = "/health"  # asked of each port a target listens on; the answering ones are its health URL
READY_TIMEOUT_S = 600  # a restored target has this long to answer its health check (a model loads)
GRACE_S = 15  # then it must still run and answer this much later (the old vLLM died after 11 s)
MEMORY_BACK_SHARE = 0.5  # a restored target holds at least this share of the memory it held before cleanup
LOG_TAIL_LINES = 30


@dataclass(frozen=True)
class Container:
    name: str
    id: str
    image: str
    state: str
    depends_on: list[str]
    pids: list[int] = field(default_factory=list)  # of a running container, as the node sees them
    rss_mib: float = 0.0


@dataclass(frozen=True)
class Listener:
    """A listening TCP socket of a node (`ss -ltnp`) and the processes holding it."""

    address: str
    port: int
    pids: list[int]

    @property
    def url_host(self) -> str:
        return "127.0.0.1" if self.address in ("0.0.0.0", "*", "[::]", "::") else self.address


@dataclass(frozen=True)
class Unit:
    name: str
    active: str
    requires: list[str]


@dataclass(frozen=True)
class Process:
    pid: int
    comm: str
    args: str


@dataclass(frozen=True)
class Inventory:
    """One node as cleanup sees it; `systemd` and `gpu` are facts ("no systemd", "no GPU") when absent."""

    node: str
    containers: list[Container]
    docker: str
    units: list[Unit]
    systemd: str
    processes: list[Process]
    gpu: str
    gpu_apps: list[GpuApp]
    memory: Memory
    listeners: list[Listener] = field(default_factory=list)  # below the ephemeral port range
    health: dict[int, str] = field(default_factory=dict)  # port -> health URL that answered on the node

    def holder(self, pid: int) -> str:
        """The container a process belongs to, else the process itself."""
        return next((f"container {c.name}" for c in self.containers if pid in c.pids),
                    next((f"process {p.comm}[{pid}]" for p in self.processes if p.pid == pid), f"pid {pid}"))

    def held_by(self, pids: list[int]) -> tuple[list[int], str, float, int]:
        """What these processes hold: ports, the first health URL that answered, RSS MiB (containers), GPU MiB."""
        ports = sorted({lis.port for lis in self.listeners if set(lis.pids) & set(pids)})
        rss = sum(c.rss_mib for c in self.containers if c.pids and set(c.pids) <= set(pids))
        gpu = sum(a.used_mib or 0 for a in self.gpu_apps if a.pid in pids)
        return ports, next((self.health[p] for p in ports if p in self.health), ""), round(rss, 1), gpu


@dataclass(frozen=True)
class Target:
    """One thing the plan stops, with the command that stops it and the one that brings it back."""

    node: str
    kind: str  # container | unit | process
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

    def holds(self) -> str:
        """What restore checks it gets back: ports (and the health URL that answered), memory."""
        parts = [f"ports {', '.join(map(str, self.ports))}" if self.ports else "no listening port",
                 self.health_url or "no health URL answered", f"{self.memory_mib:.0f} MiB"]
        return "; ".join(parts + ([f"GPU {self.gpu_mib} MiB"] if self.gpu_mib else []))


@dataclass(frozen=True)
class Plan:
    targets: list[Target]
    warnings: list[str] = field(default_factory=list)

    def rows(self) -> list[dict[str, object]]:
        return [{"step": i, "node": t.node, "kind": t.kind, "name": t.name, "matched": t.pattern,
                 "depends on": ", ".join(t.depends_on), "stop": t.stop,
                 "restore": t.restore or f"(none: {t.restore_note})", "holds": t.holds()}
                for i, t in enumerate(self.targets, 1)]


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


class CleanupError(SparkbookError):
    """A cleanup or restore step cannot be done; the message says which and why."""

    stage = "01-cleanup"


# --- inventory ---------------------------------------------------------------------------------
def _containers(node: Node) -> tuple[list[Container], str]:
    try:
        client = docker_client(node, timeout=PROBE_TIMEOUT_S)
        version = client.version()["Version"]
        rows = client.api.containers(all=True)
    except Exception as exc:  # no daemon is a fact about the node, not a failure of the inventory
        return [], unavailable(exc)
    out = []
    for r in rows:
        labels = r.get("Labels") or {}
        deps = [d.split(":")[0] for key in DEPENDS_LABELS for d in labels.get(key, "").split(",") if d]
        pids, rss = _top(client, r["Id"]) if r["State"] == "running" else ([], 0.0)
        out.append(Container(r["Names"][0].lstrip("/"), r["Id"][:12], r["Image"], r["State"], deps, pids, rss))
    return sorted(out, key=lambda c: c.name), f"Docker {version}"


def _top(client: object, container_id: str) -> tuple[list[int], float]:
    """A running container's processes (node PIDs) and their summed RSS in MiB; none when it just exited."""
    try:
        top = client.api.top(container_id, ps_args="-eo pid,rss")  # type: ignore[attr-defined]
    except Exception:  # it stopped between the listing and this call: it holds nothing
        return [], 0.0
    pid_col, rss_col = top["Titles"].index("PID"), top["Titles"].index("RSS")
    rows = top.get("Processes") or []
    return [int(r[pid_col]) for r in rows], round(sum(int(r[rss_col]) for r in rows) / 1024, 1)


INVENTORY = r"""
echo ==meminfo==; cat /proc/meminfo
echo ==gpumem==; nvidia-smi --query-gpu=memory.total,memory.used --format=csv,noheader,nounits 2>/dev/null
apps=$(nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv,noheader,nounits 2>&1); rc=$?
echo ==gpuapps_rc==; echo $rc; echo ==gpuapps==; echo "$apps"
units=$(systemctl list-units --type=service --all --no-legend --plain --no-pager 2>&1); rc=$?
echo ==units_rc==; echo $rc; echo ==units==; echo "$units"
echo ==ps==; ps -eo pid=,comm=,args=
echo ==listen==; ss -Hltnp 2>/dev/null
echo ==portrange==; cat /proc/sys/net/ipv4/ip_local_port_range
echo ==end==
"""
HEALTH_PROBE = ("for u in \"$@\"; do "
                "(echo \"$u $(curl -s --noproxy '*' -o /dev/null -m 3 -w '%{http_code}' \"$u\")\") & done; wait")


def listeners(lines: list[str], below: int = 1 << 16) -> list[Listener]:
    """`ss -Hltnp` lines -> listening sockets on ports `below` a bound, with the PIDs holding them."""
    out = []
    for line in lines:
        cols = line.split()
        if len(cols) < 4 or not cols[3].rpartition(":")[2].isdigit() or int(cols[3].rpartition(":")[2]) >= below:
            continue
        address, _, port = cols[3].rpartition(":")
        out.append(Listener(address.split("%")[0], int(port), [int(p) for p in re.findall(r"pid=(\d+)", line)]))
    return out


def answering(urls: list[str], lines: list[str]) -> dict[str, bool]:
    """HEALTH_PROBE output -> url: answered 200."""
    codes = dict(line.rsplit(" ", 1) for line in lines if " " in line)
    return {u: codes.get(u) == "200" for u in urls}


def probe_health(node: Node, urls: list[str]) -> dict[str, bool]:
    """Ask each URL from the node itself (curl): the address it listens on may be reachable only there."""
    if not urls:
        return {}
    res = node.run(["sh", "-c", HEALTH_PROBE, "sh", *urls], timeout=PROBE_TIMEOUT_S + 4 * len(urls))
    return answering(urls, res.stdout.splitlines())


def health_urls(node: Node, socks: list[Listener]) -> dict[int, str]:
    """port -> http://ADDR:PORT/health for each of these sockets that answers 200 on the node."""
    urls = {f"http://{s.url_host}:{s.port}{HEALTH_PATH}": s.port for s in socks}
    return {urls[u]: u for u, ok in probe_health(node, sorted(urls)).items() if ok}


def _units(node: Node, rc: int, lines: list[str], patterns: list[str]) -> tuple[list[Unit], str]:
    """`systemctl list-units` as the inventory probe saw it; RequiredBy is asked only for matching units."""
    if rc != 0:
        text = "\n".join(lines).strip()
        if rc == 127 or any(s in text for s in NO_SYSTEMD):
            return [], f"no systemd on this node ({text.splitlines()[0] if text else 'systemctl missing'})"
        return [], f"systemctl failed: {text[-200:]}"
    units = []
    for line in lines:
        name, _, active, *_ = line.split() + ["", "", ""]
        requires: list[str] = []
        if _matching(name, patterns):
            show = node.run(["systemctl", "show", "-p", "RequiredBy", "--value", name], timeout=PROBE_TIMEOUT_S)
            requires = show.stdout.split()
        units.append(Unit(name, active, requires))
    return units, "systemd"


def _processes(lines: list[str], patterns: list[str]) -> list[Process]:
    out = []
    for line in lines if patterns else []:
        pid, comm, args = (line.split(None, 2) + ["", ""])[:3]
        if _matching(comm, patterns) or _matching(args, patterns):
            out.append(Process(int(pid), comm, args))
    return out


def _ephemeral_from(lines: list[str]) -> int:
    """The start of the node's ephemeral port range: ports from there on are assigned at random (a server's
    internal sockets), never a service's own port, so they are neither recorded nor asked for health."""
    first = lines[0].split() if lines else []
    return int(first[0]) if first and first[0].isdigit() else 32768


def inventory(node: Node, targets: CleanupTargets) -> Inventory:
    """Containers, systemd units, processes, GPU compute apps and memory of one node: one probe command
    (an unreachable node fails there, once) plus the node's Docker daemon over the same SSH connection."""
    s = sections(node.run(shell(INVENTORY), timeout=PROBE_TIMEOUT_S, check=True).stdout, node.name, "inventory",
                 ("meminfo", "gpuapps_rc", "units_rc"))
    memory = memory_from(meminfo(s["meminfo"]), s.get("gpumem", []))
    gpu, apps = gpu_apps(int(s["gpuapps_rc"][0]), s.get("gpuapps", []))
    units, systemd = _units(node, int(s["units_rc"][0]), s.get("units", []), targets.systemd_units)
    containers, docker = _containers(node)
    processes = _processes(s.get("ps", []), targets.processes)
    socks = listeners(s.get("listen", []), _ephemeral_from(s.get("portrange", [])))
    ours = {pid for c in containers if _matching(c.name, targets.containers) for pid in c.pids}
    ours |= {p.pid for p in processes}
    return Inventory(node.name, containers, docker, units, systemd, processes, gpu, apps, memory, socks,
                     health_urls(node, [lis for lis in socks if set(lis.pids) & ours]))


def inventory_all(cluster: Cluster, targets: CleanupTargets) -> dict[str, Outcome[Inventory]]:
    return cluster.fan_out(lambda n: inventory(n, targets), timeout=FANOUT_TIMEOUT_S)


def inventory_rows(inv: Inventory, targets: CleanupTargets) -> list[dict[str, object]]:
    """One table per node: everything found, and whether the allow-lists match it."""
    rows: list[dict[str, object]] = [
        {"kind": "container", "name": c.name, "state": c.state, "detail": c.image,
         "allow-listed": bool(_matching(c.name, targets.containers))} for c in inv.containers]
    rows += [{"kind": "unit", "name": u.name, "state": u.active, "detail": "",
              "allow-listed": bool(_matching(u.name, targets.systemd_units))} for u in inv.units
             if _matching(u.name, targets.systemd_units) or u.active == "active"]
    rows += [{"kind": "process", "name": p.comm, "state": f"pid {p.pid}", "detail": p.args[:80],
              "allow-listed": True} for p in inv.processes]
    rows += [{"kind": "gpu app", "name": a.name, "state": f"pid {a.pid}", "detail": f"{a.used_mib} MiB",
              "allow-listed": False} for a in inv.gpu_apps]
    rows += [{"kind": "fact", "name": k, "state": "", "detail": v, "allow-listed": False}
             for k, v in (("docker", inv.docker), ("systemd", inv.systemd), ("gpu", inv.gpu))]
    rows.append({"kind": "memory", "name": inv.memory.source, "state": "", "detail": inv.memory.describe(),
                 "allow-listed": False})
    return rows


# --- plan ----------------------------------------------------------------------------------------
def _matching(name: str, patterns: list[str]) -> str | None:
    return next((p for p in patterns if fnmatch.fnmatchcase(name, p)), None)


def _candidates(inv: Inventory, t: CleanupTargets) -> list[Target]:
    out = []
    for c in inv.containers:
        if c.state in ("running", "restarting", "paused") and (p := _matching(c.name, t.containers)):
            out.append(Target(inv.node, "container", c.name, p, c.depends_on, f"docker stop {c.name}",
                              f"docker start {c.name}", "", *inv.held_by(c.pids)))
    for u in inv.units:
        if u.active == "active" and (p := _matching(u.name, t.systemd_units)):
            out.append(Target(inv.node, "unit", u.name, p, [], f"systemctl stop {u.name}",
                              f"systemctl start {u.name}"))
    for pr in inv.processes:
        p = _matching(pr.comm, t.processes) or _matching(pr.args, t.processes) or "?"
        out.append(Target(inv.node, "process", f"{pr.comm}[{pr.pid}]", p, [], f"kill -TERM {pr.pid}", None,
                          f"started as `{pr.args[:120]}` by an unknown supervisor: restart it by hand",
                          *inv.held_by([pr.pid])))
    return out


def _unit_dependents(invs: list[Inventory]) -> dict[tuple[str, str], list[str]]:
    """(node, unit) -> the units that Require it (they are stopped first)."""
    return {(i.node, u.name): u.requires for i in invs for u in i.units if u.requires}


def plan(inventories: list[Inventory], targets: CleanupTargets) -> Plan:
    """Running allow-listed targets; `order` patterns first, then dependents before their dependencies."""
    found = [c for inv in inventories for c in _candidates(inv, targets)]
    deps = {(c.node, c.name): set(c.depends_on) for c in found}
    for (node, unit), by in _unit_dependents(inventories).items():
        for dependent in by:
            deps.setdefault((node, dependent), set()).add(unit)

    def rank(c: Target) -> int:
        return next((i for i, p in enumerate(targets.order) if fnmatch.fnmatchcase(c.name, p)), len(targets.order))

    ordered: list[Target] = []
    for r in sorted({rank(c) for c in found}):
        ordered += _dependents_first([c for c in found if rank(c) == r], deps)
    return Plan(ordered, _order_conflicts(ordered, deps))


def _dependents_first(group: list[Target], deps: dict[tuple[str, str], set[str]]) -> list[Target]:
    """Topological order where a target comes before everything it depends on (stable otherwise)."""
    left, out = list(group), []
    while left:
        needed = {d for c in left for d in deps.get((c.node, c.name), set())}
        ready = [c for c in left if c.name not in needed] or left[:1]  # a cycle: break it in list order
        out.append(ready[0])
        left.remove(ready[0])
    return out


def _order_conflicts(ordered: list[Target], deps: dict[tuple[str, str], set[str]]) -> list[str]:
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
                        "confirm_cleanup is true; every target is allow-listed and has its restore command recorded",
                        [Alternative("show the plan only", "the parameter confirms the stop")], evidence)
    why = "nothing allow-listed is running" if not p.targets else "confirm_cleanup is false"
    return Decision("Stop the old deployment now?", "show the plan only", why,
                    [Alternative("stop, in plan order", why)], evidence)


# --- act ------------------------------------------------------------------------------------------
def _stop_one(node: Node, t: Target) -> str:
    if t.kind == "container":
        docker_client(node, timeout=STOP_GRACE_S + PROBE_TIMEOUT_S).containers.get(t.name).stop(timeout=STOP_GRACE_S)
        return "stopped"
    if t.kind == "unit":
        return node.run(["systemctl", "stop", t.name], timeout=STOP_GRACE_S + PROBE_TIMEOUT_S, check=True).stdout
    pid = t.stop.split()[-1]
    node.run(shell("kill -TERM {pid}; for i in $(seq 1 {grace}); do kill -0 {pid} 2>/dev/null || exit 0; "
                   "sleep 1; done; echo still running; exit 1", pid=pid, grace=STOP_GRACE_S),
             timeout=STOP_GRACE_S + PROBE_TIMEOUT_S, check=True)
    return "exited"


def stop(cluster: Cluster, p: Plan) -> list[Action]:
    """Stop every target in plan order; a failure is recorded and the rest still run."""
    return [_act(cluster.nodes[t.node], t.name, t.stop, lambda n, t=t: _stop_one(n, t)) for t in p.targets]


def _act(node: Node, name: str, command: str, do: Callable[[Node], str]) -> Action:
    t0 = time.monotonic()
    try:
        return Action(node.name, name, command, True, do(node).strip()[-200:], round(time.monotonic() - t0, 2))
    except Exception as exc:  # reported per target, never hidden
        return Action(node.name, name, command, False, f"{type(exc).__name__}: {exc}"[-300:],
                      round(time.monotonic() - t0, 2))


# --- verify ---------------------------------------------------------------------------------------
def verify(p: Plan, before: list[Inventory], after: list[Inventory]) -> Verification:
    """Every target stopped, memory before/after per node, and nothing outside the plan changed state."""
    b, a = {i.node: i for i in before}, {i.node: i for i in after}
    planned = {(t.node, t.name) for t in p.targets}
    stopped = [{"node": t.node, "name": t.name, "stopped": not _running(a[t.node], t)} for t in p.targets
               if t.node in a]
    changes, elsewhere = [], []
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


def _running(inv: Inventory, t: Target) -> bool:
    if t.kind == "container":
        return any(c.name == t.name and c.state == "running" for c in inv.containers)
    if t.kind == "unit":
        return any(u.name == t.name and u.active == "active" for u in inv.units)
    return any(f"{p.comm}[{p.pid}]" == t.name for p in inv.processes)


# --- restore --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Step:
    """One step of the restore plan: the target, the command that brings it back, what it held before cleanup."""

    node: str
    kind: str
    name: str
    restore: str | None
    note: str = ""
    ports: list[int] = field(default_factory=list)
    health_url: str = ""
    memory_mib: float = 0.0
    gpu_mib: int = 0


@dataclass(frozen=True)
class Conflict:
    """Something that stands in the way of a restore step, and the command that clears it."""

    node: str
    target: str
    what: str
    clear: str
    ours: bool  # held by what this run started: `--stop-new` clears it

    def line(self) -> str:
        return f"{self.node}: {self.target}: {self.what} (clear it: {self.clear})"


@dataclass(frozen=True)
class Seen:
    """A restored target as observed on its node."""

    state: str
    running: bool
    health: bool | None  # None: no health check recorded for it
    health_detail: str
    memory_mib: float
    log_tail: str = ""


@dataclass(frozen=True)
class Check:
    """The verdict on one restored target."""

    node: str
    name: str
    ok: bool
    state: str
    health: str
    memory: str
    problems: list[str]
    log_tail: str


@dataclass(frozen=True)
class RestoreOutcome:
    """What `sparkbook restore` did: refused (conflicts), or stopped the new deployment, restored and checked."""

    result: str  # refused | nothing to restore | restored | failed
    conflicts: list[Conflict] = field(default_factory=list)
    stopped_new: list[Action] = field(default_factory=list)
    actions: list[Action] = field(default_factory=list)
    checks: list[Check] = field(default_factory=list)
    memory: list[dict[str, object]] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.result in ("restored", "nothing to restore")


class RestoreRefused(CleanupError):
    """Something stands in the way of the restore; nothing was restored."""

    stage = "restore"


def write_restore_plan(run_dir: Path, params_file: Path, p: Plan, actions: list[Action]) -> Path:
    """The commands that bring back what was stopped, in reverse order, with what each target held (ports,
    health URL, memory), as JSON beside a readable script."""
    done = {(a.node, a.name) for a in actions if a.ok}
    steps = [Step(t.node, t.kind, t.name, t.restore, t.restore_note, t.ports, t.health_url, t.memory_mib, t.gpu_mib)
             for t in reversed(p.targets) if (t.node, t.name) in done]
    path = run_dir / RESTORE_FILE
    path.write_text(json.dumps({"params_file": str(params_file), "steps": [asdict(s) for s in steps]}, indent=2))
    script = ["#!/bin/sh", "# Brings back what 01-cleanup stopped (reverse order). Or: sparkbook restore RUN_DIR",
              "set -e"]
    script += [f"ssh {s.node} {s.restore}" if s.restore else f"# {s.node} {s.name}: {s.note}" for s in steps]
    (run_dir / "restore.sh").write_text("\n".join(script) + "\n")
    return path


def restore_steps(plan_file: Path) -> list[Step]:
    return [Step(**s) for s in json.loads(plan_file.read_text())["steps"]]


def outcome(actions: list[Action], restore_plan: Path) -> CleanupOutcome:
    """What 01 leaves in the run state: the stops that succeeded and where their restore plan is."""
    return CleanupOutcome(stopped=[a for a in actions if a.ok], restore_plan=str(restore_plan))


def started_by_run(run: Run) -> dict[str, tuple[str, str]]:
    """node -> (container name, ID) of the node containers this run started (04 recorded them); {} if none."""
    try:
        ray = run.recall(RayCluster)
    except MissingState:
        return {}
    return {node: (name, ray.container_ids.get(node, "")) for node, name in ray.containers.items()}


# pure: what stands in the way
def _target_running(inv: Inventory, s: Step) -> bool:
    if s.kind == "container":
        return any(c.name == s.name and c.state == "running" for c in inv.containers)
    return s.kind == "unit" and any(u.name == s.name and u.active == "active" for u in inv.units)


def _target_pids(inv: Inventory, s: Step) -> set[int]:
    return {pid for c in inv.containers if c.name == s.name for pid in c.pids}


def _ours(inv: Inventory, new: dict[str, tuple[str, str]]) -> list[Container]:
    name = new.get(inv.node, ("", ""))[0]
    return [c for c in inv.containers if c.name == name and c.state == "running"]


def conflicts(steps: list[Step], now: dict[str, Inventory], new: dict[str, tuple[str, str]],
              run_dir: Path) -> list[Conflict]:
    """Per target not running now: each process listening on a port it held, and per node, the memory
    (GPU memory where the GPU reports it) the targets held that is not available now. `new`: this run's
    node containers (`started_by_run`); what they hold is cleared by `--stop-new`."""
    stop_new = f"sparkbook restore {run_dir} --stop-new"
    out: list[Conflict] = []
    for s in steps:
        inv = now.get(s.node)
        if inv is None or _target_running(inv, s):
            continue
        own = _target_pids(inv, s)
        ours = {pid for c in _ours(inv, new) for pid in c.pids}
        held = {}  # port -> its holders (a port listened on by IPv4 and IPv6 sockets is one conflict)
        for lis in inv.listeners:
            if lis.port in s.ports and set(lis.pids) - own:
                held.setdefault(lis.port, set()).update(set(lis.pids) - own)
        for port, pids in held.items():
            holders = sorted(pids)
            is_ours = bool(set(holders) & ours)
            who = ", ".join(dict.fromkeys(inv.holder(pid) for pid in holders))
            out.append(Conflict(s.node, s.name, f"port {port} is held by {who}"
                                + (" (this run's node container)" if is_ours else ""),
                                stop_new if is_ours else _clear(s.node, inv, holders), is_ours))
    for node, inv in now.items():
        out += _memory_conflicts([s for s in steps if s.node == node and not _target_running(inv, s)], inv,
                                 _ours(inv, new), stop_new)
    return out


def _clear(node: str, inv: Inventory, pids: list[int]) -> str:
    names = sorted({c.name for c in inv.containers for pid in pids if pid in c.pids})
    return f"ssh {node} docker stop {' '.join(names)}" if names else f"ssh {node} kill {' '.join(map(str, pids))}"


def _memory_conflicts(steps: list[Step], inv: Inventory, ours: list[Container], stop_new: str) -> list[Conflict]:
    names = ", ".join(s.name for s in steps)
    held_by = f"; this run's {', '.join(c.name for c in ours)} holds {sum(c.rss_mib for c in ours):.0f} MiB" \
        if ours else ""
    clear = stop_new if ours else f"free memory on {inv.node}"
    out = []
    need = sum(s.memory_mib for s in steps)
    if need > inv.memory.mem_available / (1 << 20):
        out.append(Conflict(inv.node, names, f"they held {need:.0f} MiB, {inv.memory.mem_available >> 20} MiB is "
                                             f"available{held_by}", clear, bool(ours)))
    gpu_need = sum(s.gpu_mib for s in steps)
    if gpu_need and inv.memory.gpu_total is not None:
        free = (inv.memory.gpu_total - (inv.memory.gpu_used or 0)) >> 20
        if gpu_need > free:
            out.append(Conflict(inv.node, names, f"they held {gpu_need} MiB of GPU memory, {free} MiB is free",
                                clear, bool(ours)))
    return out


# pure: the verdict on a restored target
def judge(s: Step, seen: Seen) -> Check:
    """Running after the grace period, its health check answering where one was recorded, its memory back."""
    problems = []
    if s.restore is None:
        problems.append(f"no restore command: {s.note}")
    elif not seen.running:
        problems.append(f"not running ({seen.state})")
    if seen.health is False:
        problems.append(f"health check not answering: {seen.health_detail}")
    if s.memory_mib >= 1 and seen.memory_mib < MEMORY_BACK_SHARE * s.memory_mib:
        problems.append(f"holds {seen.memory_mib:.0f} MiB; it held {s.memory_mib:.0f} MiB before cleanup")
    health = {None: "(none recorded)", True: f"answers {seen.health_detail}",
              False: f"NOT answering {seen.health_detail}"}[seen.health]
    return Check(s.node, s.name, not problems, seen.state, health,
                 f"{seen.memory_mib:.0f} MiB (before cleanup: {s.memory_mib:.0f} MiB)", problems,
                 "" if not problems else seen.log_tail)


# acting
def _restore_one(node: Node, step: Step) -> str:
    if step.kind == "container":
        docker_client(node, timeout=PROBE_TIMEOUT_S).containers.get(step.name).start()
        return "started"
    if step.kind == "unit":
        return node.run(["systemctl", "start", step.name], timeout=PROBE_TIMEOUT_S * 3, check=True).stdout
    raise CleanupError(step.note or "no restore command is known", node=node.name)


def restore(cluster: Cluster, steps: list[Step]) -> list[Action]:
    """Run the restore plan written by `write_restore_plan`, step by step."""
    return [_act(cluster.nodes[s.node], s.name, s.restore or "-", lambda n, s=s: _restore_one(n, s)) for s in steps]


def _stop_container(node: Node, name: str, recorded_id: str) -> str:
    c = docker_client(node, timeout=STOP_GRACE_S + PROBE_TIMEOUT_S).containers.get(name)
    if not recorded_id or not c.id.startswith(recorded_id[:12]):
        raise CleanupError(f"{name} is now container {c.id[:12]}, not {recorded_id[:12] or '?'} that this run "
                           "started: not stopped", node=node.name)
    c.stop(timeout=STOP_GRACE_S)
    return f"stopped {c.id[:12]}"


def stop_new(cluster: Cluster, new: dict[str, tuple[str, str]]) -> list[Action]:
    """Stop exactly the node containers this run started, by name, checked against their recorded IDs."""
    return [_act(cluster.nodes[node], name, f"docker stop {name}", lambda n, c=(name, cid): _stop_container(n, *c))
            for node, (name, cid) in new.items() if node in cluster.nodes]


def observe(node: Node, s: Step) -> Seen:
    """A target's state, health (its recorded URL; else a listener on its ports), memory and log tail."""
    running, state, memory, log = _observe_container(node, s) if s.kind == "container" else _observe_unit(node, s)
    health: bool | None = None
    detail = ""
    if s.health_url:
        health, detail = probe_health(node, [s.health_url])[s.health_url], s.health_url
    elif s.ports:
        socks = listeners(node.run(["ss", "-Hltnp"], timeout=PROBE_TIMEOUT_S).stdout.splitlines())
        missing = sorted(set(s.ports) - {lis.port for lis in socks})
        health, detail = not missing, f"ports {s.ports} listening" + (f" (not: {missing})" if missing else "")
    return Seen(state, running, health, detail, memory, log)


def _observe_container(node: Node, s: Step) -> tuple[bool, str, float, str]:
    client = docker_client(node, timeout=PROBE_TIMEOUT_S)
    try:
        c = client.containers.get(s.name)
    except Exception as exc:  # gone: that is the observation
        return False, f"gone ({type(exc).__name__})", 0.0, ""
    state = c.attrs["State"]
    rss = _top(client, c.id)[1] if c.status == "running" else 0.0
    text = c.logs(tail=LOG_TAIL_LINES).decode(errors="replace")
    described = c.status if c.status == "running" else f"{c.status} (exit {state.get('ExitCode')})"
    return c.status == "running", described, rss, tail(text, LOG_TAIL_LINES)


def _observe_unit(node: Node, s: Step) -> tuple[bool, str, float, str]:
    if s.kind != "unit":
        return False, "not restorable", 0.0, ""
    active = node.run(["systemctl", "is-active", s.name], timeout=PROBE_TIMEOUT_S).stdout.strip()
    mem = node.run(["systemctl", "show", "-p", "MemoryCurrent", "--value", s.name], timeout=PROBE_TIMEOUT_S)
    log = node.run(["journalctl", "-u", s.name, "-n", str(LOG_TAIL_LINES), "--no-pager"], timeout=PROBE_TIMEOUT_S)
    rss = int(mem.stdout.strip()) / (1 << 20) if mem.stdout.strip().isdigit() else 0.0
    return active == "active", active, round(rss, 1), tail(log.stdout, LOG_TAIL_LINES)


def verify_restore(cluster: Cluster, steps: list[Step], ready_timeout_s: float = READY_TIMEOUT_S,
                   grace_s: float = GRACE_S) -> list[Check]:
    """Wait until each target answers (or has exited), then a grace period, then judge each one."""
    pending = [s for s in steps if s.restore]
    deadline = time.monotonic() + ready_timeout_s
    while pending and time.monotonic() < deadline:
        seen = {(s.node, s.name): observe(cluster.nodes[s.node], s) for s in pending}
        pending = [s for s in pending if seen[(s.node, s.name)].running and seen[(s.node, s.name)].health is False]
        if pending:
            time.sleep(2)
    time.sleep(grace_s)
    return [judge(s, observe(cluster.nodes[s.node], s)) for s in steps]


def rollback(run: Run, steps: list[Step], targets: CleanupTargets, stop_first: bool) -> RestoreOutcome:
    """`sparkbook restore`: refuse while something stands in the way (unless `stop_first`: stop this run's node
    containers first), restore in plan order, verify each target; every step is recorded in the run dir."""
    if not steps:
        return _done(run, RestoreOutcome("nothing to restore"))
    new = started_by_run(run)
    now = _inventories(run.cluster, targets)
    found = conflicts(steps, now, new, run.run_dir)
    run.record("restore_conflicts", found)
    if found and not stop_first:
        return _done(run, RestoreOutcome("refused", found))
    stopped: list[Action] = []
    if stop_first:
        stopped = stop_new(run.cluster, new)
        run.record("restore_stop_new", stopped)
        now = _inventories(run.cluster, targets)
        found = conflicts(steps, now, new, run.run_dir)
        run.record("restore_conflicts", found)
        if found or not all(a.ok for a in stopped):
            return _done(run, RestoreOutcome("refused", found, stopped))
    actions = restore(run.cluster, steps)
    run.record("restore", actions)
    checks = verify_restore(run.cluster, steps)
    after = _inventories(run.cluster, targets)
    memory = [{"node": n, **now[n].memory.delta(after[n].memory)} for n in now if n in after]
    ok = all(a.ok for a in actions) and all(c.ok for c in checks)
    return _done(run, RestoreOutcome("restored" if ok else "failed", [], stopped, actions, checks, memory))


def _inventories(cluster: Cluster, targets: CleanupTargets) -> dict[str, Inventory]:
    """Every node's inventory now; a node that cannot be seen refuses the restore (its conflicts are unknown)."""
    def unseen(errors: str) -> CleanupError:
        return CleanupError(f"cannot see what stands in the way: {errors}",
                            remediation="make every node reachable, then run `sparkbook restore` again")
    return {inv.node: inv for inv in inventory_all(cluster, targets).values_or_raise(unseen)}


def _done(run: Run, out: RestoreOutcome) -> RestoreOutcome:
    run.record("restore_outcome", out)
    return out
