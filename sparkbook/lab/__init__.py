"""The lab: a real multi-node cluster on this one root machine (see cluster.py for how a node is made).

    up(nodes=2, progress=None) -> LabStatus   bring it up (or report it, when it is up already)
    down() -> None                            remove everything it made; safe to run twice
    status() -> LabStatus                     each node: IP, hostname, sshd, dockerd, images, containers
    reset(progress=None) -> LabStatus         on a lab that is up: back to the initial state (the old
                                              deployment running, workers without vLLM images)
    params_file(nodes) -> Path                a params file describing an N-node lab
    wait_old_deployment(timeout) -> dict      until the old vLLM (slow to start) answers too

The head node (lab-0) gets every lab image; workers get only the base image, so the runbook's
distribution step has real work to do. Every node gets the lab models in its model cache
(/srv/models inside the node). An "old deployment" (deployment.py) runs when the lab comes up: containers,
and a unit-like manager on the head that owns a `--rm` container on every node (systemd itself is what the
lab cannot model: its nodes have no init system; deployment.py says how that part is tested).
"""
from __future__ import annotations

import contextlib
import fcntl
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import cluster
from .cluster import LabError, LabNode, lab_home

Progress = Callable[[str], None] | None

REPO_PARAMS = Path(__file__).resolve().parents[2] / "params" / "lab.yaml"
DEFAULT_LAB_HOME = Path("/var/lib/sparkbook-lab")
SMALL_SERVICES = {"proxy", "embeddings", "reranker", "ray-head", "ray-worker"}
OLD_VLLM_TIMEOUT_S = 600

__all__ = ["up", "down", "status", "reset", "params_file", "wait_old_deployment", "LabStatus", "LabNodeStatus",
           "LabError"]


@dataclass
class LabNodeStatus:
    """How one lab node stands (`sparkbook lab status`): its init, sshd, dockerd, images and containers."""

    name: str
    role: str
    ip: str
    netns: str
    docker_host: str            # unix:// socket of the node's dockerd, usable from the host
    init_pid: int | None     # host PID of the node's init (PID 1 of its pid namespace)
    hostname: str | None     # as the node reports it over SSH (None: SSH failed)
    sshd: bool
    dockerd: bool
    images: list[str] = field(default_factory=list)
    containers: list[dict[str, Any]] = field(default_factory=list)  # name, image, state, status, labels
    error: str = ""


@dataclass
class LabStatus:
    up: bool
    nodes: list[LabNodeStatus]
    lab_home: str
    bridge: str
    host_ip: str
    key_file: str
    known_hosts: str
    ssh_config: str
    params_file: str | None
    actions: list[str] = field(default_factory=list)   # what the call that made this status changed
    seconds: float | None = None                    # how long that call took

    @property
    def healthy(self) -> bool:
        return self.up and all(n.sshd and n.dockerd and n.hostname == n.name for n in self.nodes)

    def __str__(self) -> str:
        if not self.nodes:
            return f"lab: down (LAB_HOME {self.lab_home})"
        lines = [f"lab: {'up' if self.up else 'DOWN/BROKEN'}, {len(self.nodes)} nodes on bridge {self.bridge} "
                 f"({self.host_ip}); LAB_HOME {self.lab_home}",
                 f"ssh: ssh -F {self.ssh_config} <node>   (key {self.key_file}, known_hosts {self.known_hosts})",
                 f"params: {self.params_file}"]
        for n in self.nodes:
            lines.append(f"{n.name:7} {n.role:6} ip={n.ip:12} hostname={n.hostname or '-':7} "
                         f"sshd={'up' if n.sshd else 'DOWN'} dockerd={'up' if n.dockerd else 'DOWN'} "
                         f"init_pid={n.init_pid}")
            lines.append(f"        images: {', '.join(n.images) or '-'}")
            for c in n.containers:
                answers = c.get("answers")
                ans = "" if answers is None else " (answers)" if answers else " (not answering yet)"
                lines.append(f"        container {c['name']:15} {c['state']}{ans}  {c['image']}")
            if n.error:
                lines.append(f"        error: {n.error}")
        if self.actions:
            lines.append("changed: " + "; ".join(self.actions))
        if self.seconds is not None:
            lines.append(f"took {self.seconds:.1f}s")
        return "\n".join(lines)


def _say(progress: Progress, msg: str) -> None:
    if progress is not None:
        progress(msg)


@contextlib.contextmanager
def _lock() -> Iterator[None]:
    """One lab operation at a time on this machine (tests of several engineers share the lab)."""
    lab_home().mkdir(parents=True, exist_ok=True)
    with open(lab_home() / f"lab{cluster._SUFFIX}.lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


# ---------------------------------------------------------------------------------------------
# params


def _load_yaml(path: Path) -> dict[str, Any]:
    import yaml
    data: dict[str, Any] = yaml.safe_load(path.read_text())
    return data


def _state_dir(node: str) -> dict[str, str]:
    """Every lab's nodes are named lab-0, lab-1...: another lab ID's nodes get state dirs of their own (the run lock
    among them), or two labs' runs would share the default ~/.sparkbook/lab-0 of the file system all labs share."""
    return {"state_dir": f"/root/.sparkbook{cluster._SUFFIX}/{node}"} if cluster.LAB_ID else {}


def params_file(nodes: int = 2) -> Path:
    """The params file of an N-node lab: params/lab.yaml itself for the default lab (2 nodes, default
    LAB_HOME); otherwise LAB_HOME/params/lab-N.yaml derived from it (node list replaced, serve.node_env
    of missing nodes dropped, SSH key paths under LAB_HOME, another lab ID's state dirs)."""
    specs = cluster.lab_nodes(nodes)
    if nodes == 2 and lab_home() == DEFAULT_LAB_HOME and cluster.LAB_ID == 0:
        return REPO_PARAMS
    import yaml
    p = _load_yaml(REPO_PARAMS)
    template = p["nodes"][0]
    p["nodes"] = [{**template, "name": s.name, "role": s.role, "host": s.ip, "fabric_ip": s.ip,
                   "fabric_netdev": cluster.NODE_NETDEV, **_state_dir(s.name)} for s in specs]
    names = {s.name for s in specs}
    node_env = (p.get("serve") or {}).get("node_env")
    if isinstance(node_env, dict):
        p["serve"]["node_env"] = {k: v for k, v in node_env.items() if k in names}
    serve = p.setdefault("serve", {})
    if serve.get("tensor_parallel_size", 1) * serve.get("pipeline_parallel_size", 1) > nodes:
        serve["tensor_parallel_size"] = max(1, nodes // serve.get("pipeline_parallel_size", 1))  # one rank per node
    p.setdefault("ssh", {}).update({"key_file": str(cluster.key_file()),
                                    "known_hosts": str(cluster.known_hosts_file())})
    out = lab_home() / "params" / f"lab{cluster._SUFFIX}-{nodes}.yaml"
    out.parent.mkdir(parents=True, exist_ok=True)
    text = (f"# {nodes}-node lab, derived from {REPO_PARAMS} by sparkbook.lab.params_file({nodes}).\n"
            + yaml.safe_dump(p, sort_keys=False))
    if not out.exists() or out.read_text() != text:
        out.write_text(text)
    return out


# ---------------------------------------------------------------------------------------------
# status


def _ssh_hostname(s: LabNode) -> tuple[str | None, str]:
    try:
        p = subprocess.run(["ssh", "-F", str(cluster.ssh_config_file()), "-o", "ConnectTimeout=5", s.ip,
                            "hostname"], capture_output=True, text=True, timeout=20)
    except subprocess.TimeoutExpired:
        return None, "ssh timed out"
    if p.returncode != 0:
        return None, p.stderr.strip()[-300:]
    return p.stdout.strip(), ""


def node_images(s: LabNode) -> list[str]:
    out = cluster.run(["docker", "-H", s.docker_host, "images", "--format", "{{.Repository}}:{{.Tag}}"],
                      timeout=30).stdout
    return sorted(set(out.split()))


def _node_status(s: LabNode, st: dict[str, Any]) -> LabNodeStatus:
    from . import deployment
    ns = st.get("nodes", {}).get(s.name, {})
    alive = cluster.pid_alive(ns.get("init_pid"), ns.get("init_start"))
    n = LabNodeStatus(name=s.name, role=s.role, ip=s.ip, netns=s.netns, docker_host=s.docker_host,
                      init_pid=ns.get("init_pid") if alive else None, hostname=None, sshd=False, dockerd=False)
    if not alive:
        n.error = "node init is not running"
        return n
    n.hostname, err = _ssh_hostname(s)
    n.sshd = n.hostname is not None
    try:
        n.images = node_images(s)
        n.containers = [{**{k: c[k] for k in ("name", "image", "state", "status", "labels")},
                         "answers": deployment.health(c, s.ip) if c["state"] == "running" else None}
                        for c in deployment.containers(s)]
        n.dockerd = True
    except LabError as e:
        err = (err + "; " if err else "") + f"dockerd: {str(e)[-300:]}"
    n.error = err
    return n


def _status() -> LabStatus:
    st = cluster.load_state()
    n = st.get("n")
    specs = cluster.lab_nodes(n) if n else []
    nodes = [_node_status(s, st) for s in specs]
    return LabStatus(up=bool(nodes) and all(x.init_pid for x in nodes), nodes=nodes, lab_home=str(lab_home()),
                     bridge=cluster.BRIDGE, host_ip=cluster.HOST_IP, key_file=str(cluster.key_file()),
                     known_hosts=str(cluster.known_hosts_file()), ssh_config=str(cluster.ssh_config_file()),
                     params_file=str(params_file(n)) if n else None)


def status() -> LabStatus:
    """Each node of the lab: IP, hostname (over SSH), sshd, dockerd, images, containers."""
    return _status()


# ---------------------------------------------------------------------------------------------
# up / down / reset


def _head_lacks(n: int) -> list[str]:
    """The lab images the head of an N-node lab that is up does not hold."""
    from . import imagebuild
    head = next(s for s in cluster.lab_nodes(n) if s.role == "head")
    held = set(node_images(head))
    return [tag for tag in imagebuild.LAB_IMAGES if tag not in held]


def _lab_is_up(n: int) -> bool:
    st = cluster.load_state()
    if st.get("n") != n:
        return False
    for s in cluster.lab_nodes(n):
        if not cluster.node_alive(st, s):
            return False
        try:
            cluster.wait_node_ready(s, timeout=5)
        except LabError:
            return False
    return True


HEAD_ONLY_TREES = ("hf/hub",)  # node-dir trees only the head starts with


def _sync_models(specs: list[LabNode], trees: dict[str, Path], progress: Progress) -> list[str]:
    """Copy each tree (node-dir-relative destination -> host source) onto the nodes that start with it: the lab
    models into every node's model cache (LAB_HOME/nodes/<n>/models = /srv/models); the hub cache
    (LAB_HOME/nodes/<n>/hf = /home/lab/.cache/huggingface) onto the head only and removed from the workers, as
    the seed's offline worker had no weights (03 copies them). Symlinks are kept (the hub's snapshots)."""
    def listing(root: Path) -> list[tuple[str, bool, int, int]]:
        if not root.is_dir():
            return []
        return sorted((str(p.relative_to(root)), p.is_symlink(), p.stat().st_size, int(p.stat().st_mtime))
                      for p in root.rglob("*") if p.is_file())

    changed = []
    for rel, src in trees.items():
        src = Path(src)
        want = listing(src)
        for s in specs:
            dst = s.dir / rel
            if rel in HEAD_ONLY_TREES and s.role != "head":
                if dst.exists():
                    shutil.rmtree(dst)
                    changed.append(f"{s.name}/{rel} removed")
                continue
            if listing(dst) == want:
                continue
            tmp = dst.with_name(f".{dst.name}.tmp")
            shutil.rmtree(tmp, ignore_errors=True)
            shutil.copytree(src, tmp, symlinks=True)
            shutil.rmtree(dst, ignore_errors=True)
            tmp.rename(dst)
            changed.append(f"{s.name}/{rel}")
    if changed:
        _say(progress, f"models: {', '.join(changed)}")
    return changed


def _reset_worker_images(s: LabNode, keep: set[str], progress: Progress) -> list[str]:
    """Remove every image from a worker's daemon except `keep` (the runbook must bring vLLM images)."""
    have = cluster.run(["docker", "-H", s.docker_host, "images", "-a", "--format",
                        "{{.Repository}}:{{.Tag}} {{.ID}}"], timeout=30).stdout.split("\n")
    drop = []
    for line in filter(None, have):
        ref, iid = line.rsplit(" ", 1)
        if ref not in keep:
            drop.append(iid if ref.startswith("<none>") else ref)
    if drop:
        _say(progress, f"{s.name}: removing images not in a worker's initial state: {' '.join(drop)}")
        cluster.run(["docker", "-H", s.docker_host, "rmi", "-f", *drop], check=False, timeout=300)
        cluster.run(["docker", "-H", s.docker_host, "image", "prune", "-f"], check=False, timeout=300)
    return drop


def _build_while_loading(specs: list[LabNode], worker_tags: list[str],
                         progress: Progress) -> tuple[dict[str, str], dict[str, Path]]:
    """imagebuild.ensure_images + models.ensure_models in a thread; meanwhile each lab image that the
    builder already has is copied to the head (and the worker tags to the workers), so a cold `up`
    overlaps building and loading. Returns (tag -> image ID, model name -> dir)."""
    import threading

    from . import builder, imagebuild, models
    result: dict[str, Any] = {}  # what the thread hands back: built, models or error

    def work() -> None:
        try:
            _say(progress, "images: ensuring the lab images on the builder (built only when missing)")
            result["built"] = imagebuild.ensure_images(progress)
            _say(progress, "models: ensuring the lab models")
            made = models.ensure_models(progress)
            result["models"] = {**{f"models/{name}": path for name, path in made.items()},
                                "hf/hub": models.ensure_hf_cache(made, progress)}
        except BaseException as e:  # re-raised in the caller's thread
            result["error"] = e

    t = threading.Thread(target=work, name="lab-images", daemon=True)
    t.start()
    done: set[tuple[str, str]] = set()
    while True:
        t.join(5)
        if not t.is_alive():
            break
        for s in specs:
            for tag in (imagebuild.LAB_IMAGES if s.role == "head" else worker_tags):
                if (s.name, tag) in done or not builder.image_id(tag):
                    continue
                imagebuild.load_images(s.docker_host, [tag], progress)
                done.add((s.name, tag))
                break  # one image per round: look at the build thread again
    if "error" in result:
        raise result["error"]
    built: dict[str, str] = result["built"]
    trees: dict[str, Path] = result["models"]
    return built, trees


def _initial_state(specs: list[LabNode], progress: Progress, *, wait: bool = False,
                   keep_worker_images: bool = False) -> list[str]:
    """Images, models and the old deployment as a freshly-up lab has them (the images a worker holds beyond its
    initial ones kept with `keep_worker_images`). Idempotent."""
    from . import deployment, imagebuild
    params = _load_yaml(REPO_PARAMS)
    actions: list[str] = []
    base = imagebuild.BASE
    worker_tags = [base]                    # workers: only what the old deployment runs
    built, mdirs = _build_while_loading(specs, worker_tags, progress)
    head_tags = list(built)                 # every lab image on the head
    actions += deployment.stop_manager(specs, progress)  # by its PID; its --rm containers go with it
    removed = deployment.remove_extras(specs, params, base, progress)
    actions += [f"rm container {r}" for r in removed]
    for s in specs:
        want = head_tags if s.role == "head" else worker_tags
        if s.role != "head" and not keep_worker_images:
            actions += [f"rmi {s.name}/{r}" for r in _reset_worker_images(s, set(want), progress)]
        before = set(node_images(s))
        imagebuild.load_images(s.docker_host, want, progress)
        added = set(node_images(s)) - before
        actions += [f"load {s.name}/{t}" for t in sorted(added)]
    actions += [f"model {m}" for m in _sync_models(specs, mdirs, progress)]
    started = deployment.ensure(specs, params, base, progress)
    actions += [f"run {c}" for c in started]
    actions += [f"start {m}" for m in deployment.start_manager(specs, base, progress)]
    # The small services answer within seconds; the old vLLM takes 30 s to minutes on a busy 2-core
    # machine (pinned to one core), so `up` does not wait for it: see wait_old_deployment().
    deployment.wait_ready(specs, params, base, progress=progress, roles=SMALL_SERVICES)
    if wait:
        deployment.wait_ready(specs, params, base, progress=progress, timeout=OLD_VLLM_TIMEOUT_S)
    return actions


def up(nodes: int = 2, progress: Progress = None) -> LabStatus:
    """Bring an N-node lab up. On a lab that is up with N nodes and every lab image on its head: report its status,
    change nothing."""
    t0 = time.monotonic()
    with _lock():
        missing = _head_lacks(nodes) if _lab_is_up(nodes) else None
        if missing:  # a lab from an older checkout: the image set grew since (the whole initial state again)
            _say(progress, f"lab is up, but its head lacks {', '.join(missing)}: building and loading them")
        elif missing is not None:
            _say(progress, f"lab is up with {nodes} nodes: nothing to do")
            st = _status()
            st.seconds = time.monotonic() - t0
            return st
        from . import host
        installed = host.ensure_host(progress)
        actions = [f"installed {' '.join(installed)}"] if installed else []
        specs, changed = cluster.start(nodes, progress)
        if changed:
            actions.append("started nodes")
        actions += _initial_state(specs, progress)
        st = _status()
        st.actions, st.seconds = actions, time.monotonic() - t0
        _say(progress, f"lab up: {nodes} nodes in {st.seconds:.0f}s")
        return st


def reset(progress: Progress = None, *, keep_worker_images: bool = False) -> LabStatus:
    """On a lab that is up: remove what a runbook run left (containers, vLLM images on workers unless
    `keep_worker_images`: a worker that already holds an image of the new build's family, so a copy sends only the
    layers it lacks) and start the old deployment again, without restarting any node."""
    t0 = time.monotonic()
    with _lock():
        n = cluster.load_state().get("n")
        if not n or not _lab_is_up(n):
            raise LabError("the lab is not up; run `sparkbook lab up`")
        actions = _initial_state(cluster.lab_nodes(n), progress, keep_worker_images=keep_worker_images)
        st = _status()
        st.actions, st.seconds = actions, time.monotonic() - t0
        return st


def wait_old_deployment(timeout: float = OLD_VLLM_TIMEOUT_S, progress: Progress = None) -> dict[str, float]:
    """Until every old-deployment service (old-vllm and the manager's containers included) answers, the old
    cluster manager started first where it does not run; returns seconds waited for each."""
    from . import deployment, imagebuild
    n = cluster.load_state().get("n")
    if not n:
        raise LabError("the lab is not up; run `sparkbook lab up`")
    specs = cluster.lab_nodes(n)
    deployment.start_manager(specs, imagebuild.BASE, progress)
    return deployment.wait_ready(specs, _load_yaml(REPO_PARAMS), imagebuild.BASE, timeout=timeout, progress=progress)


def _stop_builder(progress: Progress) -> None:
    """Stop the image builder's dockerd too, unless it is busy building (its images lock is held)."""
    try:
        from . import builder
    except ImportError:
        return
    lock = builder.BUILDER_DIR / "images.lock"
    if not lock.exists():
        return
    with open(lock, "w") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            _say(progress, "builder: busy building images; left running")
            return
        try:
            if builder.stop_builder():
                _say(progress, "builder: stopped its dockerd")
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _stop_manager(progress: Progress) -> None:
    """The old cluster manager stops by its PID, its containers with it; a broken lab kills it with its nodes."""
    from . import deployment
    n = cluster.load_state().get("n")
    if n and _lab_is_up(n):
        try:
            deployment.stop_manager(cluster.lab_nodes(n), progress, timeout=20)
        except LabError as e:
            _say(progress, f"old cluster manager: {str(e)[-200:]}; it ends with its node")


def down(progress: Progress = None) -> None:
    """Remove every namespace, daemon, process, mount, bridge and firewall rule the lab made.

    The data (LAB_HOME: images in the nodes' data roots, keys, models) stays as the cache for the next
    `up`. Safe to run twice. Raises LabError naming what it could not remove.
    """
    with _lock():
        _stop_manager(progress)
        cluster.down(progress)
        # the builder (shared by every lab on this machine) stops with the last lab
        if not list(lab_home().glob("state*.json")):
            _stop_builder(progress)
