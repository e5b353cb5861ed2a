"""What 01 never stops, whatever its patterns match: PID 1, the kernel's threads, sshd, dockerd, containerd and dbus,
what a login runs (a user's `systemd --user`, a Docker client's `docker system dial-stdio`: this runbook's own
connections among them), the lab's node processes, the inventory probe with its ancestors (the SSH session 01 reaches
the node by), and, on the controller's own host, the controller with its ancestors. A typo such as `*` would
otherwise plan them all (issue 43, item 6); pure over the probed process table, so recorded `ps` texts test it."""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from .ownership import family

# comm names (containerd's shims by prefix below)
DAEMONS = ("sshd", "sshd-session", "dockerd", "containerd", "dbus-daemon", "dbus-broker", "dbus-broker-lau")
# what a login over SSH runs, this runbook's own among them: the user's systemd manager (and its PAM helper) that a
# login starts, and the node end of a Docker client over SSH (docker-py's, as 01 and 04 reach dockerd)
LOGIN = re.compile(r"^(?:\S*/)?systemd --user\b|^\(sd-pam\)$|^(?:\S*/)?docker system dial-stdio\b")
# sparkbook/lab/cluster.py's node init (PID 1 of a lab node), and the nsenter/unshare that start it on the host
LAB_NODE = re.compile(r"cluster\.py node-init |--net=/var/run/netns/sbk-lab-")
KTHREADD = 2


@dataclass(frozen=True)
class Proc:
    """One row of a node's process table, as `ps -eo pid=,ppid=,comm=,args=` reports it."""

    pid: int
    ppid: int
    comm: str
    args: str


@dataclass(frozen=True)
class Spared:
    """A target a pattern matched that 01 never plans, and why."""

    kind: str  # unit | process
    name: str
    pattern: str
    why: str

    def line(self, node: str) -> str:
        return f"{node}: {self.name} matches {self.pattern!r} but is never stopped: {self.why}"


def table(ps: list[str], tree: dict[int, tuple[int, str]]) -> dict[int, Proc]:
    """The inventory's `ps -eo pid=,comm=,args=` lines joined with its process tree (pid: (ppid, args))."""
    out = {}
    for line in ps:
        cols = line.split(None, 2)
        if len(cols) >= 2 and cols[0].isdigit():
            pid = int(cols[0])
            out[pid] = Proc(pid, tree.get(pid, (0, ""))[0], cols[1], cols[2] if len(cols) > 2 else "")
    return out


def why_spared(p: Proc) -> str | None:
    """Why this process is never stopped on its own merits (None: it may be); ancestry is `spared`'s."""
    if p.pid == 1:
        return "PID 1 (the node's init)"
    if KTHREADD in (p.pid, p.ppid) or (p.args.startswith("[") and p.args.endswith("]")):
        return "a kernel thread (no command line)"
    if p.comm in DAEMONS or p.comm.startswith("containerd-shim"):
        return f"{p.comm}, which the node is reached and run by"
    if LAB_NODE.search(p.args):
        return "a lab node's own process (its init)"
    if LOGIN.search(p.args):
        return "a login's own process (a user's systemd, or a Docker client's SSH end, this runbook's among them)"
    return None


def ancestry(pid: int, procs: dict[int, Proc]) -> list[int]:
    """The process and its ancestors up to PID 1 (a loop in a torn table ends the walk)."""
    out = []
    while pid in procs and pid not in out:
        out.append(pid)
        pid = procs[pid].ppid
    return out


def spared(procs: dict[int, Proc], roots: dict[int, str]) -> dict[int, str]:
    """pid -> why 01 never stops it: each process `why_spared` names, and each root (the probe's shell, the
    controller) with its ancestors; the probe's own children too (its `ps` lists itself)."""
    out = {p.pid: why for p in procs.values() if (why := why_spared(p))}
    tree = {p.pid: (p.ppid, p.args) for p in procs.values()}
    for root, what in roots.items():
        for pid in [*ancestry(root, procs), *family(root, tree)]:
            out.setdefault(pid, what)
    return out


def roots(probe_pid: int | None, node_host_id: str) -> dict[int, str]:
    """The processes whose ancestry is spared: the probe's shell, and this controller where the node's boot and PID
    namespace are the controller's own (only there does the controller's PID name the same process)."""
    out = {probe_pid: "the inventory probe or an ancestor (the session 01 reaches the node by)"} if probe_pid else {}
    if node_host_id and node_host_id == controller_host_id():
        out[os.getpid()] = "this controller (sparkbook) or an ancestor of it"
    return out


def controller_host_id() -> str:
    """This controller's kernel boot id and PID namespace, as the inventory probe prints a node's ("" unreadable)."""
    try:
        return f"{Path('/proc/sys/kernel/random/boot_id').read_text().strip()} {os.readlink('/proc/self/ns/pid')}"
    except OSError:
        return ""
