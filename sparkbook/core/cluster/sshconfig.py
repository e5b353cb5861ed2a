"""Where a node's SSH address leads: looked up in the ssh config file as `ssh HOST` would (paramiko's SSHConfig).

Engineers reach their nodes as `ssh spark-2` through a Host entry (HostName, User, Port, IdentityFile,
UserKnownHostsFile, ProxyJump). A node whose `host` is such an alias is reached the same way; what params set
explicitly (ssh.user, ssh.port, ssh.key_file, ssh.known_hosts, a node's ssh_user/ssh_port) comes first, as
command-line options do for `ssh`. The host-key policy stays the cluster's: strict unless params say otherwise.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import paramiko

from ..values.params import NodeSpec, SSHSettings

DEFAULT_CONFIG = Path("~/.ssh/config")
MAX_JUMPS = 3


@dataclass(frozen=True)
class SSHTarget:
    """The address, user, keys and known_hosts to reach one host with, and the host to jump through first."""

    hostname: str
    port: int
    user: str
    key_files: tuple[str, ...]
    known_hosts: Path | None
    jump: SSHTarget | None = None

    @property
    def where(self) -> str:
        return f"{self.user}@{self.hostname}:{self.port}" + (f" via {self.jump.where}" if self.jump else "")


def config_file(settings: SSHSettings) -> Path | None:
    """The ssh config file to read: params' ssh.config_file, else ~/.ssh/config where it exists."""
    path = settings.config_file or DEFAULT_CONFIG.expanduser()
    return path if path.is_file() else None


def target(spec: NodeSpec, settings: SSHSettings) -> SSHTarget:
    """How to reach the node: its host through the config file's matching Host entries, params first."""
    return _resolve(spec.host, settings, spec.ssh_user, spec.ssh_port, _config(settings), MAX_JUMPS)


def _config(settings: SSHSettings) -> paramiko.SSHConfig | None:
    path = config_file(settings)
    return paramiko.SSHConfig.from_path(str(path)) if path else None


def _resolve(host: str, settings: SSHSettings, user: str | None, port: int | None,
             config: paramiko.SSHConfig | None, jumps_left: int, jump: SSHTarget | None = None) -> SSHTarget:
    """`host` through the config's Host entries; `jump` (from a ProxyJump list) before the entry's own."""
    entry = config.lookup(host) if config else {}
    explicit = settings.model_fields_set
    known = settings.known_hosts if "known_hosts" in explicit or "userknownhostsfile" not in entry else \
        Path(entry["userknownhostsfile"].split()[0]).expanduser()
    proxy_jump = entry.get("proxyjump", "none")
    if jump is None and proxy_jump.lower() != "none" and jumps_left > 0:
        jump = _chain(proxy_jump.split(","), settings, config, jumps_left - 1)
    return SSHTarget(
        hostname=entry.get("hostname", host),
        port=port or (settings.port if "port" in explicit or "port" not in entry else int(entry["port"])),
        user=user or (settings.user if "user" in explicit or "user" not in entry else entry["user"]),
        key_files=(str(settings.key_file),) if settings.key_file else
        tuple(str(Path(f).expanduser()) for f in entry.get("identityfile", [])),
        known_hosts=known, jump=jump)


def _chain(hops: list[str], settings: SSHSettings, config: paramiko.SSHConfig | None, jumps_left: int) -> SSHTarget:
    """A ProxyJump list ([user@]host[:port],...): the last hop, reached through the ones before it."""
    user, _, rest = hops[-1].strip().rpartition("@")
    host, _, port = rest.partition(":")
    before = _chain(hops[:-1], settings, config, jumps_left - 1) if len(hops) > 1 and jumps_left > 0 else None
    return _resolve(host, settings, user or None, int(port) if port else None, config, jumps_left, before)
