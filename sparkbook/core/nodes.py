"""Nodes: run argv-quoted commands over SSH (paramiko) or locally, with timeouts; fan out over nodes."""
from __future__ import annotations

import shlex
import shutil
import socket
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import IO, Callable, Generic, Sequence, TypeVar

import paramiko
from tenacity import Retrying, retry_if_exception, stop_after_attempt, wait_incrementing

from .params import NodeSpec, Params, SSHSettings
from .progress import Progress

T = TypeVar("T")
KILL_GRACE_S = 5
# what paramiko says when the TCP connection opened but sshd never answered (no banner, no key exchange)
HANDSHAKE_STUCK = ("No existing session", "Error reading SSH protocol banner", "Negotiation timed out")


@dataclass(frozen=True)
class Result:
    """One command on one node: what ran, how it ended, what it printed."""

    node: str
    argv: tuple[str, ...]
    exit_code: int | None
    stdout: str
    stderr: str
    started: datetime
    duration_s: float
    timed_out: bool = False

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out

    @property
    def command(self) -> str:
        return shlex.join(self.argv)

    def check(self) -> Result:
        if not self.ok:
            raise CommandFailed(self)
        return self


class NodeError(Exception):
    """A node could not be used; the message names it and says what to do."""

    def __init__(self, node: str, reason: str):
        self.node, self.reason = node, reason
        super().__init__(f"{node}: {reason}")


class Unreachable(NodeError):
    pass


class AuthRefused(NodeError):
    pass


class HostKeyMismatch(NodeError):
    pass


class CommandFailed(NodeError):
    def __init__(self, result: Result):
        self.result = result
        what = "timed out" if result.timed_out else f"exited {result.exit_code}"
        tail = (result.stderr.strip() or result.stdout.strip())[-600:]
        super().__init__(result.node, f"`{result.command}` {what}: {tail}")


def shell(template: str, **values: str | int) -> list[str]:
    """argv for `sh -c TEMPLATE` with every value shell-quoted: the only way params reach a shell."""
    return ["sh", "-c", _filled(template, values)]


def bash(template: str, **values: str | int) -> list[str]:
    """shell() for scripts that need bash (regex matches, /dev/tcp), without the node's rc files."""
    return ["bash", "--norc", "--noprofile", "-c", _filled(template, values)]


def _filled(template: str, values: dict[str, str | int]) -> str:
    return template.format(**{k: shlex.quote(str(v)) for k, v in values.items()})


def _remote_argv(argv: Sequence[str], env: dict[str, str] | None, timeout: float) -> list[str]:
    """Wrap argv so the node itself enforces the timeout: nothing stays running after we give up."""
    prefix = ["env", *(f"{k}={v}" for k, v in env.items())] if env else []
    return ["timeout", "-k", str(KILL_GRACE_S), f"{timeout:g}", *prefix, *argv]


class Node:
    """One cluster node reached over SSH; commands are argv lists, never strings built from params."""

    def __init__(self, spec: NodeSpec, ssh: SSHSettings, on_trust: Callable[[str, str], None] | None = None):
        self.spec, self.ssh = spec, ssh
        self.name = spec.name
        self._on_trust = on_trust
        self._client: paramiko.SSHClient | None = None
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"Node({self.name}@{self.spec.host})"

    # --- connection -------------------------------------------------------------------------
    def connect_kwargs(self) -> dict[str, object]:
        return dict(
            hostname=self.spec.host,
            port=self.spec.ssh_port or self.ssh.port,
            username=self.spec.ssh_user or self.ssh.user,
            key_filename=str(self.ssh.key_file) if self.ssh.key_file else None,
            timeout=self.ssh.connect_timeout_s,
            banner_timeout=self.ssh.connect_timeout_s,
            auth_timeout=self.ssh.connect_timeout_s,
            look_for_keys=self.ssh.key_file is None,
            allow_agent=False,
        )

    def new_client(self) -> paramiko.SSHClient:
        """An unconnected client with this cluster's host-key policy (strict unless params say otherwise)."""
        client = paramiko.SSHClient()
        if self.ssh.known_hosts is None:
            client.load_system_host_keys()
        elif self.ssh.known_hosts.exists():
            client.load_host_keys(str(self.ssh.known_hosts))
        if self.ssh.host_key_policy == "trust_on_first_use":
            client.set_missing_host_key_policy(_TrustOnFirstUse(self.ssh.known_hosts, self._on_trust))
        else:
            client.set_missing_host_key_policy(paramiko.RejectPolicy())
        return client

    def client(self) -> paramiko.SSHClient:
        with self._lock:
            transport = self._client.get_transport() if self._client else None
            if transport is None or not transport.is_active():
                self._client = None
                client = self.new_client()
                self._connect(client)
                self._client = client
            return self._client

    def _connect(self, client: paramiko.SSHClient) -> None:
        kwargs = self.connect_kwargs()
        where = f"{kwargs['username']}@{kwargs['hostname']}:{kwargs['port']}"
        try:
            self._connect_with_retry(client, kwargs)
        except paramiko.BadHostKeyException as exc:
            raise HostKeyMismatch(self.name, f"host key of {where} does not match {self.ssh.known_hosts} "
                                  f"(got {_fingerprint(exc.key)}): the node was reinstalled or this is not "
                                  "the node you think; verify, then update known_hosts") from None
        except paramiko.AuthenticationException:
            raise AuthRefused(self.name, f"{where} refused key {self.ssh.key_file}: "
                              "add its public key to the node's authorized_keys") from None
        except paramiko.SSHException as exc:
            if "not found in known_hosts" in str(exc):
                raise HostKeyMismatch(self.name, f"{where} is not in {self.ssh.known_hosts}: add its host key "
                                      "(ssh-keyscan, verified) or set ssh.host_key_policy: trust_on_first_use") from None
            if any(s in str(exc) for s in HANDSHAKE_STUCK):
                raise Unreachable(self.name, f"{where} accepted the connection but its sshd did not complete "
                                  f"the SSH handshake within {self.ssh.connect_timeout_s:g} s ({exc}): is sshd hung "
                                  "or stopped?") from None
            raise Unreachable(self.name, f"SSH to {where} failed: {exc}") from None
        except (OSError, socket.timeout) as exc:
            raise Unreachable(self.name, f"cannot reach {where} within {self.ssh.connect_timeout_s:g} s: "
                              f"{exc or type(exc).__name__}") from None

    def _connect_with_retry(self, client: paramiko.SSHClient, kwargs: dict[str, object], tries: int = 3) -> None:
        """A loaded node can drop the banner exchange: retry that (after 1 s, 2 s, ...), never a refusal or a
        host-key problem."""
        Retrying(stop=stop_after_attempt(tries), wait=wait_incrementing(start=1, increment=1),
                 retry=retry_if_exception(lambda exc: isinstance(exc, paramiko.SSHException) and "banner" in str(exc)),
                 before_sleep=lambda state: client.close(), reraise=True)(
            lambda: client.connect(**kwargs, sock=_tcp_nodelay(kwargs)))

    def close(self) -> None:
        with self._lock:
            if self._client:
                self._client.close()
            self._client = None

    # --- commands ---------------------------------------------------------------------------
    def run(self, argv: Sequence[str], *, timeout: float | None = None, env: dict[str, str] | None = None,
            stdin: bytes | None = None, check: bool = False) -> Result:
        """Run argv on the node; the node kills it after `timeout` seconds (default from params)."""
        timeout = timeout or self.ssh.command_timeout_s
        started, t0 = datetime.now(timezone.utc), time.monotonic()
        out, err, code = self._exec(_remote_argv(argv, env, timeout), timeout + KILL_GRACE_S + 5, stdin)
        timed_out = code in (124, 137) or code is None
        result = Result(self.name, tuple(argv), code, out, err, started, time.monotonic() - t0, timed_out)
        return result.check() if check else result

    def _exec(self, argv: list[str], deadline_s: float, stdin: bytes | None) -> tuple[str, str, int | None]:
        channel = self.client().get_transport().open_session(timeout=self.ssh.connect_timeout_s)
        channel.settimeout(1.0)
        channel.exec_command(shlex.join(argv))
        if stdin:
            channel.sendall(stdin)
        channel.shutdown_write()
        out, err = bytearray(), bytearray()
        end = time.monotonic() + deadline_s
        while time.monotonic() < end:
            _drain(channel, out, err)
            if channel.exit_status_ready() and not channel.recv_ready() and not channel.recv_stderr_ready():
                break
            channel.status_event.wait(0.02)  # wakes at once when the exit status arrives
        code = channel.recv_exit_status() if channel.exit_status_ready() else None
        _drain(channel, out, err)
        channel.close()
        return out.decode(errors="replace"), err.decode(errors="replace"), code

    def stream(self, argv: Sequence[str], *, source: IO[bytes] | None = None, sink: IO[bytes] | None = None,
               timeout: float | None = None, on_bytes: Callable[[int], None] | None = None) -> Result:
        """Run argv with stdin fed from `source` or stdout copied to `sink`, in chunks (for image streams)."""
        timeout = timeout or self.ssh.command_timeout_s
        started, t0 = datetime.now(timezone.utc), time.monotonic()
        channel = self.client().get_transport().open_session(timeout=self.ssh.connect_timeout_s)
        channel.settimeout(timeout)
        channel.exec_command(shlex.join(_remote_argv(argv, None, timeout)))
        out, err = bytearray(), bytearray()
        try:
            if source is not None:
                while chunk := source.read(1 << 20):
                    channel.sendall(chunk)
                    if on_bytes:
                        on_bytes(len(chunk))
                channel.shutdown_write()
            elif sink is not None:
                while chunk := channel.recv(1 << 20):
                    sink.write(chunk)
                    if on_bytes:
                        on_bytes(len(chunk))
            while not channel.exit_status_ready() and time.monotonic() - t0 < timeout + KILL_GRACE_S:
                _drain(channel, out, err)
                time.sleep(0.05)
            _drain(channel, out, err)
            code = channel.recv_exit_status() if channel.exit_status_ready() else None
        finally:
            channel.close()  # a broken sink or source ends the remote side at once, not at its timeout
        return Result(self.name, tuple(argv), code, out.decode(errors="replace"), err.decode(errors="replace"),
                      started, time.monotonic() - t0, code in (124, 137) or code is None)

    def put(self, local: Path, remote: str) -> None:
        with self.client().open_sftp() as sftp:
            sftp.get_channel().settimeout(self.ssh.command_timeout_s)
            sftp.put(str(local), remote)

    def get(self, remote: str, local: Path) -> None:
        with self.client().open_sftp() as sftp:
            sftp.get_channel().settimeout(self.ssh.command_timeout_s)
            sftp.get(remote, str(local))

    def read_text(self, remote: str) -> str:
        return self.run(["cat", remote], check=True).stdout


def _tcp_nodelay(kwargs: dict[str, object]) -> socket.socket:
    """The TCP connection for SSH, with Nagle off: small SSH packets (channel open, exec, exit status) otherwise
    wait out the peer's delayed ACK, 40 ms per command round trip (measured: `true` 49 ms with Nagle, 8 ms without)."""
    sock = socket.create_connection((str(kwargs["hostname"]), int(kwargs["port"])),  # type: ignore[call-overload]
                                    timeout=float(kwargs["timeout"]))  # type: ignore[arg-type]
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


class LocalNode(Node):
    """The machine the notebooks run on, reached without SSH (a single box running its own runbook)."""

    def client(self) -> paramiko.SSHClient:
        raise NodeError(self.name, "is a local node: it has no SSH client")

    def _exec(self, argv: list[str], deadline_s: float, stdin: bytes | None) -> tuple[str, str, int | None]:
        try:
            proc = subprocess.run(argv, input=stdin or b"", capture_output=True, timeout=deadline_s)
        except subprocess.TimeoutExpired as exc:
            return (exc.stdout or b"").decode(errors="replace"), (exc.stderr or b"").decode(errors="replace"), None
        return proc.stdout.decode(errors="replace"), proc.stderr.decode(errors="replace"), proc.returncode

    def stream(self, argv: Sequence[str], *, source: IO[bytes] | None = None, sink: IO[bytes] | None = None,
               timeout: float | None = None, on_bytes: Callable[[int], None] | None = None) -> Result:
        timeout = timeout or self.ssh.command_timeout_s
        started, t0 = datetime.now(timezone.utc), time.monotonic()
        with subprocess.Popen(_remote_argv(argv, None, timeout), stdin=subprocess.PIPE if source else None,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) as proc:
            pipe_from, pipe_to = (source, proc.stdin) if source else (proc.stdout, sink)
            while pipe_to is not None and (chunk := pipe_from.read(1 << 20)):
                pipe_to.write(chunk)
                if on_bytes:
                    on_bytes(len(chunk))
            if source:
                proc.stdin.close()
            out, err = proc.communicate(timeout=timeout + KILL_GRACE_S)
        return Result(self.name, tuple(argv), proc.returncode, (out or b"").decode(errors="replace"),
                      err.decode(errors="replace"), started, time.monotonic() - t0, proc.returncode in (124, 137))

    def put(self, local: Path, remote: str) -> None:
        shutil.copyfile(local, remote)

    def get(self, remote: str, local: Path) -> None:
        shutil.copyfile(remote, local)

    def close(self) -> None:
        pass


class _TrustOnFirstUse(paramiko.MissingHostKeyPolicy):
    """Accept an unknown host key once, write it to known_hosts, and report its fingerprint."""

    def __init__(self, known_hosts: Path | None, on_trust: Callable[[str, str], None] | None):
        self.known_hosts, self.on_trust = known_hosts, on_trust

    def missing_host_key(self, client: paramiko.SSHClient, hostname: str, key: paramiko.PKey) -> None:
        client.get_host_keys().add(hostname, key.get_name(), key)
        if self.known_hosts:
            self.known_hosts.parent.mkdir(parents=True, exist_ok=True)
            client.save_host_keys(str(self.known_hosts))
        if self.on_trust:
            self.on_trust(hostname, _fingerprint(key))


def _fingerprint(key: paramiko.PKey) -> str:
    return f"{key.get_name()} SHA256:{key.fingerprint.split(':', 1)[-1]}" if hasattr(key, "fingerprint") \
        else key.get_name()


def _drain(channel: paramiko.Channel, out: bytearray, err: bytearray) -> None:
    while channel.recv_ready():
        out += channel.recv(1 << 16)
    while channel.recv_stderr_ready():
        err += channel.recv_stderr(1 << 16)


@dataclass
class Outcome(Generic[T]):
    """One node's part of a fan-out: its value or its error, never both."""

    node: str
    value: T | None = None
    error: Exception | None = None
    duration_s: float = 0.0

    @property
    def ok(self) -> bool:
        return self.error is None


@dataclass
class Cluster:
    """The nodes of one params file, connected lazily."""

    params: Params
    on_trust: Callable[[str, str], None] | None = None
    nodes: dict[str, Node] = field(init=False)

    def __post_init__(self) -> None:
        self.nodes = {s.name: (LocalNode if s.transport == "local" else Node)(s, self.params.ssh, self.on_trust)
                      for s in self.params.nodes}

    @property
    def head(self) -> Node:
        return self.nodes[self.params.head.name]

    @property
    def workers(self) -> list[Node]:
        return [self.nodes[s.name] for s in self.params.workers]

    def __iter__(self):
        return iter(self.nodes.values())

    def fan_out(self, step: Callable[[Node], T], nodes: Sequence[Node] | None = None,
                timeout: float | None = None, label: str = "nodes answered") -> dict[str, Outcome[T]]:
        """Run `step` on every node in parallel; each node's error is kept, none hides another.
        Progress (`label`) counts the nodes as they answer."""
        targets = list(nodes if nodes is not None else self)
        timeout = timeout or self.params.ssh.command_timeout_s + self.params.ssh.connect_timeout_s + 15

        def one(node: Node) -> Outcome[T]:
            t0 = time.monotonic()
            try:
                return Outcome(node.name, value=step(node), duration_s=time.monotonic() - t0)
            except Exception as exc:  # every failure is reported per node
                return Outcome(node.name, error=exc, duration_s=time.monotonic() - t0)

        pool = ThreadPoolExecutor(max_workers=max(1, len(targets)), thread_name_prefix="fan-out")
        futures = {pool.submit(one, n): n.name for n in targets}
        answered: dict[str, Outcome[T]] = {}
        with Progress(label, total=len(targets)) as bar:
            try:
                for fut in as_completed(futures, timeout=timeout):
                    out = answered[futures[fut]] = fut.result()
                    bar.advance(note=f"{out.node} {'answered' if out.ok else 'failed'} in {out.duration_s:.1f} s")
            except TimeoutError:
                pass
        pool.shutdown(wait=False, cancel_futures=True)
        return {name: answered.get(name) or Outcome(name, error=NodeError(name, f"no answer within {timeout:g} s"),
                                                      duration_s=timeout) for name in futures.values()}

    def close(self) -> None:
        for node in self:
            node.close()
