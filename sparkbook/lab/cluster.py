"""The lab cluster: N nodes on this one root machine, each a set of namespaces.

A node is a network namespace ``sbk-lab-<i>`` (its ``eth0`` is one end of a veth pair whose
other end sits on the lab bridge) plus one *node init* process started as::

    nsenter --net=/var/run/netns/sbk-lab-i \
        unshare --pid --fork --kill-child --uts --mount --mount-proc --propagation private \
        python3 -I cluster.py node-init LAB_HOME/nodes/lab-i/node.json

The init is PID 1 of the node's pid namespace.  It sets the hostname, gives the node its own
``/run`` and ``/dev/shm`` (tmpfs), bind-mounts the node's own directories on ``/var/lib/docker``,
``/srv/models``, ``/tmp``, ``/root/.ssh``, ``/etc/hosts`` and ``/etc/hostname``, then starts ``dockerd`` and
``sshd`` and reaps.  Killing it ends every process of the node, and the node's mounts die with
its mount namespace, which makes ``down`` clean.

This module imports only the standard library: it is also run as a script (the node init).
Everything the lab creates on the host is written to ``LAB_HOME/state.json`` (PIDs with their
start times, namespace, interface, bridge and firewall rule names) and removed by :func:`down`.
"""
from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

Progress = Callable[[str], None] | None

# ---------------------------------------------------------------------------------------------
# Layout. The default lab (LAB_ID 0) matches params/lab.yaml (tests/lab/test_cluster.py checks that).
# SPARKBOOK_LAB_ID=k (1..99) gives a second, independent lab beside it (own bridge sbk<k>-br0, subnet
# 10.77.<k>.0/24, namespaces, node dirs, state file and known_hosts under the same LAB_HOME; the builder,
# images and models are shared): for testing `down`/`up` without disturbing users of the default lab.
LAB_ID = int(os.environ.get("SPARKBOOK_LAB_ID", "0"))
_TAG = "sbk" if LAB_ID == 0 else f"sbk{LAB_ID}"
_SUFFIX = "" if LAB_ID == 0 else f"-{LAB_ID}"
BRIDGE = f"{_TAG}-br0"
HOST_IP = f"10.77.{LAB_ID}.1"
PREFIX_LEN = 24
NODE_IP_BASE = f"10.77.{LAB_ID}."  # node i gets 10.77.<id>.(10+i)
NODE_IP_OFFSET = 10
NODE_NETDEV = "eth0"
NETNS_PREFIX = f"{_TAG}-lab-"
VETH_PREFIX = f"{_TAG}-v"  # host end <tag>-v<i>; the node end is created as <tag>-n<i> and renamed eth0
VETH_PEER_PREFIX = f"{_TAG}-n"
MAX_NODES = 64
NODE_MOUNTS = {  # node dir (under LAB_HOME/nodes/<name>/) -> path inside the node
    "docker": "/var/lib/docker",
    "models": "/srv/models",
    "hf": "/home/lab/.cache/huggingface",  # a Hugging Face cache that is not root's (params/lab-hf.yaml)
    "tmp": "/tmp",
    "dotssh": "/root/.ssh",  # the node's own ~/.ssh: the lab key + known_hosts, so nodes ssh to each other
}
FORWARD_RULE = ["FORWARD", "-i", BRIDGE, "-o", BRIDGE, "-j", "ACCEPT"]
INPUT_RULE = ["INPUT", "-i", BRIDGE, "-j", "ACCEPT"]
CGROUP_ROOT = Path("/sys/fs/cgroup")
CMD_TIMEOUT = 60


class LabError(RuntimeError):
    pass


def lab_home() -> Path:
    return Path(os.environ.get("SPARKBOOK_LAB_HOME", "/var/lib/sparkbook-lab"))


def state_file() -> Path:
    return lab_home() / f"state{_SUFFIX}.json"


def nodes_dir() -> Path:
    return lab_home() / f"nodes{_SUFFIX}"


def ssh_dir() -> Path:
    return lab_home() / "ssh"


def key_file() -> Path:
    return ssh_dir() / "id_ed25519"


def known_hosts_file() -> Path:
    return ssh_dir() / f"known_hosts{_SUFFIX}"


def ssh_config_file() -> Path:
    return ssh_dir() / f"config{_SUFFIX}"


@dataclass
class LabNode:
    """One lab node as the lab builds it (its namespace, veth, address and directory), not a params node."""

    index: int
    name: str
    ip: str
    role: str
    netns: str
    veth: str

    @property
    def dir(self) -> Path:
        return nodes_dir() / self.name

    @property
    def docker_sock(self) -> Path:
        """The node daemon's second socket, on the host's file system (for the host's docker CLI)."""
        return self.dir / "docker.sock"

    @property
    def docker_host(self) -> str:
        return f"unix://{self.docker_sock}"

    @property
    def log_dir(self) -> Path:
        return self.dir / "logs"


def lab_nodes(n: int) -> list[LabNode]:
    if not 1 <= n <= MAX_NODES:
        raise LabError(f"nodes must be between 1 and {MAX_NODES}, got {n}")
    return [
        LabNode(index=i, name=f"lab-{i}", ip=f"{NODE_IP_BASE}{NODE_IP_OFFSET + i}",
                role="head" if i == 0 else "worker", netns=f"{NETNS_PREFIX}{i}", veth=f"{VETH_PREFIX}{i}")
        for i in range(n)
    ]


# ---------------------------------------------------------------------------------------------
# Small helpers


def _say(progress: Progress, msg: str) -> None:
    if progress is not None:
        progress(msg)


def run(cmd: list[str], *, check: bool = True, timeout: float = CMD_TIMEOUT, input: str | None = None,
        env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, input=input, env=env)
    except subprocess.TimeoutExpired as e:
        raise LabError(f"timed out after {timeout}s: {shlex.join(cmd)}") from e
    if check and p.returncode != 0:
        raise LabError(f"failed ({p.returncode}): {shlex.join(cmd)}\n{p.stderr.strip()[-2000:]}")
    return p


def proc_starttime(pid: int) -> int | None:
    """Start time (clock ticks since boot) of a live, non-zombie process; None otherwise."""
    try:
        data = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    rest = data[data.rindex(")") + 2:].split()
    if rest[0] in ("Z", "X"):
        return None
    return int(rest[19])


def pid_alive(pid: int | None, starttime: int | None) -> bool:
    if not pid or starttime is None:
        return False
    return proc_starttime(pid) == starttime


def _children(pid: int) -> list[int]:
    try:
        return [int(x) for x in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def _reap(pid: int) -> None:
    """Collect the exit status of a child of this process (no zombie left behind)."""
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass


def _kill_and_wait(pid: int, starttime: int | None, sig: int, timeout: float) -> bool:
    """Send sig to pid (if it is still the same process) and wait for it to go; True when gone."""
    if not pid_alive(pid, starttime):
        return True
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        return True
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        _reap(pid)
        if not pid_alive(pid, starttime):
            return True
        time.sleep(0.1)
    return False


# ---------------------------------------------------------------------------------------------
# State file


def load_state() -> dict[str, Any]:
    try:
        state: dict[str, Any] = json.loads(state_file().read_text())
        return state
    except (OSError, ValueError):
        return {}


def save_state(state: dict[str, Any]) -> None:
    state_file().parent.mkdir(parents=True, exist_ok=True)
    tmp = state_file().with_suffix(".tmp")
    tmp.write_text(json.dumps(state, indent=2, sort_keys=True))
    tmp.replace(state_file())


# ---------------------------------------------------------------------------------------------
# SSH keys


def ensure_keys(specs: list[LabNode], progress: Progress = None) -> None:
    """The lab's client key pair, each node's host key, known_hosts for every node, an ssh config."""
    ssh_dir().mkdir(parents=True, exist_ok=True)
    os.chmod(ssh_dir(), 0o700)
    if not key_file().exists():
        _say(progress, f"ssh: writing the lab key pair {key_file()}")
        run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "sparkbook-lab", "-f", str(key_file())])
    lines, cfg = [], []
    for s in specs:
        hk = s.dir / "ssh" / "ssh_host_ed25519_key"
        hk.parent.mkdir(parents=True, exist_ok=True)
        if not hk.exists():
            run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", f"root@{s.name}", "-f", str(hk)])
        kt, kb = hk.with_suffix(".pub").read_text().split()[:2]
        lines.append(f"{s.ip} {kt} {kb}\n")
        cfg.append(f"Host {s.name} {s.ip}\n  HostName {s.ip}\n  User root\n  IdentityFile {key_file()}\n"
                   f"  UserKnownHostsFile {known_hosts_file()}\n  StrictHostKeyChecking yes\n"
                   f"  IdentitiesOnly yes\n  BatchMode yes\n  ConnectTimeout 10\n")
    known_hosts_file().write_text("".join(lines))
    ssh_config_file().write_text("".join(cfg))
    # each node's ~/.ssh (bind-mounted on /root/.ssh in the node): node-to-node ssh by name or IP
    node_known = "".join(f"{s.ip},{s.name} {line.split(' ', 1)[1]}" for s, line in zip(specs, lines, strict=True))
    node_cfg = "Host *\n  StrictHostKeyChecking yes\n  BatchMode yes\n  ConnectTimeout 10\n"
    files = {"id_ed25519": key_file().read_text(), "id_ed25519.pub": key_file().with_suffix(".pub").read_text(),
             "authorized_keys": key_file().with_suffix(".pub").read_text(), "known_hosts": node_known,
             "config": node_cfg}
    for s in specs:
        d = s.dir / "dotssh"
        d.mkdir(parents=True, exist_ok=True)
        os.chmod(d, 0o700)
        for name, text in files.items():
            f = d / name
            if not f.exists() or f.read_text() != text:
                f.write_text(text)
            os.chmod(f, 0o600 if name == "id_ed25519" else 0o644)


def sshd_config(s: LabNode) -> str:
    hk = s.dir / "ssh" / "ssh_host_ed25519_key"
    return "\n".join([
        f"ListenAddress {s.ip}",
        "Port 22",
        f"HostKey {hk}",
        f"AuthorizedKeysFile {key_file()}.pub",
        "PermitRootLogin prohibit-password",
        "PubkeyAuthentication yes",
        "PasswordAuthentication no",
        "KbdInteractiveAuthentication no",
        "StrictModes no",
        "UsePAM no",
        "UseDNS no",
        "PrintMotd no",
        "PidFile /run/sshd.pid",
        "MaxStartups 100:30:200",
        "MaxSessions 64",
        "AcceptEnv LANG LC_*",
        "Subsystem sftp internal-sftp",
        f"SetEnv SPARKBOOK_LAB_NODE={s.name}",
        "",
    ])


# ---------------------------------------------------------------------------------------------
# Network: bridge, firewall rules, namespaces, veths


def _link_exists(name: str) -> bool:
    return run(["ip", "link", "show", "dev", name], check=False).returncode == 0


def _netns_list() -> list[str]:
    out = run(["ip", "netns", "list"], check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _iptables_has(rule: list[str]) -> bool:
    return run(["iptables", "-w", "5", "-C", *rule], check=False).returncode == 0


def ensure_bridge(state: dict[str, Any], progress: Progress = None) -> None:
    if not _link_exists(BRIDGE):
        _say(progress, f"network: bridge {BRIDGE} {HOST_IP}/{PREFIX_LEN}")
        run(["ip", "link", "add", BRIDGE, "type", "bridge"])
        state.setdefault("bridges", [])
        if BRIDGE not in state["bridges"]:
            state["bridges"].append(BRIDGE)
        save_state(state)
    addrs = run(["ip", "-o", "-4", "addr", "show", "dev", BRIDGE]).stdout
    if f" {HOST_IP}/" not in addrs:
        run(["ip", "addr", "add", f"{HOST_IP}/{PREFIX_LEN}", "dev", BRIDGE])
    run(["ip", "link", "set", BRIDGE, "up"])
    rules = state.setdefault("iptables", [])
    for rule in (FORWARD_RULE, INPUT_RULE):
        if not _iptables_has(rule):
            _say(progress, f"network: iptables -I {shlex.join(rule)}")
            run(["iptables", "-w", "5", "-I", *rule])
        if rule not in rules:
            rules.append(rule)
    save_state(state)


def ensure_netns(s: LabNode, state: dict[str, Any]) -> None:
    """The node's network namespace: lo, eth0 = s.ip on the lab bridge, no default route."""
    nodes = state.setdefault("netns", [])
    if s.netns not in _netns_list():
        run(["ip", "netns", "add", s.netns])
    if s.netns not in nodes:
        nodes.append(s.netns)
        save_state(state)
    ns = ["ip", "-n", s.netns]
    if run([*ns, "link", "show", "dev", NODE_NETDEV], check=False).returncode != 0:
        if _link_exists(s.veth):
            run(["ip", "link", "del", s.veth])
        peer = f"{VETH_PEER_PREFIX}{s.index}"
        run(["ip", "link", "add", s.veth, "type", "veth", "peer", "name", peer])
        run(["ip", "link", "set", peer, "netns", s.netns])
        run([*ns, "link", "set", peer, "name", NODE_NETDEV])
    links = state.setdefault("veths", [])
    if s.veth not in links:
        links.append(s.veth)
        save_state(state)
    run(["ip", "link", "set", s.veth, "master", BRIDGE])
    run(["ip", "link", "set", s.veth, "up"])
    addrs = run([*ns, "-o", "-4", "addr", "show", "dev", NODE_NETDEV]).stdout
    if f" {s.ip}/" not in addrs:
        run([*ns, "addr", "add", f"{s.ip}/{PREFIX_LEN}", "dev", NODE_NETDEV])
    run([*ns, "link", "set", "lo", "up"])
    run([*ns, "link", "set", NODE_NETDEV, "up"])


# ---------------------------------------------------------------------------------------------
# Nodes


def _node_config(s: LabNode, specs: list[LabNode]) -> dict[str, Any]:
    d = s.dir
    return {
        "name": s.name,
        "ip": s.ip,
        "dir": str(d),
        "mounts": {str(d / k): v for k, v in NODE_MOUNTS.items()},
        "hosts": "127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n"
                 + "".join(f"{o.ip}\t{o.name}\n" for o in specs)
                 + f"{HOST_IP}\tlab-host\n",
        "dockerd": ["dockerd", "--host", "unix:///run/docker.sock", "--host", f"unix://{s.docker_sock}",
                    "--pidfile", "/run/docker.pid", "--iptables=false", "--ip-masq=false",
                    "--bridge=none", "--userland-proxy=false", "--cgroup-parent", f"/{s.netns}",
                    "--exec-opt", "native.cgroupdriver=cgroupfs", "--storage-driver", "overlay2"],
        "sshd": ["/usr/sbin/sshd", "-D", "-f", str(d / "ssh" / "sshd_config"),
                 "-E", str(s.log_dir / "sshd.log")],
        "log_dir": str(s.log_dir),
    }


def _node_state(state: dict[str, Any], name: str) -> dict[str, Any]:
    node: dict[str, Any] = state.setdefault("nodes", {}).setdefault(name, {})
    return node


def node_alive(state: dict[str, Any], s: LabNode) -> bool:
    ns = state.get("nodes", {}).get(s.name, {})
    return pid_alive(ns.get("init_pid"), ns.get("init_start"))


def start_node(s: LabNode, specs: list[LabNode], state: dict[str, Any], progress: Progress = None) -> None:
    for sub in [*NODE_MOUNTS, "logs", "ssh", "etc"]:
        (s.dir / sub).mkdir(parents=True, exist_ok=True)
    os.chmod(s.dir / "tmp", 0o1777)
    (s.dir / "ssh" / "sshd_config").write_text(sshd_config(s))
    cfg_path = s.dir / "node.json"
    cfg_path.write_text(json.dumps(_node_config(s, specs), indent=2))
    for target in NODE_MOUNTS.values():  # mount points must exist on the host's file system
        if not Path(target).exists():
            Path(target).mkdir(parents=True)
            made = state.setdefault("made_dirs", [])
            if target not in made:
                made.append(target)
    if s.docker_sock.exists() or s.docker_sock.is_symlink():
        s.docker_sock.unlink()
    log = open(s.log_dir / "init.log", "ab")
    cmd = ["nsenter", f"--net=/var/run/netns/{s.netns}", "unshare", "--pid", "--fork",
           "--kill-child=SIGKILL", "--uts", "--mount", "--mount-proc", "--propagation", "private",
           sys.executable, "-I", str(Path(__file__).resolve()), "node-init", str(cfg_path)]
    _say(progress, f"{s.name}: starting node init (netns {s.netns}, pid/uts/mount namespaces)")
    p = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                         start_new_session=True, close_fds=True)
    log.close()
    init_pid = None
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and init_pid is None:
        kids = _children(p.pid)
        if kids:
            init_pid = kids[0]
        elif p.poll() is not None:
            break
        else:
            time.sleep(0.02)
    if init_pid is None:
        raise LabError(f"{s.name}: node init did not start; see {s.log_dir / 'init.log'}")
    ns = _node_state(state, s.name)
    ns.update({"unshare_pid": p.pid, "unshare_start": proc_starttime(p.pid), "init_pid": init_pid,
               "init_start": proc_starttime(init_pid), "ip": s.ip, "netns": s.netns, "veth": s.veth,
               "role": s.role, "started_at": time.time()})
    # Keep the Popen object from reaping/complaining; the process outlives this Python process.
    p.returncode = 0
    save_state(state)


def wait_node_ready(s: LabNode, timeout: float = 60) -> None:
    """Until the node's dockerd answers on its socket and its sshd listens on s.ip:22."""
    import socket as _socket
    deadline = time.monotonic() + timeout
    docker_ok = ssh_ok = False
    while time.monotonic() < deadline:
        if not docker_ok:
            docker_ok = run(["docker", "-H", s.docker_host, "version", "--format", "{{.Server.Version}}"],
                            check=False, timeout=10).returncode == 0
        if not ssh_ok:
            try:
                with _socket.create_connection((s.ip, 22), timeout=2) as c:
                    ssh_ok = c.recv(4).startswith(b"SSH-")
            except OSError:
                pass
        if docker_ok and ssh_ok:
            return
        time.sleep(0.2)
    raise LabError(f"{s.name}: not ready after {timeout}s (dockerd={docker_ok}, sshd={ssh_ok}); "
                   f"logs in {s.log_dir}")


def stop_node(name: str, ns: dict[str, Any], timeout: float = 20) -> None:
    init_pid, init_start = ns.get("init_pid"), ns.get("init_start")
    un_pid, un_start = ns.get("unshare_pid"), ns.get("unshare_start")
    if init_pid and not _kill_and_wait(init_pid, init_start, signal.SIGTERM, timeout):
        _kill_and_wait(init_pid, init_start, signal.SIGKILL, 10)
    if un_pid:
        if not _kill_and_wait(un_pid, un_start, signal.SIGTERM, 5):
            _kill_and_wait(un_pid, un_start, signal.SIGKILL, 5)
        _reap(un_pid)


def _kill_netns_pids(netns: str, progress: Progress = None) -> None:
    """SIGKILL every process still in one of the lab's network namespaces (e.g. a node whose state
    entry was lost in a crash); they are the lab's by construction."""
    if netns not in _netns_list():
        return
    pids = [int(x) for x in run(["ip", "netns", "pids", netns], check=False).stdout.split()]
    if pids:
        _say(progress, f"{netns}: killing leftover processes {pids}")
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + 10
    while pids and time.monotonic() < deadline:
        for pid in pids:
            _reap(pid)
        pids = [p for p in pids if proc_starttime(p) is not None]
        time.sleep(0.1)


def _cgroup_cleanup(netns_names: list[str]) -> list[str]:
    """Remove the (empty) cgroups the node daemons made under /<netns> in every v1 hierarchy."""
    left: list[str] = []
    if not CGROUP_ROOT.is_dir():
        return left
    for ctrl in CGROUP_ROOT.iterdir():
        for name in netns_names:
            top = ctrl / name
            if not top.is_dir():
                continue
            for d in sorted((p for p in top.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)):
                try:
                    d.rmdir()
                except OSError:
                    pass
            try:
                top.rmdir()
            except OSError:
                left.append(str(top))
    return left


# ---------------------------------------------------------------------------------------------
# Whole-lab operations


def start(n: int, progress: Progress = None) -> tuple[list[LabNode], bool]:
    """Bring up the namespaces/daemons of an n-node lab. Returns (specs, changed)."""
    specs = lab_nodes(n)
    state = load_state()
    if state.get("nodes") and state.get("n") not in (None, n) and any(
            pid_alive(v.get("init_pid"), v.get("init_start")) for v in state["nodes"].values()):
        raise LabError(f"the lab is up with {state.get('n')} nodes; run `sparkbook lab down` first "
                       f"to bring it up with {n}")
    if state.get("n") not in (None, n):
        # Leftovers of a lab of another size (e.g. a crashed run): clear them first.
        down(progress)
        state = {}
    state["n"] = n
    state.setdefault("lab_home", str(lab_home()))
    save_state(state)
    ensure_keys(specs, progress)
    ensure_bridge(state, progress)
    changed = False
    for s in specs:
        ensure_netns(s, state)
        if not node_alive(state, s):
            old = state.get("nodes", {}).get(s.name)
            if old:
                stop_node(s.name, old)
            _kill_netns_pids(s.netns, progress)
            start_node(s, specs, state, progress)
            changed = True
    for s in specs:
        wait_node_ready(s)
        _say(progress, f"{s.name}: {s.ip} sshd and dockerd up")
    return specs, changed


def down(progress: Progress = None) -> dict[str, list[str]]:
    """Remove everything the state file lists, then check nothing is left. Safe to run twice."""
    state = load_state()
    nodes = state.get("nodes", {})
    for name, ns in nodes.items():
        if pid_alive(ns.get("init_pid"), ns.get("init_start")):
            _say(progress, f"{name}: stopping node (init pid {ns['init_pid']})")
            try:
                os.kill(ns["init_pid"], signal.SIGTERM)
            except ProcessLookupError:
                pass
    for name, ns in nodes.items():
        stop_node(name, ns)
    netns_names = list(state.get("netns", [])) + [v.get("netns") for v in nodes.values() if v.get("netns")]
    # anything named like ours is ours too (e.g. a state file lost in a crash)
    netns_names += [x for x in _netns_list() if x.startswith(NETNS_PREFIX)]
    netns_names = list(dict.fromkeys(netns_names))
    for name in netns_names:
        _kill_netns_pids(name, progress)
        if name in _netns_list():
            _say(progress, f"network: removing netns {name}")
            run(["ip", "netns", "del", name], check=False)
    veths = list(state.get("veths", [])) + [v.get("veth") for v in nodes.values() if v.get("veth")]
    for v in dict.fromkeys(veths):
        if _link_exists(v):
            run(["ip", "link", "del", v], check=False)
    for rule in state.get("iptables", [FORWARD_RULE, INPUT_RULE]):
        while _iptables_has(rule):
            _say(progress, f"network: iptables -D {shlex.join(rule)}")
            run(["iptables", "-w", "5", "-D", *rule], check=False)
    for br in state.get("bridges", [BRIDGE]):
        if _link_exists(br):
            _say(progress, f"network: removing bridge {br}")
            run(["ip", "link", "del", br], check=False)
    cg_left = _cgroup_cleanup(netns_names)
    # Mount points made on the host (e.g. /srv/models): removed only when no other lab is up, since
    # removing a directory detaches the mounts on it in every other mount namespace.
    if not [f for f in lab_home().glob("state*.json") if f != state_file()]:
        for d in state.get("made_dirs", []):
            try:
                Path(d).rmdir()
            except OSError:
                pass
    for s in nodes_dir().glob("*/docker.sock"):
        try:
            s.unlink()
        except OSError:
            pass
    left = leftovers()
    if cg_left:
        left["cgroups"] = cg_left
    if any(left.values()):
        raise LabError(f"lab down left things behind: {left}")
    try:
        state_file().unlink()
    except FileNotFoundError:
        pass
    _say(progress, "lab down: nothing left behind")
    return left


def leftovers() -> dict[str, list[str]]:
    """What of this lab is still on this machine: processes, namespaces, links, mounts, rules."""
    procs = []
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            cmd = (p / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if "node-init" in cmd and f"{nodes_dir()}/" in cmd or f"--net=/var/run/netns/{NETNS_PREFIX}" in cmd:
            procs.append(f"{p.name} {cmd[:120]}")
    ours = set()  # and every process still in one of the lab's network namespaces
    for name in _netns_list():
        if name.startswith(NETNS_PREFIX):
            out = run(["ip", "netns", "pids", name], check=False).stdout.split()
            procs += [f"{x} (in netns {name})" for x in out]
            ours.add(name)
    links = [line.split(":")[1].strip().split("@")[0]
             for line in run(["ip", "-o", "link", "show"]).stdout.splitlines()]
    links = [x for x in links if x == BRIDGE or x.startswith(VETH_PREFIX) or x.startswith(VETH_PEER_PREFIX)]
    mounts = [line for line in Path("/proc/self/mounts").read_text().splitlines()
              if f"{nodes_dir()}/" in line or f"/netns/{NETNS_PREFIX}" in line]
    rules = [" ".join(r) for r in (FORWARD_RULE, INPUT_RULE) if _iptables_has(r)]
    return {"processes": procs, "netns": sorted(ours), "links": links, "mounts": mounts, "rules": rules}


# ---------------------------------------------------------------------------------------------
# The node init (PID 1 of a node's pid namespace). Standard library only.


def node_init(cfg_path: str) -> None:  # pragma: no cover - runs inside the node
    import socket

    cfg = json.loads(Path(cfg_path).read_text())
    log_dir = Path(cfg["log_dir"])

    def log(msg: str) -> None:
        print(f"{time.strftime('%H:%M:%S')} node-init[{cfg['name']}]: {msg}", flush=True)

    def sh(*cmd: str) -> None:
        subprocess.run(cmd, check=True, timeout=30)

    socket.sethostname(cfg["name"])
    sh("mount", "-t", "tmpfs", "-o", "mode=755,nosuid,nodev", "tmpfs", "/run")
    for d in ("/run/sshd", "/run/lock"):
        os.makedirs(d, exist_ok=True)
    os.chmod("/run/sshd", 0o755)
    sh("mount", "-t", "tmpfs", "-o", "mode=1777,nosuid,nodev", "shm", "/dev/shm")
    for src, dst in cfg["mounts"].items():
        sh("mount", "--bind", src, dst)
    etc = Path(cfg["dir"]) / "etc"
    (etc / "hosts").write_text(cfg["hosts"])
    (etc / "hostname").write_text(cfg["name"] + "\n")
    sh("mount", "--bind", str(etc / "hosts"), "/etc/hosts")
    sh("mount", "--bind", str(etc / "hostname"), "/etc/hostname")
    for rc in (".bashrc", ".profile"):  # root's start-up files on this host (pyenv, cargo) are not a fresh node's:
        if Path("/root", rc).exists():  # bash runs .bashrc for every command sshd starts, ~0.3 s of CPU each
            (etc / f"root{rc}").write_text("# lab node: an empty start-up file, as on a fresh node\n")
            sh("mount", "--bind", str(etc / f"root{rc}"), f"/root/{rc}")
    os.environ.pop("DOCKER_HOST", None)
    os.environ["HOSTNAME"] = cfg["name"]

    children: dict[int, str] = {}
    stopping = False

    def spawn(what: str) -> None:
        out = open(log_dir / f"{what}.log", "ab")
        p = subprocess.Popen(cfg[what], stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                             close_fds=True)
        out.close()
        p.returncode = 0  # reaped by the loop below, not by subprocess
        children[p.pid] = what
        log(f"started {what} pid {p.pid}")

    def on_term(signum: int, frame: FrameType | None) -> None:
        nonlocal stopping
        if stopping:
            return
        stopping = True
        log("stopping")
        for pid in list(children):
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)
    spawn("dockerd")
    spawn("sshd")
    deadline: float | None = None  # set once stopping
    restarts = {"dockerd": 0, "sshd": 0}
    while True:
        if stopping and deadline is None:
            deadline = time.monotonic() + 15
        if deadline is not None and (not children or time.monotonic() > deadline):
            log("exit")
            os._exit(0)  # the kernel kills whatever is left in this pid namespace
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            pid, status = 0, 0
        if pid == 0:
            time.sleep(0.1 if stopping else 0.5)
            continue
        what = children.pop(pid, None)
        if what and not stopping:
            log(f"{what} exited with status {status}")
            if restarts[what] < 3:
                restarts[what] += 1
                time.sleep(1)
                spawn(what)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "node-init":
        node_init(sys.argv[2])
    else:
        print("usage: cluster.py node-init NODE_JSON", file=sys.stderr)
        sys.exit(2)
