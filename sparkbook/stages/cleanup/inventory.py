"""01's inventory: what each node runs (containers, systemd units, allow-listed processes, listeners with the
health URL that answers, GPU apps, memory), as one probe command plus the node's Docker daemon."""
from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass, field

from ...core.analysis.hostfacts import FANOUT_TIMEOUT_S, GpuApp, Memory, gpu_apps, meminfo, memory_from, sections
from ...core.cluster.context import Context
from ...core.cluster.docker_ssh import docker_client, unavailable
from ...core.cluster.nodes import Node, shell
from ...core.cluster.runtime_docker import LABEL
from ...core.values.fanout import Outcome
from ...core.values.handoff import OldDeployment
from ...core.values.params import CleanupTargets
from . import guard
from .guard import Proc, Spared
from .ownership import SHOW_PROPERTIES, DockerClientProcess, docker_clients, family, parse_show, tree

DEPENDS_LABELS = ("org.sparkbook.lab.depends-on", "com.docker.compose.depends_on")
NO_SYSTEMD = ("not been booted with systemd", "Failed to connect to bus", "No such file or directory")
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
    file_state: str = ""  # systemd's UnitFileState (enabled: it starts at boot)


@dataclass(frozen=True)
class Process:
    pid: int
    comm: str
    args: str
    family: list[int] = field(default_factory=list)  # it and its descendants (what it owns)
    cwd: str = ""  # with argv and its user: how restore relaunches it
    argv: list[str] = field(default_factory=list)
    user: tuple[int, int, list[int]] | None = None  # its real uid, gid and groups (/proc/PID/status); None: unread


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
    clients: list[DockerClientProcess] = field(default_factory=list)  # docker run/start clients running on the node
    addresses: list[str] = field(default_factory=list)  # its hostname and IPs: how other nodes' clients name it
    spared: list[Spared] = field(default_factory=list)  # matched by a pattern, never planned (guard.py)
    commands: dict[int, str] = field(default_factory=dict)  # every process's command line, allow-listed or not
    session_uid: int | None = None  # the SSH user's uid: what a relaunch runs as unless it drops to another

    def holder(self, pid: int) -> str:
        """The container a process belongs to, else the process itself."""
        return next((f"container {c.name}" for c in self.containers if pid in c.pids),
                    next((f"process {p.comm}[{pid}]" for p in self.processes if p.pid == pid), f"pid {pid}"))

    def spared_units(self) -> set[str]:
        return {s.name for s in self.spared if s.kind == "unit"}

    def held_by(self, pids: list[int]) -> tuple[list[int], str, float, int]:
        """What these processes hold: ports, the first health URL that answered, RSS MiB (containers), GPU MiB."""
        ports = sorted({lis.port for lis in self.listeners if set(lis.pids) & set(pids)})
        rss = sum(c.rss_mib for c in self.containers if c.pids and set(c.pids) <= set(pids))
        gpu = sum(a.used_mib or 0 for a in self.gpu_apps if a.pid in pids)
        return ports, next((self.health[p] for p in ports if p in self.health), ""), round(rss, 1), gpu


def old_deployment(inventories: list[Inventory]) -> OldDeployment:
    """The images of every running container the inventories found, sparkbook's own left out (its label): what the
    old deployment runs, for 02 and 03 where params name no installed image."""
    where: dict[str, list[str]] = {}
    for inv in inventories:
        for c in inv.containers:
            if c.state == "running" and LABEL not in c.labels:
                where.setdefault(c.image, []).append(f"{inv.node}/{c.name}")
    return OldDeployment(images=dict(sorted(where.items(), key=lambda kv: -len(kv[1]))))


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


def vanished(exc: Exception) -> bool:
    """docker-py's answer about a container that went away meanwhile (not found, or 409: dead or marked for
    removal, as a manager's `--rm` containers are): the container is gone, which is an observation, not a failure."""
    import docker.errors

    return isinstance(exc, docker.errors.NotFound) or (
        isinstance(exc, docker.errors.APIError) and exc.status_code == 409)


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
echo ==self==; echo $$
echo ==uid==; id -u
echo ==host==; cat /proc/sys/kernel/random/boot_id 2>/dev/null; readlink /proc/self/ns/pid 2>/dev/null
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
    return Unit(name, active, show.required_by, pids, show.stop_timeout_s, show.exec_start, show.file_state)


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
        units.append(_unit(node, name, active) if matching(name, patterns) else Unit(name, active, []))
    return units, "systemd"


LAUNCH_PROBE = ("for p in \"$@\"; do echo \"==$p==\"; readlink /proc/$p/cwd; "
                "tr '\\0' '\\037' < /proc/$p/cmdline; echo; "
                "awk '/^Uid:/{u=$2} /^Gid:/{g=$2} /^Groups:/{$1=\"\"; s=$0} END{print u, g, s}' /proc/$p/status; done")


def matched_processes(table: dict[int, Proc], patterns: list[str], never: dict[int, str]) -> tuple[list[Proc],
                                                                                                list[Spared]]:
    """The processes whose name or command line a pattern matches, and those of them that are never stopped
    (`never`: pid -> why, from guard.spared)."""
    found, kept = [], []
    for p in table.values():
        if pattern := matching(p.comm, patterns) or matching(p.args, patterns):
            if p.pid in never:
                kept.append(Spared("process", f"{p.comm}[{p.pid}]", pattern, never[p.pid]))
            else:
                found.append(p)
    return found, kept


def spared_units(units: list[Unit], patterns: list[str], never: dict[int, str]) -> list[Spared]:
    """The matched units whose cgroup holds a process that is never stopped (sshd, the controller's session...)."""
    return [Spared("unit", u.name, pattern, next(never[pid] for pid in u.pids if pid in never)) for u in units
            if (pattern := matching(u.name, patterns)) and any(pid in never for pid in u.pids)]


def _processes(node: Node, matched: list[Proc], procs: dict[int, tuple[int, str]]) -> list[Process]:
    """Each matched process with its descendants and how it was launched (working directory and exact argv from
    /proc, so restore can launch it again)."""
    found = [(p.pid, p.comm, p.args) for p in matched]
    if not found:
        return []
    text = node.run(["sh", "-c", LAUNCH_PROBE, "sh", *[str(p) for p, _, _ in found]], timeout=PROBE_TIMEOUT_S).stdout
    markers, parts = re.findall(r"^==(\d+)==$", text, re.M), re.split(r"^==\d+==$", text, flags=re.M)[1:]
    launch = {int(k): v for k, v in zip(markers, parts, strict=False)}
    out = []
    for pid, comm, args in found:
        cwd, cmdline, ids = (launch.get(pid, "").strip("\n").split("\n") + ["", "", ""])[:3]
        out.append(Process(pid, comm, args, family(pid, procs), cwd, [a for a in cmdline.split("\x1f") if a],
                           _ids(ids)))
    return out


def _ids(line: str) -> tuple[int, int, list[int]] | None:
    """LAUNCH_PROBE's `UID GID GROUPS...` line -> its numbers; None where /proc did not say."""
    words = line.split()
    return (int(words[0]), int(words[1]), [int(g) for g in words[2:]]) if all(w.isdigit() for w in words) \
        and len(words) >= 2 else None


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
    rows = guard.table(s.get("ps", []), procs)
    never = guard.spared(rows, guard.roots(_number(s.get("self", [])), " ".join(s.get("host", []))))
    matched, kept = matched_processes(rows, targets.processes, never)
    processes = _processes(node, matched, procs)
    kept += spared_units(units, targets.systemd_units, never)
    socks = listeners(s.get("listen", []), _ephemeral_from(s.get("portrange", [])))
    ours = {pid for c in containers if matching(c.name, targets.containers) for pid in c.pids}
    ours |= {p.pid for p in processes} | {pid for u in units for pid in u.pids}
    return Inventory(node.name, containers, docker, units, systemd, processes, gpu, apps, memory, socks,
                     health_urls(node, [lis for lis in socks if set(lis.pids) & ours]), docker_clients(procs),
                     [a for a in s.get("addr", []) if a], kept, {p.pid: p.args for p in rows.values()},
                     _number(s.get("uid", [])))


def _number(lines: list[str]) -> int | None:
    """A probe section's number (the probe's shell `$$`, whose ancestry 01 never stops; the SSH user's uid); None
    where the node did not say."""
    return int(lines[0]) if lines and lines[0].isdigit() else None


def inventory_all(ctx: Context) -> dict[str, Outcome[Inventory]]:
    """Every node's inventory against params' cleanup allow-lists; an unreachable node is its own outcome."""
    return ctx.cluster.fan_out(lambda n: inventory(n, ctx.params.cleanup), timeout=FANOUT_TIMEOUT_S)


def inventory_rows(inv: Inventory, targets: CleanupTargets) -> list[dict[str, object]]:
    """One table per node: everything found, and whether the allow-lists match it."""
    rows: list[dict[str, object]] = [
        {"kind": "container", "name": c.name, "state": c.state, "detail": c.image,
         "allow-listed": bool(matching(c.name, targets.containers))} for c in inv.containers]
    rows += [{"kind": "unit", "name": u.name, "state": u.active, "detail": "",
              "allow-listed": bool(matching(u.name, targets.systemd_units))} for u in inv.units
             if matching(u.name, targets.systemd_units) or u.active == "active"]
    rows += [{"kind": "process", "name": p.comm, "state": f"pid {p.pid}", "detail": p.args[:80],
              "allow-listed": True} for p in inv.processes]
    rows += [{"kind": "gpu app", "name": a.name, "state": f"pid {a.pid}", "detail": f"{a.used_mib} MiB",
              "allow-listed": False} for a in inv.gpu_apps]
    rows += [{"kind": "fact", "name": k, "state": "", "detail": v, "allow-listed": False}
             for k, v in (("docker", inv.docker), ("systemd", inv.systemd), ("gpu", inv.gpu))]
    rows.append({"kind": "memory", "name": inv.memory.source, "state": "", "detail": inv.memory.describe(),
                 "allow-listed": False})
    return rows


def matching(name: str, patterns: list[str]) -> str | None:
    """The first allow-list pattern that matches `name`, None where none does."""
    return next((p for p in patterns if fnmatch.fnmatchcase(name, p)), None)
