"""The lab's "old deployment": what the runbook's cleanup stage finds running, shaped like the seed's.

head (node 0):   old-vllm        the installed (old) vLLM image serving the qwen3-tiny model on :8000
                 old-proxy       base image, a small reverse proxy :8080 -> :8000 (depends on old-vllm)
worker (node 1): old-embeddings  base image, python holding ~256 MiB, answering HTTP on :8001
                 old-reranker    base image, python holding ~256 MiB, answering HTTP on :8002
further workers: nothing.

Every container has ``--network host`` (it lives in its node's network namespace and answers on the
node's IP), restart policy ``no``, and labels saying it is part of the old deployment, what it is and
what it depends on. The container names must match the cleanup allow-list of the lab's params file;
:func:`plan` checks that, so the cleanup stage can rely on params alone.
"""
from __future__ import annotations

import fnmatch
import hashlib
import json
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

from .cluster import LabError, NodeSpec, lab_home, run

Progress = Optional[Callable[[str], None]]

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


def service_script() -> Path:
    """SERVICE_PY as a file under LAB_HOME (bind-mounted read-only into the base-image containers)."""
    path = lab_home() / "services" / "old_service.py"
    if not path.exists() or path.read_text() != SERVICE_PY:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(SERVICE_PY)
    return path


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


def plan(specs: list[NodeSpec], params: dict, base_image: str) -> list[OldContainer]:
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
    allow = params.get("cleanup", {}).get("containers", [])
    for c in out:
        if not any(fnmatch.fnmatchcase(c.name, pat) for pat in allow):
            raise LabError(f"old deployment container {c.name} is not in the params' cleanup.containers {allow}")
    return out


def _docker(s: NodeSpec, *args: str, timeout: float = 120, check: bool = True):
    return run(["docker", "-H", s.docker_host, *args], timeout=timeout, check=check)


def containers(s: NodeSpec) -> list[dict]:
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


def remove_extras(specs: list[NodeSpec], params: dict, base_image: str, progress: Progress = None) -> list[str]:
    """Remove every container that is not part of the old deployment (what a previous runbook run left:
    new vLLM servers, Ray containers), so the lab starts from its initial state. Returns what was removed."""
    names = {c.name for c in plan(specs, params, base_image)}
    removed = []
    for s in specs:
        extra = [c["name"] for c in containers(s) if c["name"] not in names]
        if extra:
            _say(progress, f"{s.name}: removing containers not in the initial state: {' '.join(extra)}")
            _docker(s, "rm", "-f", *extra)
            removed += [f"{s.name}/{n}" for n in extra]
    return removed


def ensure(specs: list[NodeSpec], params: dict, base_image: str, progress: Progress = None) -> list[str]:
    """(Re)create the old deployment containers that are not running as planned; returns what was started."""
    want = plan(specs, params, base_image)
    actions = []
    for s in specs:
        have = {c["name"]: c for c in containers(s)}
        for c in (c for c in want if c.node == s.name):
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


def wait_ready(specs: list[NodeSpec], params: dict, base_image: str, timeout: float = 180,
               progress: Progress = None, roles: Optional[set[str]] = None) -> dict[str, float]:
    """Until every old-deployment service (of `roles`, default all) answers its health URL;
    returns seconds waited for each. Raises LabError when one exits or the time is up."""
    want = [c for c in plan(specs, params, base_image) if roles is None or c.role in roles]
    by_node = {s.name: s for s in specs}
    t0 = time.monotonic()
    pending = {c.name: c for c in want}
    done: dict[str, float] = {}
    while pending and time.monotonic() - t0 < timeout:
        for name, c in list(pending.items()):
            try:
                with _OPENER.open(c.url, timeout=2) as r:
                    if r.status == 200:
                        done[name] = round(time.monotonic() - t0, 1)
                        del pending[name]
                        _say(progress, f"{c.node}: {name} answers {c.url} ({done[name]}s)")
                        continue
            except OSError:
                pass
            st = _docker(by_node[c.node], "inspect", "--format", "{{.State.Status}}", name, check=False)
            if st.stdout.strip() not in ("running", "created", "restarting"):
                logs = _docker(by_node[c.node], "logs", "--tail", "30", name, check=False)
                raise LabError(f"{c.node}: old deployment container {name} is {st.stdout.strip() or 'gone'}:\n"
                               f"{(logs.stdout + logs.stderr)[-3000:]}")
        if pending:
            time.sleep(1)
    if pending:
        raise LabError(f"old deployment not ready after {timeout}s: {sorted(pending)}")
    return done


def health(c: dict, ip: str) -> Optional[bool]:
    """For a container dict of :func:`containers` with a lab port label: does it answer? None: not ours."""
    port = c["labels"].get(f"{LABEL}.port")
    if not port or c["labels"].get(DEPLOYMENT_LABEL) != "old":
        return None
    path = "/proxy/health" if c["labels"].get(ROLE_LABEL) == "proxy" else "/health"
    try:
        with _OPENER.open(f"http://{ip}:{port}{path}", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def _say(progress: Progress, msg: str) -> None:
    if progress is not None:
        progress(msg)
