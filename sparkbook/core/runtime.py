"""Where vLLM runs on a node: a Docker container (docker-py over SSH) or a Python environment on the host.

`Runtime` is the one interface the stages use; DockerNodes and PythonNodes implement it, `runtime_for(params)`
picks one, and no stage asks which it got. Its verbs:
  candidates()                    what 03 may choose from (image refs / the interpreter)
  image(node, ref)                (ID, size) of an image the node holds; None where it holds none (or no images)
  lacks(node, ref, image_id)      why the node cannot start a place of `ref`, as a fact ('' where it can)
  identity(node, ref)             what must be the same on every node (the image ID / the environment's vLLM)
  copies_images                   whether 03 copies images to the nodes (False: each node has its own env)
  installed() / no_installed_reason()    the old deployment's image to probe, or why there is none
  preflight(cluster)              every node can start places (its Docker daemon answers) -> FanOut
  devices(node)                   host devices a place gets (InfiniBand, unless privileged)
  existing(node, place) / not_reusable   a place a previous run left, as it stands now / why none is reused
  one_off(node, image, argv)      a short command in a fresh container / in the environment
  start(node, image, name, env)   a long-lived place to exec in (a container; nothing for a Python env)
  exec(node, name, argv)          a command in that place, with a node-side timeout
  spawn(node, name, argv, log)    a background process (its own session) writing to a log file -> Spawned
  running / kill (node, name, spawned)   is that process alive / end its whole session, by its ID
  stop(node, name)                remove the place and everything spawned in it
"""
from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Protocol, runtime_checkable

import docker
import docker.errors

from .docker_ssh import docker_client
from .nodes import KILL_GRACE_S, Cluster, FanOut, Node, NodeError, Result
from .params import DockerRuntime, Params, PythonRuntime

LABEL = "org.sparkbook.run"
ID_TIMEOUT_S = 30
DAEMON_TIMEOUT_S = 20


@dataclass(frozen=True)
class Place:
    """A named place on a node where commands of one stage run (a container, or a PID directory)."""

    node: str
    name: str
    image: str | None = None
    env: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Existing:
    """A place as a previous run left it on a node: what 04 compares with the place it would start."""

    id: str
    status: str
    image_id: str
    env: dict[str, str]
    devices: list[str]
    started_at: str


@dataclass(frozen=True)
class Spawned:
    """A background process started by `spawn`: its log and the file holding its session ID."""

    node: str
    place: str
    log: str

    @property
    def pid_file(self) -> str:
        return f"{self.log}.pid"


# Start argv as the leader of a new session, its ID in "$1.pid", output to "$1" ($0 is the log path).
_SPAWN = 'mkdir -p "$(dirname "$0")"; exec setsid sh -c \'echo $$ >"$0.pid"; exec "$@" >"$0" 2>&1 </dev/null\' "$0" "$@"'
# 0 if the session leader in "$0" is alive and not a zombie.
_RUNNING = 'p=$(cat "$0" 2>/dev/null) && s=$(cut -d")" -f2 "/proc/$p/stat" 2>/dev/null) && case $s in " Z"*|" X"*) exit 1;; esac'
# TERM the session leader's process group, wait up to $1 s, then KILL what is left.
_KILL = ('p=$(cat "$0" 2>/dev/null) || exit 0; kill -TERM -"$p" 2>/dev/null; i=0; '
         'while kill -0 -"$p" 2>/dev/null && [ $i -lt "$1" ]; do sleep 1; i=$((i+1)); done; kill -KILL -"$p" 2>/dev/null; '
         'rm -f "$0"; exit 0')


def _timeout_argv(argv: Sequence[str], timeout: float) -> list[str]:
    return ["timeout", "-k", str(KILL_GRACE_S), f"{timeout:g}", *argv]


@runtime_checkable
class Runtime(Protocol):
    """Where the stages run vLLM on a node, whatever it is (see the module's docstring for the verbs)."""

    copies_images: bool  # whether 03 copies an image to every node (else each node runs its own environment)
    not_reusable: str  # why a running cluster a previous run left is never reused ('' where it may be)

    def candidates(self) -> list[str]:
        """What 03 chooses among: the image refs of params, or the interpreter of the Python environment."""

    def image(self, node: Node, ref: str) -> tuple[str, int] | None:
        """(ID, size in bytes) of image `ref` on the node; None where it holds none (nothing is pulled)."""

    def lacks(self, node: Node, ref: str, image_id: str | None = None) -> str:
        """Why the node cannot start a place of `ref` (holding `image_id` where given), as a fact; '' if it can."""

    def identity(self, node: Node, ref: str) -> str | None:
        """What must be the same on every node for `ref`; None where the node has none."""

    def installed(self) -> str | None:
        """The old deployment's image, to probe; None where there is none."""

    def no_installed_reason(self) -> str:
        """Why there is no installed image to probe."""

    def preflight(self, cluster: Cluster) -> FanOut[None]:
        """Every node asked in parallel whether it can start places; a failed outcome says why."""

    def devices(self, node: Node) -> list[str]:
        """The host devices a place on the node gets."""

    def existing(self, node: Node, place: Place) -> Existing | None:
        """The place as a previous run left it; None where there is none."""

    def one_off(self, node: Node, image: str | None, argv: Sequence[str], *, env: dict[str, str] | None = None,
                timeout: float = 120, gpus: bool = False) -> Result:
        """argv in a fresh container of `image` (or the environment): no network, model cache read-only; with the
        node's GPUs where `gpus`."""

    def start(self, node: Node, place: Place, *, gpus: bool, devices: Sequence[str] = ()) -> str:
        """(Re)create the place; its ID."""

    def exec(self, node: Node, place: Place, argv: Sequence[str], *, timeout: float = 120,
             env: dict[str, str] | None = None) -> Result:
        """argv in the place, with a node-side timeout."""

    def spawn(self, node: Node, place: Place, argv: Sequence[str], log: str, *,
              env: dict[str, str] | None = None) -> Spawned:
        """argv in the background in its own session, stdout and stderr to `log`."""

    def running(self, node: Node, place: Place, spawned: Spawned) -> bool:
        """Whether the spawned process still runs."""

    def kill(self, node: Node, place: Place, spawned: Spawned, *, grace_s: int = 10) -> None:
        """End the spawned process and its whole session, TERM then KILL."""

    def read(self, node: Node, place: Place, path: str, *, tail_bytes: int = 0) -> str:
        """A file as the place sees it (its last `tail_bytes` where given)."""

    def alive(self, node: Node, place: Place) -> bool:
        """Whether the place stands (its container runs / a process it spawned lives)."""

    def stop(self, node: Node, place: Place) -> bool:
        """Remove the place and everything spawned in it; True if there was one."""

    def close(self) -> None:
        """Release what the runtime holds of its own."""


class DockerNodes:
    """Containers from the run's image on each node, through each node's own Docker daemon."""

    copies_images = True
    not_reusable = ""

    def __init__(self, spec: DockerRuntime, model_cache: str, secrets: dict[str, str] | None = None):
        self.spec, self.model_cache, self.secrets = spec, model_cache, secrets or {}

    def candidates(self) -> list[str]:
        return list(self.spec.images)

    def image(self, node: Node, ref: str) -> tuple[str, int] | None:
        """(ID, size in bytes) of `ref` in the node's daemon, None where it has no such image."""
        result = node.run(["docker", "image", "inspect", "--format", "{{.Id}} {{.Size}}", ref], timeout=ID_TIMEOUT_S)
        if not result.ok or len(result.stdout.split()) != 2:
            return None
        image_id, size = result.stdout.split()
        return image_id, int(size)

    def lacks(self, node: Node, ref: str, image_id: str | None = None) -> str:
        held = self.identity(node, ref)
        if held is None or (image_id and held != image_id):
            return (f"holds {'no' if held is None else 'another'} {ref} ({held or 'absent'}; "
                    f"expected {image_id or 'any'})")
        return ""

    def identity(self, node: Node, ref: str) -> str | None:
        """The image ID of `ref` on the node."""
        held = self.image(node, ref)
        return held[0] if held else None

    def installed(self) -> str | None:
        return self.spec.installed_image

    def no_installed_reason(self) -> str:
        return "runtime.installed_image is not set: no old deployment's image to probe; 03 probes the candidates"

    def preflight(self, cluster: Cluster) -> FanOut[None]:
        """Every node's Docker daemon asked in parallel (`_daemon_answers`)."""
        return cluster.fan_out(_daemon_answers, timeout=DAEMON_TIMEOUT_S + cluster.params.ssh.connect_timeout_s + 15)

    def devices(self, node: Node) -> list[str]:
        """/dev/infiniband where the node has it (a privileged container sees every device anyway)."""
        if self.spec.privileged:
            return []
        return ["/dev/infiniband"] if node.run(["test", "-d", "/dev/infiniband"], timeout=15).ok else []

    def existing(self, node: Node, place: Place) -> Existing | None:
        try:
            attrs = self.client(node).containers.get(place.name).attrs
        except docker.errors.NotFound:
            return None
        return Existing(attrs["Id"], attrs["State"]["Status"], attrs["Image"],
                        dict(e.split("=", 1) for e in attrs["Config"]["Env"] or []),
                        [d["PathOnHost"] for d in attrs["HostConfig"].get("Devices") or []],
                        attrs["State"]["StartedAt"])

    def client(self, node: Node) -> docker.DockerClient:
        """The node's Docker client (docker_ssh keeps one per node, shared with the run's other steps)."""
        try:
            return docker_client(node)
        except docker.errors.DockerException as exc:
            raise NodeError(node.name, f"its Docker daemon does not answer: {exc}") from None

    def one_off(self, node: Node, image: str | None, argv: Sequence[str], *, env: dict[str, str] | None = None,
                timeout: float = 120, gpus: bool = False) -> Result:
        """argv in a fresh container of `image`: no network, model cache read-only, removed; `--gpus all` where `gpus`.

        This is the node's own `docker run --rm` in one SSH call: a probe costs about a second less than
        docker-py's round trips, which keeps the registry probe within its 3 s. The command inside carries
        its own timeout, so the daemon removes the container even if the CLI is killed. The image's
        ENTRYPOINT (vLLM's official images: `vllm serve`) is replaced by that timeout, as vLLM's
        run_cluster.sh replaces it. No secret goes in: without a network, nothing could use it."""
        cache = self.model_cache
        flags = [a for k, v in {**self.spec.env, **(env or {})}.items() for a in ("-e", f"{k}={v}")]
        if gpus:
            flags += ["--gpus", "all"]
        entrypoint, *command = _timeout_argv(argv, timeout)
        return node.run(["docker", "run", "--rm", "--pull", "never", "--network", "none", "--label",
                         f"{LABEL}=one-off", "-v", f"{cache}:{cache}:ro", *flags, "--entrypoint", entrypoint,
                         str(image), *command], timeout=timeout + 30)

    def start(self, node: Node, place: Place, *, gpus: bool, devices: Sequence[str] = ()) -> str:
        """(Re)create the place's container: host network, shm, model cache, env and the params' secrets (through
        the Docker API, never on a command line), an init that reaps orphans (killed serve processes leave
        children), `sleep infinity` as its entrypoint whatever the image declares; returns its ID."""
        client = self.client(node)
        self.stop(node, place)
        kwargs: dict[str, object] = dict(
            name=place.name, entrypoint=["sleep", "infinity"], detach=True, network_mode="host", init=True,
            shm_size=self.spec.shm_size, environment={**self.spec.env, **place.env, **self.secrets},
            labels={LABEL: place.name},
            volumes={self.model_cache: {"bind": self.model_cache, "mode": "rw"}}, privileged=self.spec.privileged,
            ulimits=[docker.types.Ulimit(name="nofile", soft=self.spec.nofile, hard=self.spec.nofile)]
            if self.spec.nofile else [],
            devices=[f"{d}:{d}" for d in devices])
        if self.spec.ipc_host:
            kwargs["ipc_mode"] = "host"
        if gpus:
            kwargs["device_requests"] = [docker.types.DeviceRequest(count=-1, capabilities=[["gpu"]])]
        return client.containers.run(place.image, **kwargs).id

    def exec(self, node: Node, place: Place, argv: Sequence[str], *, timeout: float = 120,
             env: dict[str, str] | None = None) -> Result:
        started, t0 = datetime.now(UTC), time.monotonic()
        container = self.client(node).containers.get(place.name)
        code, (out, err) = container.exec_run(_timeout_argv(argv, timeout), environment=env or {}, demux=True)
        return Result(node.name, tuple(argv), code, (out or b"").decode(errors="replace"),
                      (err or b"").decode(errors="replace"), started, time.monotonic() - t0, code in (124, 137))

    def spawn(self, node: Node, place: Place, argv: Sequence[str], log: str, *,
              env: dict[str, str] | None = None) -> Spawned:
        """Start argv in the background inside the container, stdout and stderr to `log` (a container path)."""
        container = self.client(node).containers.get(place.name)
        container.exec_run(["sh", "-c", _SPAWN, log, *argv], environment=env or {}, detach=True)
        return Spawned(node.name, place.name, log)

    def running(self, node: Node, place: Place, spawned: Spawned) -> bool:
        """Whether the spawned process still runs (False once its container is gone)."""
        return self.alive(node, place) and self.exec(node, place, ["sh", "-c", _RUNNING, spawned.pid_file],
                                                     timeout=15).ok

    def kill(self, node: Node, place: Place, spawned: Spawned, *, grace_s: int = 10) -> None:
        """End the spawned process and its children (its process group), TERM then KILL."""
        if self.alive(node, place):
            self.exec(node, place, ["sh", "-c", _KILL, spawned.pid_file, str(grace_s)], timeout=grace_s + 15)

    def read(self, node: Node, place: Place, path: str, *, tail_bytes: int = 0) -> str:
        argv = ["tail", "-c", str(tail_bytes), path] if tail_bytes else ["cat", path]
        return self.exec(node, place, argv, timeout=30).stdout

    def alive(self, node: Node, place: Place) -> bool:
        try:
            return self.client(node).containers.get(place.name).status == "running"
        except docker.errors.NotFound:
            return False

    def stop(self, node: Node, place: Place) -> bool:
        """Remove the place's container; True if there was one."""
        try:
            self.client(node).containers.get(place.name).remove(force=True)
            return True
        except docker.errors.NotFound:
            return False

    def close(self) -> None:
        """Nothing of its own to close: the Docker clients ride on the nodes' SSH connections, closed with the run."""


def _daemon_answers(node: Node) -> None:
    """Raise unless the node's Docker daemon answers `docker version` within DAEMON_TIMEOUT_S."""
    r = node.run(["docker", "version", "--format", "{{.Server.Version}}"], timeout=DAEMON_TIMEOUT_S)
    if not r.ok:
        why = f"no answer within {DAEMON_TIMEOUT_S} s" if r.timed_out else (r.stderr or r.stdout).strip()[-300:]
        raise NodeError(node.name, f"its Docker daemon does not answer ({why}): start it and run 04 again")


# commands the stages start by name, as modules of the Python runtime's interpreter
MODULES = {"ray": "ray.scripts.scripts", "vllm": "vllm.entrypoints.cli.main"}
_VLLM_VERSION = "import importlib.metadata as m; print('vLLM ' + m.version('vllm'))"


class PythonNodes:
    """A Python environment on each node (no Docker): the interpreter named in params runs everything."""

    copies_images = False
    not_reusable = "the Python runtime keeps no container to compare: Ray is started afresh"

    def __init__(self, spec: PythonRuntime, secrets: dict[str, str] | None = None):
        self.spec, self.secrets = spec, secrets or {}

    def candidates(self) -> list[str]:
        return [self.spec.python]

    def image(self, node: Node, ref: str) -> tuple[str, int] | None:
        """A Python environment has no image."""
        return None

    def lacks(self, node: Node, ref: str, image_id: str | None = None) -> str:
        """Nothing to hold: each node runs its own environment."""
        return ""

    def identity(self, node: Node, ref: str) -> str | None:
        """The vLLM version of the node's interpreter ("vLLM X.Y.Z"); None where it has no vLLM."""
        return self.one_off(node, None, ["python", "-c", _VLLM_VERSION], timeout=60).stdout.strip() or None

    def installed(self) -> str | None:
        return None

    def no_installed_reason(self) -> str:
        return (f"runtime python: vLLM runs in the environment of {self.spec.python} on each node, there is no "
                "installed image to probe; 03 asks that environment's own vLLM (registry and inspection)")

    def preflight(self, cluster: Cluster) -> FanOut[None]:
        """Nothing to ask: the interpreter runs where the node's commands run."""
        return FanOut()

    def devices(self, node: Node) -> list[str]:
        return []

    def existing(self, node: Node, place: Place) -> Existing | None:
        return None

    def _env(self, extra: dict[str, str] | None) -> dict[str, str]:
        bindir = self.spec.python.rsplit("/", 1)[0]
        return {"PATH": f"{bindir}:/usr/local/bin:/usr/bin:/bin", **self.spec.env, **(extra or {})}

    def _argv(self, argv: Sequence[str]) -> list[str]:
        """`python`/`python3` is the params' interpreter; the `ray` and `vllm` commands are its modules, so the
        environment's own Ray and vLLM run whatever scripts (or none) its bin directory holds."""
        if not argv:
            return []
        head, rest = argv[0], list(argv[1:])
        if head in ("python", "python3"):
            return [self.spec.python, *rest]
        if head in MODULES:
            return [self.spec.python, "-m", MODULES[head], *rest]
        return list(argv)

    def one_off(self, node: Node, image: str | None, argv: Sequence[str], *, env: dict[str, str] | None = None,
                timeout: float = 120, gpus: bool = False) -> Result:
        """The environment sees the host's GPUs as it is (`gpus` changes nothing)."""
        return node.run(self._argv(argv), env=self._env(env), timeout=timeout)

    def start(self, node: Node, place: Place, *, gpus: bool, devices: Sequence[str] = ()) -> str:
        self.stop(node, place)
        node.run(["mkdir", "-p", self._dir(place)], check=True, timeout=30)
        return self._dir(place)

    def exec(self, node: Node, place: Place, argv: Sequence[str], *, timeout: float = 120,
             env: dict[str, str] | None = None) -> Result:
        return node.run(self._argv(argv), env=self._env({**place.env, **(env or {})}), timeout=timeout)

    def spawn(self, node: Node, place: Place, argv: Sequence[str], log: str, *,
              env: dict[str, str] | None = None) -> Spawned:
        """setsid the process into its own session; its session ID goes to `log`.pid and to the place's list.
        The params' secrets reach it exported from stdin (`KEY=value` lines), never on its command line."""
        script = ('while IFS= read -r kv; do export "$kv"; done; mkdir -p "$(dirname "$1")"; '
                  'setsid sh -c \'echo $$ >>"$0"/sids; echo $$ >"$1.pid"; '
                  'l=$1; shift; exec "$@" >"$l" 2>&1 </dev/null\' "$0" "$1" "${@:2}" </dev/null >/dev/null 2>&1 &')
        secrets = "".join(f"{k}={v}\n" for k, v in self.secrets.items()).encode()
        node.run(["bash", "-c", script, self._dir(place), log, *self._argv(argv)],
                 env=self._env({**place.env, **(env or {})}), stdin=secrets, timeout=30, check=True)
        return Spawned(node.name, place.name, log)

    def running(self, node: Node, place: Place, spawned: Spawned) -> bool:
        return node.run(["sh", "-c", _RUNNING, spawned.pid_file], timeout=15).ok

    def kill(self, node: Node, place: Place, spawned: Spawned, *, grace_s: int = 10) -> None:
        node.run(["sh", "-c", _KILL, spawned.pid_file, str(grace_s)], timeout=grace_s + 15)

    def read(self, node: Node, place: Place, path: str, *, tail_bytes: int = 0) -> str:
        argv = ["tail", "-c", str(tail_bytes), path] if tail_bytes else ["cat", path]
        return node.run(argv, timeout=30).stdout

    def alive(self, node: Node, place: Place) -> bool:
        sids = node.run(["cat", f"{self._dir(place)}/sids"], timeout=30).stdout.split()
        return any(node.run(["pgrep", "-s", sid], timeout=30).ok for sid in sids)

    def stop(self, node: Node, place: Place) -> bool:
        """Kill every process of the sessions this place spawned (by session ID, never by name)."""
        sids = node.run(["cat", f"{self._dir(place)}/sids"], timeout=30).stdout.split()
        for sid in sids:
            node.run(["pkill", "-TERM", "-s", sid], timeout=30)
        if sids:
            time.sleep(2)
            for sid in sids:
                node.run(["pkill", "-KILL", "-s", sid], timeout=30)
        node.run(["rm", "-rf", self._dir(place)], timeout=30)
        return bool(sids)

    @staticmethod
    def _dir(place: Place) -> str:
        return f"/tmp/sparkbook/{place.name}"

    def close(self) -> None:
        pass


def runtime_for(params: Params) -> Runtime:
    if isinstance(params.runtime, DockerRuntime):
        return DockerNodes(params.runtime, params.model.cache_dir, params.secret_values())
    return PythonNodes(params.runtime, params.secret_values())
