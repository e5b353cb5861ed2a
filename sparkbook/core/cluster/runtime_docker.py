"""vLLM in Docker containers, through each node's own Docker daemon: process control (`DockerNodes`) and the
candidate images 03 chooses among (`DockerImages`)."""
from __future__ import annotations

import io
import json
import shlex
import tarfile
import time
import uuid
from collections.abc import Sequence
from datetime import UTC, datetime

import docker
import docker.errors
from docker.models.containers import Container

from ..values.fanout import FanOut
from ..values.params import DockerRuntime
from .docker_ssh import docker_client
from .nodes import Cluster, Node, NodeError, Result, ended_by_timeout, with_timeout
from .runtime import (
    ID_TIMEOUT_S,
    KILL_SH,
    RUNNING_SH,
    SECRETS_SH,
    SPAWN_SH,
    Existing,
    Place,
    Spawned,
    StartSpec,
    Ulimit,
    aside,
    killed,
)
from .topology import LOG_DIR

LABEL = "org.sparkbook.run"  # on every container sparkbook starts
DAEMON_TIMEOUT_S = 20



def _secrets_archive(name: str, secrets: dict[str, str]) -> bytes:
    """A tar of one file `name`, mode 0600 and root's: the secrets as shell assignments SECRETS_SH exports."""
    text = "".join(f"{k}={shlex.quote(v)}\n" for k, v in secrets.items()).encode()
    info = tarfile.TarInfo(name)
    info.size, info.mode = len(text), 0o600
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        tar.addfile(info, io.BytesIO(text))
    return buffer.getvalue()


class DockerNodes:
    """Containers from the run's image on each node, through each node's own Docker daemon."""

    not_reusable: str | None = None
    place_word = "container"
    own_place = True

    def __init__(self, spec: DockerRuntime, model_cache: str, secrets: dict[str, str] | None = None,
                 cache_dir: str | None = None):
        self.spec, self.model_cache, self.secrets, self.cache_dir = spec, model_cache, secrets or {}, cache_dir

    def lacks(self, node: Node, ref: str, image_id: str | None = None) -> str | None:
        held = image_id_on(node, ref)
        if held is None or (image_id and held != image_id):
            return (f"holds {'no' if held is None else 'another'} {ref} ({held or 'absent'}; "
                    f"expected {image_id or 'any'})")
        return None

    def preflight(self, cluster: Cluster) -> FanOut[None]:
        """Every node's Docker daemon asked in parallel (`_daemon_answers`)."""
        return cluster.fan_out(_daemon_answers, timeout=DAEMON_TIMEOUT_S + cluster.params.ssh.connect_timeout_s + 15)

    def devices(self, node: Node) -> list[str]:
        """/dev/infiniband where the node has it (a privileged container sees every device anyway)."""
        if self.spec.privileged:
            return []
        return ["/dev/infiniband"] if node.run(["test", "-d", "/dev/infiniband"], timeout=15).ok else []

    def rdma_limits(self, node: Node) -> tuple[tuple[Ulimit, ...], tuple[str, ...]]:
        """Ulimits and added capabilities of a node's container: the open-files limit, and where the node has RoCE
        HCAs what RDMA needs to register memory (NCCL's ibv_reg_mr fails without it): memlock unlimited and,
        unless privileged, IPC_LOCK (the anchors' non-privileged variant)."""
        ulimits = (Ulimit("nofile", self.spec.nofile, self.spec.nofile),) if self.spec.nofile else ()
        if not node.spec.roce_hcas:
            return ulimits, ()
        return (*ulimits, Ulimit("memlock", -1, -1)), () if self.spec.privileged else ("IPC_LOCK",)

    def existing(self, node: Node, place: Place) -> Existing | None:
        try:
            attrs = self.client(node).containers.get(place.name).attrs
        except docker.errors.NotFound:
            return None
        host = attrs["HostConfig"]
        ulimits = tuple(f"{u['Name']}={'unlimited' if u['Soft'] == -1 else u['Soft']}"
                        for u in host.get("Ulimits") or [])
        return Existing(attrs["Id"], attrs["State"]["Status"], attrs["Image"],
                        dict(e.split("=", 1) for e in attrs["Config"]["Env"] or []),
                        [d["PathOnHost"] for d in host.get("Devices") or []], attrs["State"]["StartedAt"],
                        tuple(m["Source"] for m in attrs.get("Mounts") or []),
                        ulimits + tuple(f"cap {c}" for c in host.get("CapAdd") or []))

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
        entrypoint, *command = with_timeout(argv, timeout)
        return node.run(["docker", "run", "--rm", "--pull", "never", "--network", "none", "--label",
                         f"{LABEL}=one-off", "-v", f"{cache}:{cache}:ro", *flags, "--entrypoint", entrypoint,
                         str(image), *command], timeout=timeout + 30)

    def start_spec(self, node: Node, place: Place, *, gpus: bool, devices: Sequence[str] = ()) -> StartSpec:
        """The place's container: host network, shm, model cache and compile caches, env (never a secret: `docker
        inspect` would show it to anyone on the node; `spawn` gives them to its processes), an init that reaps orphans
        (killed serve processes leave children), `sleep infinity` as its entrypoint whatever the image declares;
        where the node has RoCE HCAs, what RDMA needs (`rdma_limits`)."""
        ulimits, caps = self.rdma_limits(node)
        return StartSpec(node.name, place.name, place.image, ("sleep", "infinity"), {**self.spec.env, **place.env},
                         tuple(p for p in (self.model_cache, self.cache_dir) if p),
                         ulimits, caps, tuple(devices), gpus, self.spec.privileged, self.spec.ipc_host,
                         self.spec.shm_size, self.spec.memory_limit.lower() if self.spec.memory_limit else None,
                         {LABEL: place.name})

    def start(self, node: Node, spec: StartSpec) -> str:
        """(Re)create the container `spec` describes through docker-py; returns its ID."""
        client = self.client(node)
        self.stop(node, Place(spec.node, spec.name, spec.image))
        kwargs: dict[str, object] = dict(
            name=spec.name, entrypoint=list(spec.command), detach=True, network_mode="host", init=True,
            shm_size=spec.shm_size, environment=spec.env,
            labels=spec.labels, volumes={p: {"bind": p, "mode": "rw"} for p in spec.mounts},
            privileged=spec.privileged, devices=[f"{d}:{d}" for d in spec.devices],
            ulimits=[docker.types.Ulimit(name=u.name, soft=u.soft, hard=u.hard) for u in spec.ulimits],
            cap_add=list(spec.cap_add) or None)
        if spec.ipc_host:
            kwargs["ipc_mode"] = "host"
        if spec.memory_limit:
            kwargs["mem_limit"] = kwargs["memswap_limit"] = spec.memory_limit
        if spec.gpus:
            kwargs["device_requests"] = [docker.types.DeviceRequest(count=-1, capabilities=[["gpu"]])]
        return str(client.containers.run(spec.image, **kwargs).id)

    def exec(self, node: Node, place: Place, argv: Sequence[str], *, timeout: float = 120,
             env: dict[str, str] | None = None) -> Result:
        started, t0 = datetime.now(UTC), time.monotonic()
        container = self.client(node).containers.get(place.name)
        code, (out, err) = container.exec_run(with_timeout(argv, timeout), environment=env or {}, demux=True)
        return Result(node.name, tuple(argv), code, (out or b"").decode(errors="replace"),
                      (err or b"").decode(errors="replace"), started, time.monotonic() - t0, ended_by_timeout(code))

    def spawn(self, node: Node, place: Place, argv: Sequence[str], log: str, *,
              env: dict[str, str] | None = None, secrets: dict[str, str] | None = None) -> Spawned:
        """Start argv in the background inside the container, stdout and stderr to `log` (a container path). The
        secrets go in a file of mode 0600 copied into the container (docker-py's archive upload, no command line),
        which the process's shell exports and removes before it execs argv."""
        container = self.client(node).containers.get(place.name)
        spawn = ["sh", "-c", SPAWN_SH, log, *argv]
        given = {**self.secrets, **(secrets or {})}
        if given:
            name = f"sparkbook-secrets-{uuid.uuid4().hex}.env"
            container.put_archive("/tmp", _secrets_archive(name, given))
            spawn = ["sh", "-c", SECRETS_SH, f"/tmp/{name}", *spawn]
        container.exec_run(spawn, environment=env or {}, detach=True)
        return Spawned(node.name, place.name, log)

    def running(self, node: Node, place: Place, spawned: Spawned) -> bool:
        """Whether the spawned process still runs (False once its container is gone)."""
        return self.alive(node, place) and self.exec(node, place, ["sh", "-c", RUNNING_SH, spawned.pid_file],
                                                     timeout=15).ok

    def kill(self, node: Node, place: Place, spawned: Spawned, *, grace_s: int = 10, drain_s: int = 0) -> None:
        """End the spawned process and its children (its process group), TERM then KILL; with `drain_s`, the
        process alone first (it finishes what it serves)."""
        if self.alive(node, place):
            killed(node, self.exec(node, place, ["sh", "-c", KILL_SH, spawned.pid_file, str(grace_s), str(drain_s)],
                                   timeout=grace_s + drain_s + 15))

    def read(self, node: Node, place: Place, path: str, *, tail_bytes: int = 0) -> str:
        argv = ["tail", "-c", str(tail_bytes), path] if tail_bytes else ["cat", path]
        return self.exec(node, place, argv, timeout=30).stdout

    def alive(self, node: Node, place: Place) -> bool:
        try:
            return bool(self.client(node).containers.get(place.name).status == "running")
        except docker.errors.NotFound:
            return False

    def stop(self, node: Node, place: Place) -> bool:
        """Remove the place's container; True if there was one. A container of that name that sparkbook did not
        start (no org.sparkbook.run label) is someone else's: NodeError, left in place."""
        container = self._ours(node, place.name)
        if container is not None:
            container.remove(force=True)
        return container is not None

    def _ours(self, node: Node, name: str) -> Container | None:
        """The container of that name, None where there is none; NodeError where sparkbook did not start it."""
        try:
            container = self.client(node).containers.get(name)
        except docker.errors.NotFound:
            return None
        if LABEL not in (container.labels or {}):
            raise NodeError(node.name, f"container {name} was not started by sparkbook (no {LABEL} label): "
                                       "it is left in place; rename or remove it yourself, or name another cluster")
        return container

    def set_aside(self, node: Node, place: Place) -> bool:
        """`docker stop` (10 s of grace: Ray and vLLM end with the container) and `docker rename` to aside(name)."""
        container = self._ours(node, place.name)
        if container is None:
            return False
        self.drop_aside(node, place)
        container.stop(timeout=10)
        container.rename(aside(place.name))
        return True

    def bring_back(self, node: Node, place: Place) -> bool:
        """The container kept aside under its name again, started: none of the processes spawned in it runs any
        more, so their PID files go (a restarted container reuses low PIDs: a stale file would name another process,
        and 04 would take a dead Ray worker for a live one)."""
        kept = self._ours(node, aside(place.name))
        if kept is None:
            return False
        self.stop(node, place)
        kept.rename(place.name)
        kept.start()
        kept.exec_run(["find", LOG_DIR, "-name", "*.pid", "-delete"])
        return True

    def drop_aside(self, node: Node, place: Place) -> bool:
        kept = self._ours(node, aside(place.name))
        if kept is not None:
            kept.remove(force=True)
        return kept is not None

    def close(self) -> None:
        """Nothing of its own to close: the Docker clients ride on the nodes' SSH connections, closed with the run."""


def _daemon_answers(node: Node) -> None:
    """Raise unless the node's Docker daemon answers `docker version` within DAEMON_TIMEOUT_S."""
    r = node.run(["docker", "version", "--format", "{{.Server.Version}}"], timeout=DAEMON_TIMEOUT_S)
    if not r.ok:
        why = f"no answer within {DAEMON_TIMEOUT_S} s" if r.timed_out else (r.stderr or r.stdout).strip()[-300:]
        raise NodeError(node.name, f"its Docker daemon does not answer ({why}): start it and run 04 again")


class DockerImages:
    """The params' candidate images, as each node's Docker daemon holds them."""

    copies_images = True

    def __init__(self, spec: DockerRuntime):
        self.spec = spec
        self.policy: str = spec.image_policy
        self.pulls: bool = spec.pull
        self.runs_images = True

    def candidates(self) -> list[str]:
        return list(self.spec.images)

    def image(self, node: Node, ref: str) -> tuple[str, int] | None:
        """(ID, size in bytes) of `ref` in the node's daemon, None where it has no such image."""
        return _inspect(node, ref)

    def identity(self, node: Node, ref: str) -> str | None:
        """The image ID of `ref` on the node."""
        return image_id_on(node, ref)

    def digests(self, node: Node, ref: str) -> tuple[str, ...]:
        """`docker image inspect`'s RepoDigests (none where the node does not hold it, or the image was built or
        loaded there)."""
        r = node.run(["docker", "image", "inspect", "--format", "{{json .RepoDigests}}", ref], timeout=ID_TIMEOUT_S)
        try:
            found = json.loads(r.stdout) if r.ok else []
        except ValueError:
            return ()
        return tuple(d for d in found if isinstance(d, str)) if isinstance(found, list) else ()

    def architecture(self, node: Node, ref: str) -> str | None:
        """`docker image inspect`'s Architecture (amd64, arm64); None where the node does not hold it."""
        r = node.run(["docker", "image", "inspect", "--format", "{{.Architecture}}", ref], timeout=ID_TIMEOUT_S)
        return r.stdout.strip() or None if r.ok else None

    def installed(self, found_running: str | None = None) -> str | None:
        return self.spec.installed_image or found_running

    def no_installed_reason(self) -> str:
        return "runtime.installed_image is not set: no old deployment's image to probe; 03 probes the candidates"


def _inspect(node: Node, ref: str) -> tuple[str, int] | None:
    result = node.run(["docker", "image", "inspect", "--format", "{{.Id}} {{.Size}}", ref], timeout=ID_TIMEOUT_S)
    if not result.ok or len(result.stdout.split()) != 2:
        return None
    image_id, size = result.stdout.split()
    return image_id, int(size)


def image_id_on(node: Node, ref: str) -> str | None:
    """The ID of image `ref` in the node's daemon; None where it holds none."""
    held = _inspect(node, ref)
    return held[0] if held else None
