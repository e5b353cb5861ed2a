"""What a systemd unit or a managed process owns, read from what the node reports (pure functions).

A unit owns the processes of its cgroup (`systemctl show -p ControlGroup` + the cgroup's `cgroup.procs`); a managed
process owns its descendants (`ps -eo pid,ppid,args`). A container belongs to the owner when the `docker run` or
`docker start` client that keeps it running is one of those processes (its `--name` or container ID in the argv; the
daemon is the node `-H ssh://...`, `-H tcp://...` or `ssh HOST docker ...` names, else the owner's own node), or,
for a unit, when one of its labels names the unit. launch-cluster.sh (eugr/spark-vllm-docker), run by the seed's
vllm-cluster.service, starts its `--rm` containers on both nodes that way: stopping the unit removes them.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from urllib.parse import urlsplit

SHOW_PROPERTIES = "Id,ActiveState,MainPID,ControlGroup,ExecStart,TimeoutStopUSec,RequiredBy,UnitFileState"
_SPAN = re.compile(r"(\d+(?:\.\d+)?)\s*(min|ms|us|h|d|s)")
_SPAN_S = {"us": 1e-6, "ms": 1e-3, "s": 1.0, "min": 60.0, "h": 3600.0, "d": 86400.0}
SSH_VALUE_OPTS = set("bcDEeFIiJLlmOoPpQRSWw")  # ssh(1) options that take a value
DOCKER_VALUE_OPTS = {"-H", "--host", "-c", "--context", "--config", "-l", "--log-level", "--tlscacert",
                     "--tlscert", "--tlskey"}
START_VALUE_OPTS = {"--detach-keys", "--checkpoint", "--checkpoint-dir"}


@dataclass(frozen=True)
class UnitShow:
    """The properties of `systemctl show -p SHOW_PROPERTIES UNIT` that cleanup uses."""

    name: str
    active: str
    main_pid: int
    control_group: str
    exec_start: str  # the argv systemd runs, as `systemctl show` prints it
    stop_timeout_s: float | None  # TimeoutStopUSec; None: infinity or not reported
    required_by: list[str]
    file_state: str = ""  # UnitFileState: enabled (starts at boot), disabled, static...


@dataclass(frozen=True)
class DockerClientProcess:
    """A `docker run` / `docker start` client process and the container it keeps running."""

    pid: int
    host: str  # the node address of the daemon it talks to; "" = the node it runs on
    ref: str  # container name or ID


def timespan_s(text: str) -> float | None:
    """systemd's time span ("1min 30s", "90s", "500ms", "infinity") -> seconds; None for infinity/empty."""
    parts = _SPAN.findall(text)
    return sum(float(n) * _SPAN_S[u] for n, u in parts) if parts and text.strip() != "infinity" else None


def parse_show(text: str) -> UnitShow:
    """`systemctl show` KEY=VALUE lines -> UnitShow (properties it did not print take their empty value)."""
    props = dict(line.split("=", 1) for line in text.splitlines() if "=" in line)
    argv = re.search(r"argv\[\]=([^;]*)", props.get("ExecStart", ""))
    main = props.get("MainPID", "0")
    return UnitShow(props.get("Id", ""), props.get("ActiveState", ""), int(main) if main.isdigit() else 0,
                    props.get("ControlGroup", ""), argv.group(1).strip() if argv else props.get("ExecStart", ""),
                    timespan_s(props.get("TimeoutStopUSec", "")), props.get("RequiredBy", "").split(),
                    props.get("UnitFileState", ""))


def tree(lines: list[str]) -> dict[int, tuple[int, str]]:
    """`ps -eo pid=,ppid=,args=` lines -> pid: (ppid, args)."""
    out = {}
    for line in lines:
        cols = line.split(None, 2)
        if len(cols) >= 2 and cols[0].isdigit() and cols[1].isdigit():
            out[int(cols[0])] = (int(cols[1]), cols[2] if len(cols) > 2 else "")
    return out


def family(pid: int, procs: dict[int, tuple[int, str]]) -> list[int]:
    """The process and all its descendants."""
    out, frontier = [pid], {pid}
    while frontier:
        frontier = {p for p, (ppid, _) in procs.items() if ppid in frontier and p not in out}
        out += sorted(frontier)
    return out


def _address(daemon: str) -> str:
    """`-H` value or ssh destination -> the host part ("" for a local socket)."""
    if daemon.startswith(("unix://", "npipe://", "fd://")) or not daemon:
        return ""
    host = urlsplit(daemon).hostname if "://" in daemon else daemon.rsplit("@", 1)[-1]
    return "" if host in (None, "localhost", "127.0.0.1", "::1") else host


def _ssh_destination(tokens: list[str]) -> tuple[str, list[str]]:
    """`ssh [opts] DEST cmd...` -> (DEST host, cmd tokens)."""
    i = 1
    while i < len(tokens) and tokens[i].startswith("-"):
        i += 2 if tokens[i][-1] in SSH_VALUE_OPTS and len(tokens[i]) == 2 else 1
    return (_address(tokens[i]), tokens[i + 1:]) if i < len(tokens) else ("", [])


def docker_client_process(pid: int, args: str) -> DockerClientProcess | None:
    """A process's argv -> the container its `docker run`/`docker start` keeps running (None: not such a client)."""
    tokens = args.split()
    host = ""
    if tokens and tokens[0].rsplit("/", 1)[-1] == "ssh":
        host, tokens = _ssh_destination(tokens)
    if not tokens or tokens[0].rsplit("/", 1)[-1] != "docker":
        return None
    i = 1
    while i < len(tokens) and tokens[i].startswith("-"):
        opt, _, value = tokens[i].partition("=")
        if opt in ("-H", "--host"):
            host = _address(value or (tokens[i + 1] if i + 1 < len(tokens) else ""))
        i += 1 if value or opt not in DOCKER_VALUE_OPTS else 2
    rest = tokens[i + 1:] if tokens[i:i + 1] == ["container"] else tokens[i:]
    if rest[:1] == ["run"]:
        ref = _option(rest, "--name")
    elif rest[:1] == ["start"]:
        ref = next((t for j, t in enumerate(rest[1:], 1) if not t.startswith("-")
                    and rest[j - 1] not in START_VALUE_OPTS), "")
    else:
        return None
    return DockerClientProcess(pid, host, ref) if ref else None


def _option(tokens: list[str], name: str) -> str:
    for j, t in enumerate(tokens):
        if t == name and j + 1 < len(tokens):
            return tokens[j + 1]
        if t.startswith(name + "="):
            return t.split("=", 1)[1]
    return ""


def docker_clients(procs: dict[int, tuple[int, str]]) -> list[DockerClientProcess]:
    """Every docker run/start client among a node's processes."""
    return [c for pid, (_, args) in sorted(procs.items()) if (c := docker_client_process(pid, args))]
