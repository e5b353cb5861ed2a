"""Where vLLM runs on a node, as two interfaces: `Runtime` (process control, 04/05/06) and `ImageSource` (what 03
asks of the images it chooses among). Docker (runtime_docker) and a Python environment (runtime_python) implement
both; `core.cluster.runtimes` picks one for a params file, and no stage asks which it got.

Runtime's verbs:
  preflight(cluster)              every node can start places (its Docker daemon answers) -> FanOut
  devices(node)                   host devices a place gets (InfiniBand, unless privileged)
  lacks(node, ref, image_id)      why the node cannot start a place of `ref`, as a fact (None where it can)
  existing(node, place) / not_reusable   a place a previous run left, as it stands now / why none is reused
  one_off(node, image, argv)      a short command in a fresh container / in the environment
  start_spec(node, place, ...)    a place's start as one value (StartSpec), what `plan` shows and `start` runs
  start(node, spec)               a long-lived place to exec in (a container; a PID directory for a Python env)
  exec(node, name, argv)          a command in that place, with a node-side timeout
  spawn(node, name, argv, log)    a background process (its own session) writing to a log file -> Spawned; the
                                  params' secrets (and any `secrets` given) reach it alone, never an argv or a
                                  place's inspectable environment
  running / kill (node, name, spawned)   is that process alive / end its whole session, by its ID
  read / alive / stop             a file as the place sees it / whether the place stands / remove it
  set_aside / bring_back / drop_aside    a replaced place kept, stopped, under ASIDE's name until its successor
                                  serves / back in its name and started (the successor removed) / removed for good
ImageSource's verbs:
  candidates()                    what 03 may choose from (image refs / the interpreter)
  image(node, ref)                (ID, size) of an image the node holds; None where it holds none (or no images)
  identity(node, ref)             what must be the same on every node (the image ID / the environment's vLLM)
  architecture(node, ref)         the image's CPU architecture (amd64, arm64); None for an environment
  copies_images / policy          whether 03 copies images to the nodes / runtime.image_policy
  installed() / no_installed_reason()    the old deployment's image to probe, or why there is none
"""
from __future__ import annotations

import shlex
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from ..values.fanout import FanOut
from .nodes import Cluster, Node, Result
from .nodestate import IDENTITY_SH, REFUSED, NodeStateError, pid_record_sh

ID_TIMEOUT_S = 30  # reading an image's ID on a node


def aside(name: str) -> str:
    """The name a replaced place is kept under until the place that replaced it serves (issue 40)."""
    return f"{name}-replaced"

# The shell scripts of both implementations' process control.
# Start argv as the leader of a new session, its identity (nodestate.pid_record_sh) in "$0.pid", output to "$0" (the
# log path), each created afresh without following a link planted there.
SPAWN_SH = ('mkdir -p "$(dirname "$0")"; exec setsid sh -c \''
            + pid_record_sh('"$0.pid"') + '; rm -f "$0"; set -C; exec "$@" >"$0" 2>&1 </dev/null\' "$0" "$@"')
# Export the `K='v'` lines of the file "$0" (mode 0600, written for this one spawn), remove it, exec "$@".
SECRETS_SH = 'set -a; . "$0"; set +a; rm -f "$0"; exec "$@"'
# 0 if the session leader recorded in "$0" is the one spawned, alive and not a zombie.
RUNNING_SH = IDENTITY_SH + '; case $(echo "$s" | cut -d" " -f2) in Z|X) exit 1;; esac'
# TERM the recorded session leader's process group (only once it is the process spawned: IDENTITY_SH), wait up to
# $1 s, then KILL what is left; exit REFUSED, saying why, where the PID file names another process. With $2 > 0 (a
# drain) the leader alone is TERMed first and given up to $2 s to end (vLLM's API server finishes what it runs; its
# engine processes stay until it lets them go).
KILL_SH = (IDENTITY_SH + '; i=0; if [ "${2:-0}" -gt 0 ]; then kill -TERM "$p" 2>/dev/null; '
           'while t=$(cut -d")" -f2 "/proc/$p/stat" 2>/dev/null) && case $t in " Z"*|" X"*) false;; esac '
           '&& [ $i -lt "$2" ]; do sleep 1; i=$((i+1)); done; fi; kill -TERM -"$p" 2>/dev/null; i=0; '
           'while kill -0 -"$p" 2>/dev/null && [ $i -lt "$1" ]; do sleep 1; i=$((i+1)); done; '
           'kill -KILL -"$p" 2>/dev/null; rm -f "$0"; exit 0')


def killed(node: Node, result: Result) -> None:
    """KILL_SH's answer: a PID file naming a process the runbook did not spawn is refused, and said."""
    if result.exit_code == REFUSED:
        raise NodeStateError(f"{node.name}: not signalled: {result.stderr.strip()[-300:]}", node=node.name,
                             remediation="look at that process and its PID file by hand; nothing was killed")


@dataclass(frozen=True)
class Place:
    """A named place on a node where commands of one stage run (a container, or a PID directory)."""

    node: str
    name: str
    image: str | None = None
    env: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Ulimit:
    name: str
    soft: int  # -1: unlimited
    hard: int

    def text(self) -> str:
        """As `docker inspect` and the node table show it: "memlock=unlimited", "nofile=1048576"."""
        return f"{self.name}={'unlimited' if self.soft == -1 else self.soft}"


@dataclass(frozen=True)
class StartSpec:
    """A place's start as one value: what `Runtime.start` creates and what a preview renders, so the two cannot
    drift. Env by value for what params and the place set; no secret: those reach only the processes spawned in
    the place (`Runtime.spawn`), never its inspectable environment."""

    node: str
    name: str
    image: str | None  # None: the Python runtime's PID directory, nothing to create from
    command: tuple[str, ...]  # the entrypoint argv (a container), or what creates the place
    env: dict[str, str] = field(default_factory=dict)
    mounts: tuple[str, ...] = ()  # host paths bound read-write at the same path
    ulimits: tuple[Ulimit, ...] = ()
    cap_add: tuple[str, ...] = ()
    devices: tuple[str, ...] = ()
    gpus: bool = False
    privileged: bool = False
    ipc_host: bool = False
    shm_size: str | None = None
    memory_limit: str | None = None  # the container's memory cap, swap as large (the cap holds, swap or not)
    labels: dict[str, str] = field(default_factory=dict)

    @property
    def env_names(self) -> list[str]:
        return sorted(self.env)

    def command_line(self) -> str:
        """The shell equivalent of the start, env by name only (`docker run -e NAME` reads it from the shell)."""
        if self.image is None:
            return shlex.join(self.command)
        argv = ["docker", "run", "-d", "--name", self.name, "--network", "host", "--init"]
        argv += ["--shm-size", self.shm_size] if self.shm_size else []
        argv += [a for k, v in self.labels.items() for a in ("--label", f"{k}={v}")]
        argv += [a for path in self.mounts for a in ("-v", f"{path}:{path}:rw")]
        argv += [a for name in self.env_names for a in ("-e", name)]
        argv += ["--privileged"] if self.privileged else []
        argv += [a for u in self.ulimits for a in ("--ulimit", f"{u.name}={u.soft}:{u.hard}")]
        argv += [a for c in self.cap_add for a in ("--cap-add", c)]
        argv += [a for d in self.devices for a in ("--device", f"{d}:{d}")]
        argv += ["--ipc", "host"] if self.ipc_host else []
        argv += ["--memory", self.memory_limit, "--memory-swap", self.memory_limit] if self.memory_limit else []
        argv += ["--gpus", "all"] if self.gpus else []
        return shlex.join([*argv, "--entrypoint", self.command[0], self.image, *self.command[1:]])


@dataclass(frozen=True)
class Existing:
    """A place as a previous run left it on a node: what 04 compares with the place it would start."""

    id: str
    status: str
    image_id: str
    env: dict[str, str]
    devices: list[str]
    started_at: str
    mounts: tuple[str, ...] = ()  # host paths mounted, as the runtime reports them
    limits: tuple[str, ...] = ()  # ulimits and added capabilities, e.g. "memlock=unlimited", "cap IPC_LOCK"


@dataclass(frozen=True)
class Spawned:
    """A background process started by `spawn`: its log and the file holding its session ID."""

    node: str
    place: str
    log: str

    @property
    def pid_file(self) -> str:
        return f"{self.log}.pid"


@runtime_checkable
class Runtime(Protocol):
    """How the stages start, run and stop vLLM's processes on a node (see the module's docstring for the verbs)."""

    not_reusable: str | None  # why a running cluster a previous run left is never reused (None where it may be)
    place_word: str  # what a place is, in the words a message names it by: "container", "process dir"
    own_place: bool  # whether a place holds 04's and 05's processes alone (a container), not the node's others too

    def lacks(self, node: Node, ref: str, image_id: str | None = None) -> str | None:
        """Why the node cannot start a place of `ref` (holding `image_id` where given), as a fact; None if it can."""

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

    def start_spec(self, node: Node, place: Place, *, gpus: bool, devices: Sequence[str] = ()) -> StartSpec:
        """The place's start as one value (no remote call)."""

    def start(self, node: Node, spec: StartSpec) -> str:
        """(Re)create the place `spec` describes; its ID."""

    def exec(self, node: Node, place: Place, argv: Sequence[str], *, timeout: float = 120,
             env: dict[str, str] | None = None) -> Result:
        """argv in the place, with a node-side timeout."""

    def spawn(self, node: Node, place: Place, argv: Sequence[str], log: str, *,
              env: dict[str, str] | None = None, secrets: dict[str, str] | None = None) -> Spawned:
        """argv in the background in its own session, stdout and stderr to `log`; the params' secrets and
        `secrets` in its environment alone (through stdin or a file only it reads, removed once read)."""

    def running(self, node: Node, place: Place, spawned: Spawned) -> bool:
        """Whether the spawned process still runs."""

    def kill(self, node: Node, place: Place, spawned: Spawned, *, grace_s: int = 10, drain_s: int = 0) -> None:
        """End the spawned process and its whole session, TERM then KILL; with `drain_s`, the process alone is
        TERMed first and given that long to finish what it serves."""

    def read(self, node: Node, place: Place, path: str, *, tail_bytes: int = 0) -> str:
        """A file as the place sees it (its last `tail_bytes` where given)."""

    def alive(self, node: Node, place: Place) -> bool:
        """Whether the place stands (its container runs / a process it spawned lives)."""

    def stop(self, node: Node, place: Place) -> bool:
        """Remove the place and everything spawned in it; True if there was one."""

    def set_aside(self, node: Node, place: Place) -> bool:
        """Stop the place (what it spawned ends) and keep it under `aside(name)`, replacing an older one kept there;
        True if there was one."""

    def bring_back(self, node: Node, place: Place) -> bool:
        """Remove the place now under the name and put the one kept aside back in it, started; True if one was kept."""

    def drop_aside(self, node: Node, place: Place) -> bool:
        """Remove the place kept aside; True if there was one."""

    def close(self) -> None:
        """Release what the runtime holds of its own."""


@runtime_checkable
class ImageSource(Protocol):
    """What 03 asks of the images (or the environment) vLLM runs from (see the module's docstring for the verbs)."""

    copies_images: bool  # whether 03 copies an image to every node (else each node runs its own environment)
    policy: str  # runtime.image_policy: keep_installed | newest
    pulls: bool  # whether 03 pulls every candidate on the head before probing them (runtime.pull)
    runs_images: bool  # whether its candidates are images containers run (so an image found running is one too)

    def candidates(self) -> list[str]:
        """What 03 chooses among: the image refs of params, or the interpreter of the Python environment."""

    def image(self, node: Node, ref: str) -> tuple[str, int] | None:
        """(ID, size in bytes) of image `ref` on the node; None where it holds none (nothing is pulled)."""

    def identity(self, node: Node, ref: str) -> str | None:
        """What must be the same on every node for `ref`; None where the node has none."""

    def digests(self, node: Node, ref: str) -> tuple[str, ...]:
        """`ref`'s repo digests on the node (name@sha256:..., the registry's name for its bytes); none where it has
        none (an image built or loaded there, an environment)."""

    def architecture(self, node: Node, ref: str) -> str | None:
        """The image's CPU architecture as Docker records it (amd64, arm64); None where there is none to read."""

    def installed(self, found_running: str | None = None) -> str | None:
        """The old deployment's image, to probe: runtime.installed_image, else `found_running` (the image 01 found
        the old deployment's containers running) where this source's images can run so; None where there is none."""

    def no_installed_reason(self) -> str:
        """Why there is no installed image to probe."""


# The implementations import this module's values, so the factories import them when called.
