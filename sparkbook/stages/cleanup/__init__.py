"""01: inventory what the old deployment holds, plan its stop (dependents first; what a unit or managed process
owns under its owner: ownership.py), write the restore plan, act, verify (`restore` brings it back:
`sparkbook restore`)."""
from __future__ import annotations

import fnmatch
import json
import re
import shlex
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tenacity import Retrying, retry_if_result, stop_after_delay, wait_fixed

from ...core.docker_ssh import docker_client, unavailable
from ...core.errors import SparkbookError
from ...core.handoff import Action, CleanupOutcome
from ...core.hostfacts import FANOUT_TIMEOUT_S, GpuApp, Memory, gpu_apps, meminfo, memory_from, sections
from ...core.nodes import Cluster, Node, Outcome, shell
from ...core.params import CleanupTargets
from ...core.record import Alternative, Decision
from .ownership import SHOW_PROPERTIES, DockerClient, clients, family, parse_show, tree

DEPENDS_LABELS = ("org.sparkbook.lab.depends-on", "com.docker.compose.depends_on")
NO_SYSTEMD = ("not been booted with systemd", "Failed to connect to bus", "No such file or directory")
RESTORE_FILE = "restore-plan.json"
STOP_GRACE_S = 10
PROBE_TIMEOUT_S = 20
HEALTH_PATH = "/health"  # asked of each port a target listens on; the answering ones are its health URL


@dataclass(frozen=True)
class Container:
    name: str
    id: str
    image: str
    state: str
    depends_on: list[str]
    pids: list[int] = field(default_factory=list)  # of a running container, as the node sees them
    rss_mib: float = 0.0
    labels: dict[str, str] = field(default_factory=dict)


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
    pids: list[int] = field(default_factory=list)  # its cgroup's processes (what it owns), for allow-listed units
    stop_timeout_s: float | None = None  # systemd's TimeoutStopUSec
    exec_start: str = ""


@dataclass(frozen=True)
class Process:
    pid: int
    comm: str
    args: str
    family: list[int] = field(default_factory=list)  # it and its descendants (what it owns)
    cwd: str = ""  # with argv: how restore relaunches it
    argv: list[str] = field(default_factory=list)


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
    clients: list[DockerClient] = field(default_factory=list)  # docker run/start clients running on the node
    addresses: list[str] = field(default_factory=list)  # its hostname and IPs: how other nodes' clients name it

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
    owner: str = ""  # NODE/TARGET of the unit or managed process that owns this container (stopping it stops this)
    stop_timeout_s: float = STOP_GRACE_S
    match: str = ""  # a process's command line, as restore looks for it again

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
                 "owned by": t.owner, "depends on": ", ".join(t.depends_on), "stop": t.stop,
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
        pids, rss = container_top(client, r["Id"]) if r["State"] == "running" else ([], 0.0)
        out.append(Container(r["Names"][0].lstrip("/"), r["Id"][:12], r["Image"], r["State"], deps, pids, rss,
                             labels))
    return sorted(out, key=lambda c: c.name), f"Docker {version}"


def container_top(client: object, container_id: str) -> tuple[list[int], float]:
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
echo ==tree==; ps -eo pid=,ppid=,args=
echo ==addr==; hostname; hostname -I 2>/dev/null | tr ' ' '\n'
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


UNIT_PROBE = ("systemctl show -p {props} -- {unit}; echo ==procs==; cg=$(systemctl show -p ControlGroup --value -- "
              "{unit}); for d in /sys/fs/cgroup$cg /sys/fs/cgroup/systemd$cg; do "
              "[ -n \"$cg\" ] && [ -d \"$d\" ] && find \"$d\" -name cgroup.procs -exec cat {{}} + && break; done; true")


def _unit(node: Node, name: str, active: str) -> Unit:
    """An allow-listed unit: what Requires it, its stop timeout, and the processes of its cgroup."""
    text = node.run(shell(UNIT_PROBE, props=SHOW_PROPERTIES, unit=name), timeout=PROBE_TIMEOUT_S).stdout
    show_text, _, procs = text.partition("==procs==")
    show = parse_show(show_text)
    pids = sorted({int(p) for p in procs.split() if p.isdigit()})
    return Unit(name, active, show.required_by, pids, show.stop_timeout_s, show.exec_start)


def _units(node: Node, rc: int, lines: list[str], patterns: list[str]) -> tuple[list[Unit], str]:
    """`systemctl list-units` as the inventory probe saw it; RequiredBy, stop timeout and cgroup processes are
    asked only of matching units."""
    if rc != 0:
        text = "\n".join(lines).strip()
        if rc == 127 or any(s in text for s in NO_SYSTEMD):
            return [], f"no systemd on this node ({text.splitlines()[0] if text else 'systemctl missing'})"
        return [], f"systemctl failed: {text[-200:]}"
    units = []
    for line in lines:
        name, _, active, *_ = line.split() + ["", "", ""]
        units.append(_unit(node, name, active) if _matching(name, patterns) else Unit(name, active, []))
    return units, "systemd"


LAUNCH_PROBE = ("for p in \"$@\"; do echo \"==$p==\"; readlink /proc/$p/cwd; "
                "tr '\\0' '\\037' < /proc/$p/cmdline; echo; done")


def _processes(node: Node, lines: list[str], procs: dict[int, tuple[int, str]], patterns: list[str]) -> list[Process]:
    """Processes whose name or command line matches; each with its descendants and how it was launched (working
    directory and exact argv from /proc, so restore can launch it again)."""
    found = []
    for line in lines if patterns else []:
        pid, comm, args = (line.split(None, 2) + ["", ""])[:3]
        if _matching(comm, patterns) or _matching(args, patterns):
            found.append((int(pid), comm, args))
    if not found:
        return []
    text = node.run(["sh", "-c", LAUNCH_PROBE, "sh", *[str(p) for p, _, _ in found]], timeout=PROBE_TIMEOUT_S).stdout
    launch = {int(k): v for k, v in zip(re.findall(r"^==(\d+)==$", text, re.M), re.split(r"^==\d+==$", text,
                                                                                     flags=re.M)[1:])}
    out = []
    for pid, comm, args in found:
        cwd, _, cmdline = launch.get(pid, "").strip("\n").partition("\n")
        out.append(Process(pid, comm, args, family(pid, procs), cwd, [a for a in cmdline.split("\x1f") if a]))
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
    procs = tree(s.get("tree", []))
    processes = _processes(node, s.get("ps", []), procs, targets.processes)
    socks = listeners(s.get("listen", []), _ephemeral_from(s.get("portrange", [])))
    ours = {pid for c in containers if _matching(c.name, targets.containers) for pid in c.pids}
    ours |= {p.pid for p in processes} | {pid for u in units for pid in u.pids}
    return Inventory(node.name, containers, docker, units, systemd, processes, gpu, apps, memory, socks,
                     health_urls(node, [lis for lis in socks if set(lis.pids) & ours]), clients(procs),
                     [a for a in s.get("addr", []) if a])


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


LIVE = ("running", "restarting", "paused")


def relaunch(pr: Process) -> str | None:
    """The command that launches a stopped process again: its exact argv, from its working directory, detached
    (its environment is not recorded: it may hold secrets). None when /proc did not show how it was launched."""
    if not pr.argv:
        return None
    return f"cd {shlex.quote(pr.cwd or '/')} && {{ setsid {shlex.join(pr.argv)} </dev/null >/dev/null 2>&1 & }}"


def _candidates(inv: Inventory, t: CleanupTargets) -> list[Target]:
    out = []
    for c in inv.containers:
        if c.state in LIVE and (p := _matching(c.name, t.containers)):
            out.append(Target(inv.node, "container", c.name, p, c.depends_on, f"docker stop {c.name}",
                              f"docker start {c.name}", "", *inv.held_by(c.pids)))
    for u in inv.units:
        if u.active == "active" and (p := _matching(u.name, t.systemd_units)):
            out.append(Target(inv.node, "unit", u.name, p, [], f"systemctl stop {u.name}",
                              f"systemctl start {u.name}", "", *inv.held_by(u.pids),
                              stop_timeout_s=max(t.unit_stop_timeout_s, u.stop_timeout_s or 0)))
    for pr in inv.processes:
        p = _matching(pr.comm, t.processes) or _matching(pr.args, t.processes) or "?"
        out.append(Target(inv.node, "process", f"{pr.comm}[{pr.pid}]", p, [], f"kill -TERM {pr.pid}", relaunch(pr),
                          "relaunched from its recorded argv and working directory (not its environment)"
                          if pr.argv else f"started as `{pr.args[:120]}`; /proc did not show how: restart it by hand",
                          *inv.held_by(pr.family or [pr.pid]), stop_timeout_s=t.unit_stop_timeout_s, match=pr.args))
    return out


def _owner_pids(inv: Inventory, t: CleanupTargets) -> list[tuple[str, set[int], str]]:
    """(target name, the processes it owns, the unit name a container label may carry) per allow-listed owner."""
    out = [(u.name, set(u.pids), u.name) for u in inv.units
           if u.active == "active" and _matching(u.name, t.systemd_units)]
    return out + [(f"{pr.comm}[{pr.pid}]", set(pr.family or [pr.pid]), "") for pr in inv.processes]


def _daemon_node(address: str, inv: Inventory, inventories: list[Inventory]) -> Inventory | None:
    """The inventory of the node a docker client talks to ("" = its own node); None: not a node of this cluster."""
    if not address:
        return inv
    return next((i for i in inventories if address in i.addresses or address == i.node), None)


def owned(inv: Inventory, inventories: list[Inventory], t: CleanupTargets) -> list[Target]:
    """The live containers (on any node) that each allow-listed unit or managed process of this node owns: its
    docker run/start clients name them, or (a unit) their labels name the unit. Stopping the owner stops them."""
    out: list[Target] = []
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
                out.append(Target(node.node, "container", c.name, f"owned by {by}", [], f"stops with {by}", None,
                                  f"comes back with {by}", *node.held_by(c.pids), owner=by, stop_timeout_s=timeout))
    return out


def _unit_dependents(invs: list[Inventory]) -> dict[tuple[str, str], list[str]]:
    """(node, unit) -> the units that Require it (they are stopped first)."""
    return {(i.node, u.name): u.requires for i in invs for u in i.units if u.requires}


def plan(inventories: list[Inventory], targets: CleanupTargets) -> Plan:
    """Running allow-listed targets; `order` patterns first, then dependents before their dependencies; each
    container a unit or managed process owns right after its owner (it stops with it, not on its own)."""
    by_owner = [o for inv in inventories for o in owned(inv, inventories, targets)]
    taken = {(o.node, o.name) for o in by_owner}
    found = [c for inv in inventories for c in _candidates(inv, targets) if (c.node, c.name) not in taken]
    deps = {(c.node, c.name): set(c.depends_on) for c in found}
    for (node, unit), by in _unit_dependents(inventories).items():
        for dependent in by:
            deps.setdefault((node, dependent), set()).add(unit)

    def rank(c: Target) -> int:
        return next((i for i, p in enumerate(targets.order) if fnmatch.fnmatchcase(c.name, p)), len(targets.order))

    ordered: list[Target] = []
    for r in sorted({rank(c) for c in found}):
        ordered += _dependents_first([c for c in found if rank(c) == r], deps)
    return Plan(_under_owners(ordered, by_owner), _order_conflicts(ordered, deps))


def _under_owners(ordered: list[Target], by_owner: list[Target]) -> list[Target]:
    return [x for t in ordered for x in [t, *[o for o in by_owner if o.owner == f"{t.node}/{t.name}"]]]


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
                        "confirm_cleanup is true; every target is allow-listed or owned by an allow-listed unit or "
                        "process, and the restore plan is written before the first stop",
                        [Alternative("show the plan only", "the parameter confirms the stop")], evidence)
    why = "nothing allow-listed is running" if not p.targets else "confirm_cleanup is false"
    return Decision("Stop the old deployment now?", "show the plan only", why,
                    [Alternative("stop, in plan order", why)], evidence)


# --- act ------------------------------------------------------------------------------------------
def _stop_one(node: Node, t: Target) -> str:
    if t.kind == "container" and t.owner:
        return _gone_with_owner(node, t)
    if t.kind == "container":
        docker_client(node, timeout=STOP_GRACE_S + PROBE_TIMEOUT_S).containers.get(t.name).stop(timeout=STOP_GRACE_S)
        return "stopped"
    if t.kind == "unit":
        return node.run(["systemctl", "stop", t.name], timeout=t.stop_timeout_s + PROBE_TIMEOUT_S, check=True).stdout
    pid = t.stop.split()[-1]
    node.run(shell("kill -TERM {pid}; for i in $(seq 1 {grace}); do kill -0 {pid} 2>/dev/null || exit 0; "
                   "sleep 1; done; echo still running; exit 1", pid=pid, grace=int(t.stop_timeout_s)),
             timeout=t.stop_timeout_s + PROBE_TIMEOUT_S, check=True)
    return "exited"


def _gone_with_owner(node: Node, t: Target) -> str:
    """An owned container: its owner stopped it (a `--rm` one is removed); wait for that, up to the owner's
    stop timeout."""
    client = docker_client(node, timeout=PROBE_TIMEOUT_S)

    def live() -> bool:
        return any(c.name == t.name for c in client.containers.list(filters={"name": f"^{t.name}$"}))

    if Retrying(stop=stop_after_delay(t.stop_timeout_s), wait=wait_fixed(1), retry=retry_if_result(bool),
                retry_error_callback=lambda state: state.outcome.result())(live):
        raise CleanupError(f"{t.name} still runs {t.stop_timeout_s:.0f} s after {t.owner} stopped",
                           node=node.name, remediation=f"stop it by hand: docker stop {t.name}")
    return f"gone with {t.owner}"


def stop(cluster: Cluster, p: Plan) -> list[Action]:
    """Stop every target in plan order; a failure is recorded and the rest still run."""
    return [act(cluster.nodes[t.node], t.name, t.stop, lambda n, t=t: _stop_one(n, t)) for t in p.targets]


def act(node: Node, name: str, command: str, do: Callable[[Node], str]) -> Action:
    """`do` on the node as one recorded Action (stop or restore): how it went and how long it took."""
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
    owner: str = ""  # an owned container comes back with its owner: no command of its own, checked after it
    ssh: str = ""  # how restore.sh reaches the node: ssh with its SSH address, user and port
    match: str = ""  # a process's command line, to find it again


def ssh_command(node: Node) -> str:
    """`ssh` with the node's SSH address (params' host as the ssh config resolves it), user, port, keys,
    known_hosts and jump host: a node's name is not an address anything resolves. A local node: `sh -c`."""
    if node.local:
        return "sh -c"
    t = node.target  # type: ignore[attr-defined]
    opts = [x for k in t.key_files for x in ("-i", k)]
    opts += ["-o", f"UserKnownHostsFile={t.known_hosts}"] if t.known_hosts else []
    opts += ["-J", f"{t.jump.user}@{t.jump.hostname}:{t.jump.port}"] if t.jump else []
    return shlex.join(["ssh", *opts, "-p", str(t.port), f"{t.user}@{t.hostname}"])


def restore_order(targets: list[Target]) -> list[Target]:
    """Reverse plan order, each owned container after its owner (the owner brings it back)."""
    back = [t for t in reversed(targets) if not t.owner]
    return [x for t in back for x in [t, *[o for o in targets if o.owner == f"{t.node}/{t.name}"]]]


def write_restore_plan(run_dir: Path, params_file: Path, p: Plan, cluster: Cluster) -> Path:
    """Before acting: a restore step for every planned target (a stop that fails or times out may still have
    stopped it), in reverse order, with what each held (ports, health URL, memory), as JSON beside a readable
    script that reaches each node by its SSH address."""
    steps = [Step(t.node, t.kind, t.name, t.restore, t.restore_note, t.ports, t.health_url, t.memory_mib, t.gpu_mib,
                  t.owner, ssh_command(cluster.nodes[t.node]), t.match) for t in restore_order(p.targets)]
    path = run_dir / RESTORE_FILE
    path.write_text(json.dumps({"params_file": str(params_file), "steps": [asdict(s) for s in steps]}, indent=2))
    script = ["#!/bin/sh", "# Brings back what 01-cleanup planned to stop (reverse order), by each node's SSH address.",
              "# Or: sparkbook restore RUN_DIR", "set -e"]
    script += [f"{s.ssh} {shlex.quote(s.restore)}" if s.restore else f"# {s.node} {s.name}: {s.note}"
               for s in steps]
    (run_dir / "restore.sh").write_text("\n".join(script) + "\n")
    return path


def outcome(actions: list[Action], restore_plan: Path) -> CleanupOutcome:
    """What 01 leaves in the run state: the stops that succeeded and where their restore plan is."""
    return CleanupOutcome(stopped=[a for a in actions if a.ok], restore_plan=str(restore_plan))
