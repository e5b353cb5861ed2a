"""The lab's "old deployment": what the runbook's cleanup stage finds running, shaped like the seed's.

head (node 0):   old-vllm        the installed (old) vLLM image serving the qwen3-tiny model on :8000
                 old-proxy       base image, a small reverse proxy :8080 -> :8000 (depends on old-vllm)
                 (old cluster manager, a process, and its vllm_node container: see below)
worker (node 1): old-embeddings  base image, python holding ~256 MiB, answering HTTP on :8001
                 old-reranker    base image, python holding ~256 MiB, answering HTTP on :8002
                 (vllm_node, the manager's)
further workers: nothing.

Every container has ``--network host`` (it lives in its node's network namespace and answers on the
node's IP), restart policy ``no``, and labels saying it is part of the old deployment, what it is and
what it depends on. The container names must match the cleanup allow-list of the lab's params file;
:func:`plan` checks that, so the cleanup stage can rely on params alone.

A unit-managed part, as the seed's vllm-cluster.service runs eugr/spark-vllm-docker's launch-cluster.sh:
the *old cluster manager* (MANAGER_PY), a long-running process on the head (``setsid``, a pidfile in the
head's /run), starts a ``--rm`` container named ``vllm_node`` on the head and on worker 1 (the seed's two
nodes; further workers: nothing) with attached ``docker run`` clients (the head's own daemon; the worker's as
``docker -H ssh://root@WORKER_IP``, over the lab's node-to-node SSH), restarts one that dies, and on SIGTERM
stops them all (``--rm``: removed) and exits.
Its containers run a small process (SERVICE_PY: 16 MiB, /health on :8003 head, :8004 worker), not the old
image's ``ray start --block``: a Ray head + worker cost about a core and 1 GiB on this 2-core machine. The
manager's command line is in params' ``cleanup.processes``; ``vllm_node`` is on NO allow-list (01 must find it
through its owner). The lab starts the manager in up/reset, stops it by its PID (pidfile, checked against
its command line) and never by name; ``lab down`` kills the nodes' PID namespaces with everything in them.

What the lab cannot model: systemd itself. The nodes are namespaces without an init system, so no unit,
cgroup-per-service or ``systemctl`` exists there; the manager stands for the unit (cleanup maps a managed
process's descendants as it maps a unit's cgroup) and systemd's side is covered by unit tests on recorded
``systemctl show`` output (tests/unit/test_cleanup_ownership.py, tests/unit/data/).
"""
from __future__ import annotations

import fnmatch
import hashlib
import json
import shlex
import subprocess
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .cluster import LabError, LabNode, lab_home, run, ssh_config_file

Progress = Callable[[str], None] | None

LABEL = "org.sparkbook.lab"
DEPLOYMENT_LABEL = f"{LABEL}.deployment"  # = "old"
ROLE_LABEL = f"{LABEL}.role"
DEPENDS_LABEL = f"{LABEL}.depends-on"
SPEC_LABEL = f"{LABEL}.spec"
OLD_MODEL = "qwen3-tiny"  # the lab model the old vLLM can serve (see models.py)
MEMORY_HOLD_MIB = 256
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # lab addresses: never a proxy

# A tiny HTTP service for the base image (python3 stdlib only): a stand-in embeddings model, a
# reranker, or a reverse proxy. It holds MiB of touched memory, answers /health and a JSON API, and
# exits at once on SIGTERM.
SERVICE_PY = r'''
import json, os, signal, sys, urllib.request, urllib.error
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
role, port, hold_mib = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
upstream = sys.argv[4] if len(sys.argv) > 4 else ""
signal.signal(signal.SIGTERM, lambda *a: os._exit(0))
held = b"\x01" * (hold_mib << 20)  # resident, not lazily mapped
class H(BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass
    def reply(self, code, body, ctype="application/json"):
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)
    def proxy(self):
        n = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(n) if n else None
        req = urllib.request.Request(upstream + self.path, data=body, method=self.command)
        if self.headers.get("Content-Type"):
            req.add_header("Content-Type", self.headers["Content-Type"])
        try:
            with urllib.request.urlopen(req, timeout=120) as r:
                self.reply(r.status, r.read(), r.headers.get("Content-Type", "application/json"))
        except urllib.error.HTTPError as e:
            self.reply(e.code, e.read())
        except OSError as e:
            self.reply(502, {"error": f"upstream {upstream}: {e}"})
    def do_GET(self):
        if role == "proxy" and self.path != "/proxy/health":
            return self.proxy()
        if self.path in ("/health", "/proxy/health"):
            return self.reply(200, {"status": "ok", "role": role})
        self.reply(200, {"service": role, "port": port, "held_mib": hold_mib})
    def do_POST(self):
        if role == "proxy":
            return self.proxy()
        n = int(self.headers.get("Content-Length") or 0)
        try:
            req = json.loads(self.rfile.read(n) or b"{}")
        except ValueError:
            return self.reply(400, {"error": "bad json"})
        if role == "embeddings":
            inp = req.get("input", "")
            items = inp if isinstance(inp, list) else [inp]
            data = [{"object": "embedding", "index": i,
                     "embedding": [((hash(str(t)) >> k) % 1000) / 1000.0 for k in range(8)]}
                    for i, t in enumerate(items)]
            return self.reply(200, {"object": "list", "data": data, "model": "old-embeddings"})
        docs = req.get("documents", [])
        q = set(str(req.get("query", "")).split())
        res = [{"index": i, "relevance_score": len(q & set(str(d).split())) / (1 + len(q))}
               for i, d in enumerate(docs)]
        self.reply(200, {"results": sorted(res, key=lambda r: -r["relevance_score"]), "model": "old-reranker"})
ThreadingHTTPServer(("0.0.0.0", port), H).serve_forever()
'''


SERVICE_IN_CONTAINER = "/opt/sparkbook-lab/old_service.py"

# The old cluster manager (see the module docstring), run by the head's own python3. Everything it needs is
# on its command line: `sparkbook restore` relaunches it from the argv 01 recorded.
MANAGER_PY = r'''
import argparse, os, signal, subprocess, time
ap = argparse.ArgumentParser()
for opt in ("--pidfile", "--log", "--name", "--image", "--service"):
    ap.add_argument(opt, required=True)
ap.add_argument("--member", action="append", required=True, help="DOCKER_HOST,ROLE,PORT (local: this node's daemon)")
a = ap.parse_args()
log = open(a.log, "a", buffering=1)
stopping = []
signal.signal(signal.SIGTERM, lambda *_: stopping.append(1))
members = [m.split(",") for m in a.member]
def say(msg):
    log.write(time.strftime("%H:%M:%S ") + msg + "\n")
def docker(host):
    return ["docker"] if host == "local" else ["docker", "-H", host]
def quiet(argv):
    try:
        subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log, timeout=60)
    except subprocess.TimeoutExpired:
        say(f"timed out: {argv}")
def start(host, role, port):
    quiet(docker(host) + ["rm", "-f", a.name])
    labels = {"deployment": "old", "role": role, "port": port, "managed-by": "old-cluster-manager"}
    argv = docker(host) + ["run", "--rm", "--name", a.name, "--network", "host"]
    argv += [x for k, v in labels.items() for x in ("--label", f"org.sparkbook.lab.{k}={v}")]
    argv += ["--volume", f"{a.service}:/opt/sparkbook-lab/old_service.py:ro", a.image,
             "python3", "/opt/sparkbook-lab/old_service.py", role, port, "16"]
    say(f"starting {a.name} on {host}: {role} :{port}")
    return subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log)
with open(a.pidfile, "w") as fh:
    fh.write(f"{os.getpid()}\n")
clients = [start(*m) for m in members]
while not stopping:
    time.sleep(1)
    for i, c in enumerate(clients):
        if c.poll() is not None and not stopping:
            say(f"{a.name} on {members[i][0]} exited ({c.returncode}): restarting it")
            clients[i] = start(*members[i])
say("SIGTERM: stopping the containers on every node (--rm removes them)")
for m in members:
    quiet(docker(m[0]) + ["stop", "-t", "3", a.name])
for c in clients:
    try:
        c.wait(timeout=30)
    except subprocess.TimeoutExpired:
        c.kill()
os.unlink(a.pidfile)
say("stopped")
'''
MANAGER_NAME = "old_cluster_manager.py"
MANAGER_PIDFILE = "/run/old-cluster-manager.pid"  # the head's own /run (a tmpfs of its mount namespace)
MANAGER_LOG = "/tmp/old-cluster-manager.log"  # the head's own /tmp
MANAGED_NAME = "vllm_node"  # launch-cluster.sh's container name, on every node
MANAGED_ROLES = (("ray-head", 8003), ("ray-worker", 8004))  # head, workers
STOP_TIMEOUT_S = 60


def _script(name: str, text: str) -> Path:
    path = lab_home() / "services" / name
    if not path.exists() or path.read_text() != text:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return path


def service_script() -> Path:
    """SERVICE_PY as a file under LAB_HOME (bind-mounted read-only into the base-image containers)."""
    return _script("old_service.py", SERVICE_PY)


def manager_argv(specs: list[LabNode], base_image: str) -> list[str]:
    """The manager's command line on the head: a --member for the head's daemon and the first worker's (over
    SSH), the seed's two nodes."""
    members = [f"{'local' if s is specs[0] else f'ssh://root@{s.ip}'},{role},{port}"
               for s, (role, port) in zip(specs, MANAGED_ROLES, strict=False)]  # the seed's first two nodes
    return ["python3", str(_script(MANAGER_NAME, MANAGER_PY)), "--pidfile", MANAGER_PIDFILE, "--log", MANAGER_LOG,
            "--name", MANAGED_NAME, "--image", base_image, "--service", str(service_script()),
            *[x for m in members for x in ("--member", m)]]


@dataclass
class OldContainer:
    node: str
    name: str
    image: str
    role: str
    port: int
    args: list[str]
    depends_on: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    mounts: list[str] = field(default_factory=list)
    extra: list[str] = field(default_factory=list)
    health_path: str = "/health"
    host: str = ""
    managed: bool = False  # started by the old cluster manager, not by the lab

    def labels(self) -> dict[str, str]:
        out = {DEPLOYMENT_LABEL: "old", ROLE_LABEL: self.role, DEPENDS_LABEL: ",".join(self.depends_on),
               f"{LABEL}.port": str(self.port)}
        spec = [self.image, self.args, self.env, self.mounts, self.extra, sorted(out.items())]
        if any(SERVICE_IN_CONTAINER in m for m in self.mounts):
            spec.append(SERVICE_PY)  # a changed service script recreates the container
        out[SPEC_LABEL] = hashlib.sha256(json.dumps(spec).encode()).hexdigest()[:16]
        return out

    def run_argv(self) -> list[str]:
        argv = ["run", "-d", "--name", self.name, "--network", "host", "--restart", "no"]
        for k, v in self.labels().items():
            argv += ["--label", f"{k}={v}"]
        for k, v in self.env.items():
            argv += ["--env", f"{k}={v}"]
        for m in self.mounts:
            argv += ["--volume", m]
        return [*argv, *self.extra, self.image, *self.args]

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}{self.health_path}"


def plan(specs: list[LabNode], params: dict[str, Any], base_image: str) -> list[OldContainer]:
    """The old deployment for these nodes, from the lab params (installed image, model cache)."""
    installed = params["runtime"]["installed_image"]
    cache = params.get("model", {}).get("cache_dir", "/srv/models")
    env = dict(params.get("runtime", {}).get("env", {}))
    out: list[OldContainer] = []
    head = specs[0]
    script = service_script()
    svc = ["python3", SERVICE_IN_CONTAINER]
    svc_mount = [f"{script}:{SERVICE_IN_CONTAINER}:ro"]
    out.append(OldContainer(
        head.name, "old-vllm", installed, "model-server", 8000,
        ["vllm", "serve", f"{cache}/{OLD_MODEL}", "--served-model-name", OLD_MODEL, "--host", head.ip,
         "--port", "8000", "--dtype", "float32", "--enforce-eager", "--max-model-len", "1024",
         "--kv-cache-memory-bytes", "64M", "--max-num-seqs", "4", "--model-impl", "vllm"],
        env={**env, "VLLM_CPU_OMP_THREADS_BIND": "0", "VLLM_CACHE_ROOT": "/tmp/vllm-cache",
             "OMP_NUM_THREADS": "1"},
        mounts=[f"{cache}:{cache}:ro"], extra=["--cpuset-cpus", "0", "--shm-size", "512m"], host=head.ip))
    out.append(OldContainer(head.name, "old-proxy", base_image, "proxy", 8080,
                            [*svc, "proxy", "8080", "16", f"http://{head.ip}:8000"], depends_on=["old-vllm"],
                            mounts=svc_mount,
                            health_path="/proxy/health", host=head.ip))
    if len(specs) > 1:
        w = specs[1]
        out.append(OldContainer(w.name, "old-embeddings", base_image, "embeddings", 8001,
                                [*svc, "embeddings", "8001", str(MEMORY_HOLD_MIB)], mounts=svc_mount,
                                host=w.ip))
        out.append(OldContainer(w.name, "old-reranker", base_image, "reranker", 8002,
                                [*svc, "reranker", "8002", str(MEMORY_HOLD_MIB)], mounts=svc_mount,
                                host=w.ip))
    for s, (role, port) in zip(specs, MANAGED_ROLES, strict=False):  # the seed's first two nodes
        out.append(OldContainer(s.name, MANAGED_NAME, base_image, role, port, [], host=s.ip, managed=True))
    _check_allow_lists(out, params, manager_argv(specs, base_image))
    return out


def _check_allow_lists(out: list[OldContainer], params: dict[str, Any], manager: list[str]) -> None:
    """The lab's containers are on cleanup.containers, the manager's command line on cleanup.processes, and its
    containers on NO allow-list (01 must find them through their owner)."""
    cleanup = params.get("cleanup", {})
    allow, procs = cleanup.get("containers", []), cleanup.get("processes", [])
    for c in out:
        if c.managed == any(fnmatch.fnmatchcase(c.name, pat) for pat in allow):
            raise LabError(f"old deployment container {c.name} {'is' if c.managed else 'is not'} in the params' "
                           f"cleanup.containers {allow}" + (" (its manager owns it)" if c.managed else ""))
    if not any(fnmatch.fnmatchcase(shlex.join(manager), pat) for pat in procs):
        raise LabError(f"the old cluster manager ({shlex.join(manager)}) is not in the params' cleanup.processes "
                       f"{procs}")


def _docker(s: LabNode, *args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess[str]:
    return run(["docker", "-H", s.docker_host, *args], timeout=timeout, check=check)


def containers(s: LabNode) -> list[dict[str, Any]]:
    """All containers of a node's daemon: name, image, state, status, labels."""
    ids = _docker(s, "ps", "-aq", "--no-trunc").stdout.split()
    if not ids:
        return []
    rows = []
    for d in json.loads(_docker(s, "inspect", *ids).stdout):
        st = d["State"]
        rows.append({"name": d["Name"].lstrip("/"), "image": d["Config"]["Image"], "state": st["Status"],
                     "status": f"{st['Status']} (exit {st['ExitCode']})" if st["Status"] == "exited"
                     else st["Status"], "id": d["Id"][:12], "labels": d["Config"].get("Labels") or {},
                     "started_at": st.get("StartedAt")})
    return rows


def remove_extras(specs: list[LabNode], params: dict[str, Any], base_image: str,
                  progress: Progress = None) -> list[str]:
    """Remove every container that is not part of the old deployment (what a previous runbook run left:
    new vLLM servers, Ray containers), so the lab starts from its initial state. Returns what was removed."""
    names = {c.name for c in plan(specs, params, base_image) if not c.managed}
    removed = []
    for s in specs:
        extra = [c["name"] for c in containers(s) if c["name"] not in names]
        if extra:
            _say(progress, f"{s.name}: removing containers not in the initial state: {' '.join(extra)}")
            _docker(s, "rm", "-f", *extra)
            removed += [f"{s.name}/{n}" for n in extra]
    return removed


def ensure(specs: list[LabNode], params: dict[str, Any], base_image: str, progress: Progress = None) -> list[str]:
    """(Re)create the old deployment containers that are not running as planned; returns what was started."""
    want = plan(specs, params, base_image)
    actions = []
    for s in specs:
        have = {c["name"]: c for c in containers(s)}
        for c in (c for c in want if c.node == s.name and not c.managed):
            cur = have.get(c.name)
            if (cur is not None and cur["state"] == "running"
                    and cur["labels"].get(SPEC_LABEL) == c.labels()[SPEC_LABEL]):
                continue
            if cur is not None:
                _docker(s, "rm", "-f", c.name)
            _say(progress, f"{s.name}: starting old deployment container {c.name} ({c.image})")
            _docker(s, *c.run_argv())
            actions.append(f"{s.name}/{c.name}")
    return actions


def wait_ready(specs: list[LabNode], params: dict[str, Any], base_image: str, timeout: float = 180,
               progress: Progress = None, roles: set[str] | None = None) -> dict[str, float]:
    """Until every old-deployment service (of `roles`, default all) answers its health URL;
    returns seconds waited for each. Raises LabError when one exits or the time is up."""
    want = [c for c in plan(specs, params, base_image) if roles is None or c.role in roles]
    by_node = {s.name: s for s in specs}
    t0 = time.monotonic()
    pending = {f"{c.node}/{c.name}": c for c in want}
    done: dict[str, float] = {}
    while pending and time.monotonic() - t0 < timeout:
        for key, c in list(pending.items()):
            name = c.name
            try:
                with _OPENER.open(c.url, timeout=2) as r:
                    if r.status == 200:
                        done[key] = round(time.monotonic() - t0, 1)
                        del pending[key]
                        _say(progress, f"{c.node}: {name} answers {c.url} ({done[key]}s)")
                        continue
            except OSError:
                pass
            st = _docker(by_node[c.node], "inspect", "--format", "{{.State.Status}}", name, check=False)
            if st.stdout.strip() not in ("running", "created", "restarting") and not c.managed:
                logs = _docker(by_node[c.node], "logs", "--tail", "30", name, check=False)
                raise LabError(f"{c.node}: old deployment container {name} is {st.stdout.strip() or 'gone'}:\n"
                               f"{(logs.stdout + logs.stderr)[-3000:]}")
        if pending:
            time.sleep(1)
    if pending:
        raise LabError(f"old deployment not ready after {timeout}s: {sorted(pending)}")
    return done


def _on_head(head: LabNode, command: str, timeout: float = 30,
             check: bool = True) -> subprocess.CompletedProcess[str]:
    return run(["ssh", "-F", str(ssh_config_file()), head.ip, command], timeout=timeout, check=check)


def manager_pid(head: LabNode) -> int | None:
    """The running manager's PID (in the head's PID namespace) from its pidfile, when that process's command
    line is the manager's; None when it does not run."""
    out = _on_head(head, f"p=$(cat {MANAGER_PIDFILE} 2>/dev/null) && echo $p && tr '\\0' ' ' < /proc/$p/cmdline",
                   check=False).stdout.split("\n", 1)
    return int(out[0]) if len(out) == 2 and out[0].isdigit() and MANAGER_NAME in out[1] else None


def start_manager(specs: list[LabNode], base_image: str, progress: Progress = None) -> list[str]:
    """Start the old cluster manager on the head (detached, like a unit) unless it runs; returns what it did."""
    head = specs[0]
    if manager_pid(head) is not None:
        return []
    argv = manager_argv(specs, base_image)
    _say(progress, f"{head.name}: starting the old cluster manager ({MANAGED_NAME} on every node)")
    _on_head(head, f"cd / && {{ setsid {shlex.join(argv)} </dev/null >/dev/null 2>&1 & }}")
    for _ in range(20):
        if (pid := manager_pid(head)) is not None:
            return [f"{head.name}/old-cluster-manager[{pid}]"]
        time.sleep(0.5)
    raise LabError(f"{head.name}: the old cluster manager did not write {MANAGER_PIDFILE}; see {MANAGER_LOG} there")


def stop_manager(specs: list[LabNode], progress: Progress = None, timeout: float = STOP_TIMEOUT_S) -> list[str]:
    """SIGTERM to the manager's PID (it stops its containers on every node), then wait for it to exit."""
    head = specs[0]
    pid = manager_pid(head)
    if pid is None:
        return []
    _say(progress, f"{head.name}: stopping the old cluster manager (pid {pid})")
    _on_head(head, f"kill -TERM {pid}; for i in $(seq {int(timeout)}); do kill -0 {pid} 2>/dev/null || exit 0; "
                   "sleep 1; done; echo still running; exit 1", timeout=timeout + 15)
    return [f"stop {head.name}/old-cluster-manager[{pid}]"]


def health(c: dict[str, Any], ip: str) -> bool | None:
    """For a container dict of :func:`containers` with a lab port label: does it answer? None: not ours."""
    port = c["labels"].get(f"{LABEL}.port")
    if not port or c["labels"].get(DEPLOYMENT_LABEL) != "old":
        return None
    path = "/proxy/health" if c["labels"].get(ROLE_LABEL) == "proxy" else "/health"
    try:
        with _OPENER.open(f"http://{ip}:{port}{path}", timeout=2) as r:
            return bool(r.status == 200)
    except OSError:
        return False


def _say(progress: Progress, msg: str) -> None:
    if progress is not None:
        progress(msg)
