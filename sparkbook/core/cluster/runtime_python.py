"""vLLM in a Python environment on each node (no Docker): process control (`PythonNodes`) and the one candidate
03 has, the environment itself (`PythonImages`)."""
from __future__ import annotations

import json
import time
from collections.abc import Sequence
from datetime import UTC, datetime

from ..values.fanout import FanOut
from ..values.params import PythonRuntime
from .nodes import Cluster, Node, Result
from .nodestate import REFUSED, NodeStateError, ensure, pid_record_sh
from .runtime import KILL_SH, RUNNING_SH, Existing, Place, Spawned, StartSpec, aside, killed
from .topology import PLACE_ROOT, SERVING

# commands the stages start by name, as modules of the Python runtime's interpreter
MODULES = {"ray": "ray.scripts.scripts", "vllm": "vllm.entrypoints.cli.main"}
_VLLM_VERSION = "import importlib.metadata as m; print('vLLM ' + m.version('vllm'))"
PLACE_FILE = "place.json"  # in the place's dir: what `start` made it with, for `existing` (04's keep)
# The place's session records ("SID START" lines), read only from a dir of this user's own that no one else may
# write (no symlink): they drive `pkill -s`. The place dirs lie in the node's state dir (nodestate.ensure).
OURS_SH = '[ -d "$0" ] && [ ! -L "$0" ] && [ -O "$0" ] && [ -z "$(find "$0" -maxdepth 0 -perm /022)" ]'
SIDS_SH = OURS_SH + ' && [ -O "$0/sids" ] && cat "$0/sids"'
RECORD_SH = OURS_SH + f' && [ -O "$0/{PLACE_FILE}" ]'
# Signal "$2" to session "$0" once its leader, where it still runs, is the one recorded (start time "$1", leader of its
# session); a leader gone leaves its session's orphans, whose session ID no new process can take while they live.
SESSION_KILL_SH = ('if s=$(cat /proc/$0/stat 2>/dev/null); then s=${s##*\\)}; '
                   '[ "$(echo "$s" | cut -d" " -f21)" = "$1" ] && [ "$(echo "$s" | cut -d" " -f5)" = "$0" ] || '
                   '{ echo "pid $0 is not the session leader recorded (start time or session differs): refused" >&2; '
                   'exit 3; }; fi; pkill -"$2" -s "$0"; exit 0')


class PythonNodes:
    """A Python environment on each node (no Docker): the interpreter named in params runs everything."""

    not_reusable: str | None = None  # a place is compared by the record `start` wrote in its dir
    place_word = "process dir"
    own_place = False  # its processes share the node with whatever else runs there

    def __init__(self, spec: PythonRuntime, secrets: dict[str, str] | None = None):
        self.spec, self.secrets = spec, secrets or {}

    def lacks(self, node: Node, ref: str, image_id: str | None = None) -> str | None:
        """Nothing to hold: each node runs its own environment."""
        return None

    def preflight(self, cluster: Cluster) -> FanOut[None]:
        """Nothing to ask: the interpreter runs where the node's commands run."""
        return FanOut()

    def devices(self, node: Node) -> list[str]:
        return []

    def existing(self, node: Node, place: Place) -> Existing | None:
        """The place as `start` recorded it (its environment's vLLM identity and env, no secret: those go to each
        spawned process), running while a session it spawned lives."""
        r = node.run(["cat", f"{self._dir(node, place)}/{PLACE_FILE}"], timeout=30)
        if not r.ok:
            return None
        try:
            record = json.loads(r.stdout)
            identity, env, since = record["identity"], record["env"], record["started_at"]
        except (ValueError, KeyError, TypeError):
            return None
        return Existing(place.name, "running" if self._sessions_live(node, place) else "exited", identity or "", env,
                        [], since)

    def _env(self, extra: dict[str, str] | None) -> dict[str, str]:
        bindir = self.spec.python.rsplit("/", 1)[0]
        return {"PATH": f"{bindir}:/usr/local/bin:/usr/bin:/bin", **self.spec.env, **(extra or {})}

    def _argv(self, node: Node, argv: Sequence[str]) -> list[str]:
        """`python`/`python3` is the params' interpreter; the `ray` and `vllm` commands are its modules, so the
        environment's own Ray and vLLM run whatever scripts (or none) its bin directory holds. The place's own paths
        (below PLACE_ROOT) lie in the node's state dir."""
        if not argv:
            return []
        head, rest = argv[0], [self._path(node, a) for a in argv[1:]]
        if head in ("python", "python3"):
            return [self.spec.python, *rest]
        if head in MODULES:
            return [self.spec.python, "-m", MODULES[head], *rest]
        return [head, *rest]

    @staticmethod
    def _path(node: Node, value: str) -> str:
        """A path of the place's own as the stages name it (below PLACE_ROOT) in the node's state dir; else as is."""
        if value == PLACE_ROOT or value.startswith(f"{PLACE_ROOT}/"):
            return ensure(node) + value[len(PLACE_ROOT):]
        return value

    def one_off(self, node: Node, image: str | None, argv: Sequence[str], *, env: dict[str, str] | None = None,
                timeout: float = 120, gpus: bool = False) -> Result:
        """The environment sees the host's GPUs as it is (`gpus` changes nothing)."""
        return node.run(self._argv(node, argv), env=self._env(env), timeout=timeout)

    def start_spec(self, node: Node, place: Place, *, gpus: bool, devices: Sequence[str] = ()) -> StartSpec:
        """The place's PID directory: what lists the session IDs of the processes spawned there."""
        return StartSpec(node.name, place.name, None, ("mkdir", "-p", "-m", "700", self._dir(node, place)),
                         dict(place.env))

    def start(self, node: Node, spec: StartSpec) -> str:
        """A fresh place dir (the sessions of the last one stopped), with the record `existing` reads back."""
        place = Place(spec.node, spec.name)
        self.stop(node, place)
        node.run(list(spec.command), check=True, timeout=30)
        record = {"identity": self.identity(node), "env": {**self.spec.env, **spec.env},
                  "started_at": datetime.now(UTC).isoformat(timespec="seconds")}
        node.run(["sh", "-c", 'rm -f "$0"; set -C; printf %s "$1" >"$0"', f"{self._dir(node, place)}/{PLACE_FILE}",
                  json.dumps(record)], check=True, timeout=30)
        return self._dir(node, place)

    def identity(self, node: Node) -> str | None:
        """The vLLM version of the node's interpreter ("vLLM X.Y.Z"); None where it has no vLLM."""
        return self.one_off(node, None, ["python", "-c", _VLLM_VERSION], timeout=60).stdout.strip() or None

    def exec(self, node: Node, place: Place, argv: Sequence[str], *, timeout: float = 120,
             env: dict[str, str] | None = None) -> Result:
        return node.run(self._argv(node, argv), env=self._env({**place.env, **(env or {})}), timeout=timeout)

    def spawn(self, node: Node, place: Place, argv: Sequence[str], log: str, *,
              env: dict[str, str] | None = None, secrets: dict[str, str] | None = None) -> Spawned:
        """setsid the process into its own session; its identity (session ID, start time) goes to `log`.pid and to
        the place's list, the log and PID file created afresh (a link there is not followed). The params' secrets and
        `secrets` reach it exported from stdin (`KEY=value` lines), never on a command line (the env given here is
        one: `env K=V` on the SSH command)."""
        script = ('while IFS= read -r kv; do export "$kv"; done; mkdir -p "$(dirname "$1")"; '
                  "setsid sh -c '" + pid_record_sh('"$1.pid"') + '; cat "$1.pid" >>"$0"/sids; '
                  'l=$1; shift; rm -f "$l"; set -C; exec "$@" >"$l" 2>&1 </dev/null\' "$0" "$1" "${@:2}" '
                  '</dev/null >/dev/null 2>&1 &')
        lines = "".join(f"{k}={v}\n" for k, v in {**self.secrets, **(secrets or {})}.items()).encode()
        node.run(["bash", "-c", script, self._dir(node, place), self._path(node, log), *self._argv(node, argv)],
                 env=self._env({**place.env, **(env or {})}), stdin=lines, timeout=30, check=True)
        return Spawned(node.name, place.name, log)

    def running(self, node: Node, place: Place, spawned: Spawned) -> bool:
        return node.run(["sh", "-c", RUNNING_SH, self._path(node, spawned.pid_file)], timeout=15).ok

    def kill(self, node: Node, place: Place, spawned: Spawned, *, grace_s: int = 10, drain_s: int = 0) -> None:
        killed(node, node.run(["sh", "-c", KILL_SH, self._path(node, spawned.pid_file), str(grace_s), str(drain_s)],
                              timeout=grace_s + drain_s + 15))

    def read(self, node: Node, place: Place, path: str, *, tail_bytes: int = 0) -> str:
        path = self._path(node, path)
        argv = ["tail", "-c", str(tail_bytes), path] if tail_bytes else ["cat", path]
        return node.run(argv, timeout=30).stdout

    def alive(self, node: Node, place: Place) -> bool:
        """The place stands from its start to its stop (its dir, ours alone, holds the record), whether or not a
        process runs in it: on vLLM's own launch 04 starts places and nothing runs in them until 05 (an H200 run's 05
        found its places 'not running' by their sessions and stopped). A dir without the record stands while a
        session it spawned lives."""
        return node.run(["sh", "-c", RECORD_SH, self._dir(node, place)], timeout=30).ok or self._sessions_live(node,
                                                                                                             place)

    def _sessions_live(self, node: Node, place: Place) -> bool:
        return any(node.run(["pgrep", "-s", sid], timeout=30).ok for sid, _ in self._sids(node, place))

    def stop(self, node: Node, place: Place) -> bool:
        """Kill every process of the sessions this place spawned (by session ID, never by name), then its dir."""
        found = self._kill_sessions(node, place)
        node.run(["rm", "-rf", self._dir(node, place)], timeout=30)
        return found

    def _kill_sessions(self, node: Node, place: Place) -> bool:
        """TERM, then KILL, each recorded session whose leader is the one recorded (SESSION_KILL_SH); a session
        whose leader is now another process is refused, and said, after the others are ended."""
        sids = self._sids(node, place)
        terms = [node.run(["sh", "-c", SESSION_KILL_SH, sid, start, "TERM"], timeout=30) for sid, start in sids]
        refused = [r.stderr.strip() for r in terms if r.exit_code == REFUSED]
        if sids:
            time.sleep(2)
            for sid, start in sids:
                node.run(["sh", "-c", SESSION_KILL_SH, sid, start, "KILL"], timeout=30)
        if refused:
            raise NodeStateError(f"{node.name}: {self._dir(node, place)}: {refused[0]}", node=node.name,
                                 remediation="look at that process by hand; it was not signalled")
        return bool(sids)

    def set_aside(self, node: Node, place: Place) -> bool:
        """The sessions killed (as `stop`), the place dir kept under aside(name) with its record and the record of
        what served there (SERVING: a container takes its own along; here it lies in the node's shared log dir, where
        the next place's 05 would take it for a server that still stands)."""
        if not node.run(["test", "-d", self._dir(node, place)], timeout=30).ok:
            return False
        self._kill_sessions(node, place)
        kept = self._dir(node, Place(place.node, aside(place.name)))
        node.run(["sh", "-c", 'rm -rf "$1" && mv "$0" "$1" && if [ -f "$2" ]; then mv "$2" "$1/"; fi',
                  self._dir(node, place), kept, self._path(node, SERVING)], check=True, timeout=30)
        return True

    def bring_back(self, node: Node, place: Place) -> bool:
        """The place dir kept aside back under its name, with the record of what served there (its processes ended
        when it was set aside: nothing to start; 04 and 05 start them)."""
        kept = self._dir(node, Place(place.node, aside(place.name)))
        if not node.run(["test", "-d", kept], timeout=30).ok:
            return False
        self.stop(node, place)
        served = f"{kept}/{SERVING.rsplit('/', 1)[1]}"
        node.run(["sh", "-c", 'if [ -f "$2" ]; then mkdir -p "$(dirname "$3")" && mv "$2" "$3"; fi; mv "$0" "$1"',
                  kept, self._dir(node, place), served, self._path(node, SERVING)], check=True, timeout=30)
        return True

    def drop_aside(self, node: Node, place: Place) -> bool:
        kept = self._dir(node, Place(place.node, aside(place.name)))
        found = node.run(["test", "-d", kept], timeout=30).ok
        node.run(["rm", "-rf", kept], timeout=30)
        return found

    def _sids(self, node: Node, place: Place) -> list[tuple[str, str]]:
        """The (session ID, start time) pairs the place's spawns recorded, PIDs 0 and 1 never among them (none where
        its dir is not this user's alone: SIDS_SH)."""
        out = node.run(["sh", "-c", SIDS_SH, self._dir(node, place)], timeout=30).stdout
        return [(sid, start) for sid, start in (line.split()[:2] for line in out.splitlines() if len(line.split()) >= 2)
                if sid.isdigit() and start.isdigit() and int(sid) > 1]

    @staticmethod
    def _dir(node: Node, place: Place) -> str:
        """The place's dir, in the node's state dir (the runbook's own, checked: nodestate.ensure)."""
        return f"{ensure(node)}/{place.name}"

    def close(self) -> None:
        pass


class PythonImages:
    """The Python environment named in params: one candidate, its interpreter, nothing to copy."""

    copies_images = False
    policy = "newest"  # one candidate: there is nothing to keep or choose
    pulls = False  # no image to pull
    runs_images = False  # one interpreter: an image found running is none of its candidates

    def __init__(self, spec: PythonRuntime):
        self.spec, self.nodes = spec, PythonNodes(spec)

    def candidates(self) -> list[str]:
        return [self.spec.python]

    def image(self, node: Node, ref: str) -> tuple[str, int] | None:
        """A Python environment has no image."""
        return None

    def identity(self, node: Node, ref: str) -> str | None:
        """The vLLM version of the node's interpreter ("vLLM X.Y.Z"); None where it has no vLLM."""
        return self.nodes.identity(node)

    def digests(self, node: Node, ref: str) -> tuple[str, ...]:
        """An environment has no registry digest."""
        return ()

    def architecture(self, node: Node, ref: str) -> str | None:
        """An environment runs on its node's CPU: nothing to compare."""
        return None

    def installed(self, found_running: str | None = None) -> str | None:
        return None  # no image: what ran before is no candidate of this environment

    def no_installed_reason(self) -> str:
        return (f"runtime python: vLLM runs in the environment of {self.spec.python} on each node, there is no "
                "installed image to probe; 03 asks that environment's own vLLM (registry and inspection)")
