"""The restore plan 01 hands the session to write before it acts, and `sparkbook restore`: bring back what 01
stopped, after finding what stands in the way of each target (the new deployment holding its ports, memory or GPUs),
and verify what came back (running after a grace period, its health check answering, its memory back in use)."""
from __future__ import annotations

import json
import shlex
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path

from pydantic import TypeAdapter, ValidationError
from tenacity import Retrying, retry_if_result, stop_after_delay, wait_fixed

from ...core.analysis.hostfacts import FANOUT_TIMEOUT_S
from ...core.cluster.context import Context
from ...core.cluster.docker_ssh import docker_client
from ...core.cluster.nodes import Cluster, Node, SSHNode
from ...core.cluster.topology import container_name, container_names
from ...core.values import seal
from ...core.values.evidence import tail
from ...core.values.handoff import Action, RayCluster
from ...core.values.params import CleanupTargets
from ...core.values.rundir import RESTORE_PLAN, RESTORE_SCRIPT
from ...core.values.state import MissingState, load
from . import boot
from .act import CleanupError, act
from .inventory import (
    PROBE_TIMEOUT_S,
    Container,
    Inventory,
    container_top,
    inventory,
    listeners,
    probe_health,
    vanished,
)
from .planning import STOP_GRACE_S, CleanupTarget, Plan, TargetKind
from .relaunch import Relaunch

READY_TIMEOUT_S = 600  # a restored target has this long to answer its health check (a model loads)
GRACE_S = 15  # then it must still run and answer this much later (the old vLLM died after 11 s)
MEMORY_BACK_SHARE = 0.5  # a restored target holds at least this share of the memory it held before cleanup
LOG_TAIL_LINES = 30


@dataclass(frozen=True)
class Step:
    """One step of the restore plan: the target, the command that brings it back, what it held before cleanup."""

    node: str
    kind: TargetKind
    name: str
    restore: str | None
    note: str = ""
    ports: list[int] = field(default_factory=list)
    health_url: str = ""
    memory_mib: float = 0.0
    gpu_mib: int = 0
    owner: str = ""  # an owned container comes back with its owner: no command of its own, checked after it
    ssh: str = ""  # how restore.sh reaches the node: ssh with its SSH address, user and port
    launch: Relaunch | None = None  # a process's relaunch (secrets by name), which also finds it again
    cannot_restore: str | None = None  # why restore skips it (None: it has a restore command, or its owner)

    def secrets(self) -> list[str]:
        """The variables its restore reads from the controller's environment."""
        return self.launch.secrets() if self.launch else []

    def command(self) -> str | None:
        """What restore runs: a process's relaunch as its recorded argv, user and secrets' references make it (never
        a shell string of the plan's), else the recorded restore command."""
        return self.launch.command() if self.kind == "process" and self.launch else self.restore

    def runs_as(self, args: str) -> bool:
        """Whether a process's command line (ps's args) is this target's, whatever its secrets' values."""
        return self.launch is not None and self.launch.identifies(args)


@dataclass(frozen=True)
class RestorePlan:
    """restore-plan.json as 01 leaves it: the params file of the run and the steps in restore order."""

    params_file: str
    steps: list[Step]

    def json(self) -> str:
        return json.dumps({"params_file": self.params_file, "steps": [asdict(s) for s in self.steps]}, indent=2)


@dataclass(frozen=True)
class RestoreFiles:
    """What 01 hands the session to write into the run dir before it acts (a stop that fails half way still leaves
    them): the plan `sparkbook restore` reads and the same steps as a script for a controller without sparkbook."""

    plan: RestorePlan
    script: str

    def files(self) -> dict[str, str]:
        """Each file's name in the run dir and its text."""
        return {RESTORE_PLAN: self.plan.json(), RESTORE_SCRIPT: self.script}


_PLAN = TypeAdapter(RestorePlan)


def ssh_command(node: Node) -> str:
    """`ssh` with the node's SSH address (params' host as the ssh config resolves it), user, port, keys,
    known_hosts and jump host: a node's name is not an address anything resolves. A local node: `sh -c`."""
    if not isinstance(node, SSHNode):
        return "sh -c"
    t = node.target
    opts = [x for k in t.key_files for x in ("-i", k)]
    opts += ["-o", f"UserKnownHostsFile={t.known_hosts}"] if t.known_hosts else []
    opts += ["-J", f"{t.jump.user}@{t.jump.hostname}:{t.jump.port}"] if t.jump else []
    return shlex.join(["ssh", *opts, "-p", str(t.port), f"{t.user}@{t.hostname}"])


def restore_order(targets: list[CleanupTarget]) -> list[CleanupTarget]:
    """Reverse plan order, each owned container after its owner (the owner brings it back)."""
    back = [t for t in reversed(targets) if not t.owner]
    return [x for t in back for x in [t, *[o for o in targets if o.owner == f"{t.node}/{t.name}"]]]


def restore_files(ctx: Context, params_file: Path, p: Plan) -> RestoreFiles:
    """What to leave before acting: a restore step for every planned target (a stop that fails or times out may still
    have stopped it), in reverse order, with what each held (ports, health URL, memory), as JSON beside a readable
    script that reaches each node by its SSH address."""
    steps = [Step(t.node, t.kind, t.name, t.restore, t.restore_note, t.ports, t.health_url, t.memory_mib, t.gpu_mib,
                  t.owner, ssh_command(ctx.cluster.nodes[t.node]), t.launch, t.cannot_restore)
             for t in restore_order(p.targets)]
    script = ["#!/bin/sh", "# Brings back what 01-cleanup planned to stop (reverse order), by each node's SSH address.",
              "# It FIRST STOPS THE NEW DEPLOYMENT (this runbook's node containers: their Ray and vLLM server), as",
              "# `sparkbook restore RUN_DIR --stop-new` does: they hold the ports, memory and GPUs the old services",
              "# need.",
              "# Or: sparkbook restore RUN_DIR (refuses while the new deployment runs; --stop-new stops it first)",
              "set -e", *_secret_checks(steps), *_stop_new_lines(ctx), *map(_script_line, steps)]
    return RestoreFiles(RestorePlan(str(params_file), steps), "\n".join(script) + "\n")


def _secret_checks(steps: list[Step]) -> list[str]:
    """restore.sh stops before acting where a secret an old command line carried is not exported."""
    names = dict.fromkeys(n for s in steps for n in s.secrets())
    return [f'[ -n "${{{n}-}}" ] || {{ echo "restore.sh: export {n} first: an old command line carried it" >&2; '
            "exit 2; }" for n in names]


def _script_line(s: Step) -> str:
    """A step of restore.sh: its command on the node, fed the secrets it reads ("$NAME": never a value)."""
    if not s.restore:
        return f"# {s.node} {s.name}: {s.cannot_restore or s.note}"
    refs = " ".join(f'"${n}"' for n in s.secrets())
    feed = f"printf '%s\\n' {refs} | " if refs else ""
    return f"{feed}{s.ssh} {shlex.quote(s.restore)}"


def _stop_new_lines(ctx: Context) -> list[str]:
    """restore.sh's first lines: stop each node's container of this runbook (a missing one is fine)."""
    if not ctx.runtime.own_place:
        return ["# the new deployment runs as processes of a Python environment (no container): stop them first"]
    names = container_names(ctx.params)  # the front's own place on the head too: it holds serve.port
    return [f"{ssh_command(node)} {shlex.quote(f'docker stop {name} || true')}"
            for node in ctx.cluster for name in names.get(node.name, [])]


@dataclass(frozen=True)
class Conflict:
    """Something that stands in the way of a restore step, and the command that clears it."""

    node: str
    target: str
    what: str
    clear: str
    ours: bool  # held by what this run started: `--stop-new` clears it

    def line(self) -> str:
        return f"{self.node}: {self.target}: {self.what} (clear it: {self.clear})"


@dataclass(frozen=True)
class Seen:
    """A restored target as observed on its node."""

    state: str
    running: bool
    health: bool | None  # None: no health check recorded for it
    health_detail: str
    memory_mib: float
    log_tail: str = ""


@dataclass(frozen=True)
class Check:
    """The verdict on one restored target."""

    node: str
    name: str
    ok: bool
    state: str
    health: str
    memory: str
    problems: list[str]
    log_tail: str


@dataclass(frozen=True)
class RestoreOutcome:
    """What `sparkbook restore` did: refused (conflicts), or stopped the new deployment, restored and checked."""

    result: str  # refused | nothing to restore | restored | failed
    conflicts: list[Conflict] = field(default_factory=list)
    stopped_new: list[Action] = field(default_factory=list)
    actions: list[Action] = field(default_factory=list)
    checks: list[Check] = field(default_factory=list)
    memory: list[dict[str, object]] = field(default_factory=list)
    unread_ports: list[str] = field(default_factory=list)  # NODE/NAME of targets 01 saw listen on no port

    @property
    def ok(self) -> bool:
        return self.result in ("restored", "nothing to restore")


class RestoreRefused(CleanupError):
    """Something stands in the way of the restore; nothing was restored. `outcome` names each conflict."""

    stage = "restore"

    def __init__(self, message: str, outcome: RestoreOutcome, *, remediation: str):
        self.outcome = outcome
        super().__init__(message, remediation=remediation)


class RestoreFailed(CleanupError):
    """A restore step failed or a restored target did not come back; `outcome` holds each step and verdict."""

    stage = "restore"

    def __init__(self, message: str, outcome: RestoreOutcome, *, remediation: str):
        self.outcome = outcome
        super().__init__(message, remediation=remediation)


class SecretUnset(CleanupError):
    """A target to relaunch reads a secret this controller's environment does not hold (or the params do not name):
    nothing is restored, for it would run without its secret."""

    stage = "restore"
    exit_kind = "invalid"
    label = "refused"


class RestorePlanError(CleanupError):
    """restore-plan.json is not whole as 01 writes it (not JSON, a field missing or of the wrong type): nothing is
    restored, for a step read wrong could start the wrong thing."""

    stage = "restore"
    exit_kind = "invalid"
    label = "invalid restore plan"


def read_plan(plan_file: Path) -> RestorePlan:
    """The run dir's restore plan, validated; RestorePlanError naming the first bad field (never its value: a
    command line may carry a secret)."""
    try:
        return _PLAN.validate_json(seal.read(plan_file))  # only the plan this controller's 01 wrote
    except OSError as exc:
        raise RestorePlanError(f"{plan_file}: cannot be read ({exc.strerror})",
                               remediation="run `sparkbook restore` on the run dir as its own user") from None
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(map(str, first["loc"])) or "(file)"
        raise RestorePlanError(f"{plan_file}: {where}: {first['msg']} ({exc.error_count()} problem(s)); it is not the "
                               "plan 01 wrote", remediation="bring the targets back by hand: restore.sh beside it "
                               "lists each one's command") from None


def new_deployment(ctx: Context) -> dict[str, list[tuple[str, str]]]:
    """node -> [(container name, the ID this run's 04 recorded, or "")] of this runbook's containers, the node's and
    on the head the front's own (no ID recorded): whichever run started them, they hold the ports (the front
    serve.port), memory and GPUs the old services need. {} for a Python runtime."""
    if not ctx.runtime.own_place:
        return {}
    try:
        ids = load(ctx.run_dir, RayCluster).container_ids
    except MissingState:
        ids = {}
    return {node: [(name, ids.get(node, "") if name == container_name(ctx.params, node) else "") for name in names]
            for node, names in container_names(ctx.params).items()}


# pure: what stands in the way
def unread_ports(steps: list[Step]) -> list[str]:
    """The targets 01 saw listen on no port (still loading when it looked, or none at all): a conflict on their
    port cannot be found before acting, only the new deployment and memory can."""
    return [f"{s.node}/{s.name}" for s in steps if not s.ports]


def _target_running(inv: Inventory, s: Step) -> bool:
    match s.kind:
        case "container":
            return any(c.name == s.name and c.state == "running" for c in inv.containers)
        case "process":  # every process, allow-listed now or not: the plan's own record finds it
            return any(s.runs_as(args) for args in inv.commands.values())
        case "unit":
            return any(u.name == s.name and u.active == "active" for u in inv.units)
    return False


def _target_pids(inv: Inventory, s: Step) -> set[int]:
    return {pid for c in inv.containers if c.name == s.name for pid in c.pids}


def _ours(inv: Inventory, new: dict[str, list[tuple[str, str]]]) -> list[Container]:
    names = {name for name, _ in new.get(inv.node, [])}
    return [c for c in inv.containers if c.name in names and c.state == "running"]


def conflicts(steps: list[Step], now: dict[str, Inventory], new: dict[str, list[tuple[str, str]]],
              run_dir: Path) -> list[Conflict]:
    """Per target not running now: each process listening on a port it held, and per node, the memory
    (GPU memory where the GPU reports it) the targets held that is not available now. `new`: this run's
    node containers (`new_deployment`); each that runs is a conflict of its own (its Ray and server hold what the
    old services need, ports recorded or not), cleared by `--stop-new`."""
    stop_new = f"sparkbook restore {run_dir} --stop-new"
    out = [Conflict(inv.node, "the old services", f"this runbook's deployment runs: container {c.name} (its Ray and "
                    "vLLM server)", stop_new, True) for inv in now.values() for c in _ours(inv, new)]
    for s in steps:
        inv = now.get(s.node)
        if inv is None or _target_running(inv, s):
            continue
        own = _target_pids(inv, s)
        ours = {pid for c in _ours(inv, new) for pid in c.pids}
        held: dict[int, set[int]] = {}  # port -> its holders (listened on by IPv4 and IPv6 sockets: one conflict)
        for lis in inv.listeners:
            if lis.port in s.ports and set(lis.pids) - own:
                held.setdefault(lis.port, set()).update(set(lis.pids) - own)
        for port, pids in held.items():
            holders = sorted(pids)
            is_ours = bool(set(holders) & ours)
            who = ", ".join(dict.fromkeys(inv.holder(pid) for pid in holders))
            out.append(Conflict(s.node, s.name, f"port {port} is held by {who}"
                                + (" (this run's node container)" if is_ours else ""),
                                stop_new if is_ours else _clear(s.node, inv, holders), is_ours))
    for node, inv in now.items():
        out += _memory_conflicts([s for s in steps if s.node == node and not _target_running(inv, s)], inv,
                                 _ours(inv, new), stop_new)
    return out


def _clear(node: str, inv: Inventory, pids: list[int]) -> str:
    names = sorted({c.name for c in inv.containers for pid in pids if pid in c.pids})
    return f"ssh {node} docker stop {' '.join(names)}" if names else f"ssh {node} kill {' '.join(map(str, pids))}"


def _memory_conflicts(steps: list[Step], inv: Inventory, ours: list[Container], stop_new: str) -> list[Conflict]:
    names = ", ".join(s.name for s in steps)
    held_by = f"; this run's {', '.join(c.name for c in ours)} holds {sum(c.rss_mib for c in ours):.0f} MiB" \
        if ours else ""
    clear = stop_new if ours else f"free memory on {inv.node}"
    out = []
    need = sum(s.memory_mib for s in steps)
    if need > inv.memory.mem_available / (1 << 20):
        out.append(Conflict(inv.node, names, f"they held {need:.0f} MiB, {inv.memory.mem_available >> 20} MiB is "
                                             f"available{held_by}", clear, bool(ours)))
    gpu_need = sum(s.gpu_mib for s in steps)
    if gpu_need and inv.memory.gpu_total is not None:
        free = (inv.memory.gpu_total - (inv.memory.gpu_used or 0)) >> 20
        if gpu_need > free:
            out.append(Conflict(inv.node, names, f"they held {gpu_need} MiB of GPU memory, {free} MiB is free",
                                clear, bool(ours)))
    return out


# pure: the verdict on a restored target
def judge(s: Step, seen: Seen) -> Check:
    """Running after the grace period, its health check answering where one was recorded, its memory back."""
    problems = []
    if s.cannot_restore:
        problems.append(f"not restored: {s.cannot_restore}")
    elif s.restore is None and not s.owner:
        problems.append(f"no restore command: {s.note}")
    elif not seen.running:
        problems.append(f"not running ({seen.state})")
    if seen.health is False:
        problems.append(f"health check not answering: {seen.health_detail}")
    if s.memory_mib >= 1 and seen.memory_mib < MEMORY_BACK_SHARE * s.memory_mib:
        problems.append(f"holds {seen.memory_mib:.0f} MiB; it held {s.memory_mib:.0f} MiB before cleanup")
    health = {None: "(none recorded)", True: f"answers {seen.health_detail}",
              False: f"NOT answering {seen.health_detail}"}[seen.health]
    return Check(s.node, s.name, not problems, seen.state, health,
                 f"{seen.memory_mib:.0f} MiB (before cleanup: {s.memory_mib:.0f} MiB)", problems,
                 "" if not problems else seen.log_tail)


# acting
def _restore_one(node: Node, step: Step, secrets: Mapping[str, str]) -> str:
    match step.kind:
        case "container":
            docker_client(node, timeout=PROBE_TIMEOUT_S).containers.get(step.name).start()
            return "started"
        case "unit" if step.restore:
            done = node.run(shlex.split(step.restore), timeout=PROBE_TIMEOUT_S * 3, check=True)
            return f"started; {boot.links(done.stdout + done.stderr).describe()}"
        case "process" if step.launch:
            node.run(["sh", "-c", step.launch.command()], timeout=PROBE_TIMEOUT_S, check=True,
                     stdin=step.launch.stdin(secrets))
            return "launched"
    raise CleanupError(step.note or "no restore command is known", node=node.name)


def already_running(steps: list[Step], now: dict[str, Inventory]) -> list[Step]:
    """The steps whose target runs now (a second restore, or one brought back by hand): verified, never launched
    again, for a relaunched process would run twice."""
    return [s for s in steps if (inv := now.get(s.node)) is not None and _target_running(inv, s)]


def bring_back(cluster: Cluster, steps: list[Step], running: list[Step], secrets: Mapping[str, str]) -> list[Action]:
    """Run the restore plan `restore_files` made, step by step, but for the targets `running` already
    (each an Action saying so) and those it cannot bring back (skipped, saying why); an owned container has no step
    of its own (its owner brings it back; verify_restore checks it). `secrets`: the values the steps read, by name."""
    def restoring(step: Step) -> Callable[[Node], str]:
        return lambda node: _restore_one(node, step, secrets)

    def one(s: Step) -> Action:
        if s in running:
            return Action(s.node, s.name, "-", True, "already running: verified, not launched again", 0.0)
        if s.cannot_restore:
            return Action(s.node, s.name, "-", False, f"skipped: {s.cannot_restore}", 0.0)
        return act(cluster.nodes[s.node], s.name, s.command() or "-", restoring(s))

    return [one(s) for s in steps if not s.owner]


def _stop_container(node: Node, name: str, recorded_id: str) -> str:
    """Stop this runbook's container of the node (the name is the runbook's own); say whether this run started
    it. One that is gone meanwhile is fine: that is what stopping wanted."""
    try:
        c = docker_client(node, timeout=STOP_GRACE_S + PROBE_TIMEOUT_S).containers.get(name)
        c.stop(timeout=STOP_GRACE_S)
    except Exception as exc:
        if not vanished(exc):
            raise
        return f"gone already ({type(exc).__name__})"
    whose = "this run's" if recorded_id and c.id.startswith(recorded_id[:12]) else "started by another run"
    return f"stopped {c.id[:12]} ({whose})"


def stop_new(cluster: Cluster, new: dict[str, list[tuple[str, str]]]) -> list[Action]:
    """Stop this runbook's containers, by name (each says whether this run started it)."""
    def stopping(name: str, recorded_id: str) -> Callable[[Node], str]:
        return lambda node: _stop_container(node, name, recorded_id)

    return [act(cluster.nodes[node], name, f"docker stop {name}", stopping(name, cid))
            for node, found in new.items() if node in cluster.nodes for name, cid in found]


def observe(node: Node, s: Step) -> Seen:
    """A target's state, health (its recorded URL; else a listener on its ports), memory and log tail."""
    observed = {"container": _observe_container, "process": _observe_process, "unit": _observe_unit}.get(
        s.kind, _not_restorable)
    running, state, memory, log = observed(node, s)
    health: bool | None = None
    detail = ""
    if s.health_url:
        health, detail = probe_health(node, [s.health_url])[s.health_url], s.health_url
    elif s.ports:
        socks = listeners(node.run(["ss", "-Hltnp"], timeout=PROBE_TIMEOUT_S).stdout.splitlines())
        missing = sorted(set(s.ports) - {lis.port for lis in socks})
        health, detail = not missing, f"ports {s.ports} listening" + (f" (not: {missing})" if missing else "")
    return Seen(state, running, health, detail, memory, log)


def _observe_container(node: Node, s: Step) -> tuple[bool, str, float, str]:
    client = docker_client(node, timeout=PROBE_TIMEOUT_S)
    try:
        c = client.containers.get(s.name)
    except Exception as exc:  # gone: that is the observation
        return False, f"gone ({type(exc).__name__})", 0.0, ""
    state = c.attrs["State"]
    rss = container_top(client, c.id)[1] if c.status == "running" else 0.0
    try:
        text = c.logs(tail=LOG_TAIL_LINES).decode(errors="replace")
    except Exception as exc:  # removed meanwhile (a manager's --rm container): no log to show
        if not vanished(exc):
            raise
        return False, f"gone ({type(exc).__name__})", 0.0, ""
    described = c.status if c.status == "running" else f"{c.status} (exit {state.get('ExitCode')})"
    return c.status == "running", described, rss, tail(text, LOG_TAIL_LINES)


def _observe_process(node: Node, s: Step) -> tuple[bool, str, float, str]:
    """A relaunched process: running when a process with its recorded command line runs; its RSS."""
    rows = [line.split(None, 2) for line in
            node.run(["ps", "-eo", "pid=,rss=,args="], timeout=PROBE_TIMEOUT_S).stdout.splitlines()]
    found = [r for r in rows if len(r) == 3 and s.runs_as(r[2])]
    state = f"running (pid {', '.join(r[0] for r in found)})" if found else "not running"
    return bool(found), state, round(sum(int(r[1]) for r in found) / 1024, 1), ""


def _not_restorable(node: Node, s: Step) -> tuple[bool, str, float, str]:
    return False, "not restorable", 0.0, ""


def _observe_unit(node: Node, s: Step) -> tuple[bool, str, float, str]:
    """The unit after `--` (or in `--unit=`): a name starting with `-` is never read as an option."""
    active = node.run(["systemctl", "is-active", "--", s.name], timeout=PROBE_TIMEOUT_S).stdout.strip()
    mem = node.run(["systemctl", "show", "-p", "MemoryCurrent", "--value", "--", s.name], timeout=PROBE_TIMEOUT_S)
    log = node.run(["journalctl", f"--unit={s.name}", "-n", str(LOG_TAIL_LINES), "--no-pager"], timeout=PROBE_TIMEOUT_S)
    rss = int(mem.stdout.strip()) / (1 << 20) if mem.stdout.strip().isdigit() else 0.0
    return active == "active", active, round(rss, 1), tail(log.stdout, LOG_TAIL_LINES)


def verify_restore(cluster: Cluster, steps: list[Step], ready_timeout_s: float = READY_TIMEOUT_S,
                   grace_s: float = GRACE_S) -> list[Check]:
    """Wait until each target answers (or has exited), then a grace period, then judge each one."""
    pending = [s for s in steps if s.restore or s.owner]

    def still_starting() -> list[Step]:
        """The targets that run but whose health check does not answer yet."""
        pending[:] = [s for s in pending
                      if (seen := observe(cluster.nodes[s.node], s)).running and seen.health is False]
        return pending

    Retrying(stop=stop_after_delay(ready_timeout_s), wait=wait_fixed(2), retry=retry_if_result(bool),
             retry_error_callback=lambda state: state.outcome.result() if state.outcome else None)(still_starting)
    time.sleep(grace_s)
    return [judge(s, observe(cluster.nodes[s.node], s)) for s in steps]


@dataclass(frozen=True)
class RestoreEvent:
    """One step of a restore, handed to the caller as it is taken: the caller records it (a stage never records),
    and a step taken before a later one fails is still on the record."""

    kind: str  # restore_conflicts | restore_stop_new | restore | restore_outcome (the last one, a RestoreOutcome)
    data: object


def restore_deployment(ctx: Context, steps: list[Step], targets: CleanupTargets,
                       stop_first: bool) -> Iterator[RestoreEvent]:
    """`sparkbook restore`: refuse while something stands in the way (unless `stop_first`: stop this run's node
    containers first), restore in plan order, verify each target; yields each step, the `RestoreOutcome` last."""
    if not steps:
        yield RestoreEvent("restore_outcome", RestoreOutcome("nothing to restore"))
        return
    new = new_deployment(ctx)
    now = _inventories(ctx.cluster, targets)
    secrets = secret_values([s for s in steps if s not in already_running(steps, now)], ctx.params.secrets,
                            ctx.params.secret_values())
    found = conflicts(steps, now, new, ctx.run_dir)
    unread = unread_ports(steps)
    yield RestoreEvent("restore_conflicts", found)
    if found and not stop_first:
        yield RestoreEvent("restore_outcome", RestoreOutcome("refused", found, unread_ports=unread))
        return
    stopped: list[Action] = []
    if stop_first:
        stopped = stop_new(ctx.cluster, new)
        yield RestoreEvent("restore_stop_new", stopped)
        now = _inventories(ctx.cluster, targets)
        found = conflicts(steps, now, new, ctx.run_dir)
        yield RestoreEvent("restore_conflicts", found)
        if found or not all(a.ok for a in stopped):
            yield RestoreEvent("restore_outcome", RestoreOutcome("refused", found, stopped, unread_ports=unread))
            return
    actions = bring_back(ctx.cluster, steps, already_running(steps, now), secrets)
    yield RestoreEvent("restore", actions)
    checks = verify_restore(ctx.cluster, steps)
    after = _inventories(ctx.cluster, targets)
    memory = [{"node": n, **now[n].memory.delta(after[n].memory)} for n in now if n in after]
    ok = all(a.ok for a in actions) and all(c.ok for c in checks)
    yield RestoreEvent("restore_outcome", RestoreOutcome("restored" if ok else "failed", [], stopped, actions, checks,
                                                         memory, unread))


def secret_values(steps: list[Step], named: list[str], held: Mapping[str, str]) -> dict[str, str]:
    """The values the steps to launch read, by name, from `held` (the controller's environment, for the params'
    `secrets`, `named`); SecretUnset naming each target whose variable is not there (never a value)."""
    missing = [f"{s.node}/{s.name} needs {n}, which " + ("is not set here" if n in named else
                                                         "the params do not name under `secrets`")
               for s in steps for n in s.secrets() if n not in held]
    if missing:
        raise SecretUnset(f"nothing was restored: {'; '.join(missing)}",
                          remediation="export each variable (the value the old command line carried) where "
                                      "`sparkbook restore` runs, list it under the params' `secrets`, and run it again")
    return {n: held[n] for s in steps for n in s.secrets()}


def _inventories(cluster: Cluster, targets: CleanupTargets) -> dict[str, Inventory]:
    """Every node's inventory now; a node that cannot be seen refuses the restore (its conflicts are unknown)."""
    def unseen(errors: str) -> CleanupError:
        return CleanupError(f"cannot see what stands in the way: {errors}",
                            remediation="make every node reachable, then run `sparkbook restore` again")
    found = cluster.fan_out(lambda n: inventory(n, targets), timeout=FANOUT_TIMEOUT_S)
    return {inv.node: inv for inv in found.values_or_raise(unseen)}
