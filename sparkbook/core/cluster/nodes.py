"""Nodes: run argv-quoted commands over SSH (paramiko) or locally, with timeouts; fan out over nodes."""
from __future__ import annotations

import select
import shlex
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import IO, Any, ClassVar, Protocol, TypeVar

import paramiko
from tenacity import Retrying, retry_if_exception, stop_after_attempt, wait_incrementing

from ..values.errors import ExitKind, SparkbookError
from ..values.fanout import FanOut, Outcome
from ..values.params import NodeSpec, Params, SSHSettings
from . import sshconfig
from .sshconfig import SSHTarget

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


class NodeError(SparkbookError):
    """A node could not be used; the message names it and says what to do."""

    exit_kind: ClassVar[ExitKind] = "node"
    label = "node unusable"

    def __init__(self, node: str, reason: str, *, remediation: str | None = None):
        self.reason = reason
        super().__init__(f"{node}: {reason}", node=node, remediation=remediation)


class Unreachable(NodeError):
    pass


class AuthRefused(NodeError):
    pass


class HostKeyMismatch(NodeError):
    pass


class CommandFailed(NodeError):
    """A command ran on a reachable node and failed: the step failed, the node is usable."""

    exit_kind = "failed"
    label = "error"

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


class Sink(Protocol):
    """Where a stream's stdout goes, chunk by chunk: a file, or something that counts what passed."""

    def write(self, chunk: bytes, /) -> object: ...


def with_timeout(argv: Sequence[str], timeout: float) -> list[str]:
    """argv under coreutils' `timeout`, TERM at `timeout` s and KILL KILL_GRACE_S later: the side that runs it
    enforces the limit, so nothing stays running after we give up (`ended_by_timeout` reads its exit code)."""
    return ["timeout", "-k", str(KILL_GRACE_S), f"{timeout:g}", *argv]


def ended_by_timeout(code: int | None) -> bool:
    """Whether a command run `with_timeout` was ended by it: 124 (TERM), 137 (KILL), or no exit code (cut off)."""
    return code is None or code in (124, 137)


def _remote_argv(argv: Sequence[str], env: dict[str, str] | None, timeout: float) -> list[str]:
    """argv with its environment, under the node-side timeout."""
    prefix = ["env", *(f"{k}={v}" for k, v in env.items())] if env else []
    return with_timeout([*prefix, *argv], timeout)


class Node(ABC):
    """One cluster node, whatever reaches it: argv commands with a node-side timeout (`run`), byte streams
    (`stream`), files (`put`/`get`/`read_text`). SSHNode and LocalNode are its two transports; callers ask the
    node (`local`, `connect`, `streaming`) and never test which one it is."""

    local = False  # True where commands run on this machine itself, without SSH

    def __init__(self, spec: NodeSpec, ssh: SSHSettings, on_trust: Callable[[str, str], None] | None = None):
        self.spec, self.ssh = spec, ssh
        self.name = spec.name
        self._on_trust = on_trust

    @abstractmethod
    def connect(self) -> None:
        """Reach the node now (an SSH handshake), so a refusal names it before any command runs."""

    def streaming(self) -> Node:
        """The node over a connection for one long byte stream (the caller closes it unless it is this node)."""
        return self

    def run(self, argv: Sequence[str], *, timeout: float | None = None, env: dict[str, str] | None = None,
            stdin: bytes | None = None, check: bool = False) -> Result:
        """Run argv on the node; the node kills it after `timeout` seconds (default from params)."""
        timeout = timeout or self.ssh.command_timeout_s
        started, t0 = datetime.now(UTC), time.monotonic()
        out, err, code = self._exec(_remote_argv(argv, env, timeout), timeout + KILL_GRACE_S + 5, stdin)
        result = Result(self.name, tuple(argv), code, out, err, started, time.monotonic() - t0, ended_by_timeout(code))
        return result.check() if check else result

    @abstractmethod
    def _exec(self, argv: list[str], deadline_s: float, stdin: bytes | None) -> tuple[str, str, int | None]:
        """argv as given (already wrapped in its timeout): (stdout, stderr, exit code or None if cut off)."""

    @abstractmethod
    def stream(self, argv: Sequence[str], *, source: IO[bytes] | None = None, sink: Sink | None = None,
               timeout: float | None = None, on_bytes: Callable[[int], None] | None = None) -> Result:
        """Run argv with stdin fed from `source` or stdout copied to `sink`, in chunks (for image streams)."""

    @abstractmethod
    def put(self, local: Path, remote: str) -> None:
        """Copy a local file to the node."""

    @abstractmethod
    def get(self, remote: str, local: Path) -> None:
        """Copy a file of the node here."""

    @abstractmethod
    def close(self) -> None:
        """Close the connection (a later command opens a new one)."""

    def read_text(self, remote: str) -> str:
        return self.run(["cat", remote], check=True).stdout


class SSHNode(Node):
    """One cluster node reached over SSH; commands are argv lists, never strings built from params."""

    def __init__(self, spec: NodeSpec, ssh: SSHSettings, on_trust: Callable[[str, str], None] | None = None):
        super().__init__(spec, ssh, on_trust)
        self.target = sshconfig.target(spec, ssh)
        self._client: paramiko.SSHClient | None = None
        self._jumps: list[paramiko.SSHClient] = []  # connections to ProxyJump hosts, closed with the node's
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"Node({self.name}@{self.target.where})"

    # --- connection -------------------------------------------------------------------------
    def connect_kwargs(self, target: SSHTarget | None = None) -> dict[str, object]:
        target = target or self.target
        return dict(
            hostname=target.hostname,
            port=target.port,
            username=target.user,
            key_filename=list(target.key_files) or None,
            timeout=self.ssh.connect_timeout_s,
            banner_timeout=self.ssh.connect_timeout_s,
            auth_timeout=self.ssh.connect_timeout_s,
            look_for_keys=not target.key_files,
            allow_agent=False,
        )

    def new_client(self, target: SSHTarget | None = None) -> paramiko.SSHClient:
        """An unconnected client with this cluster's host-key policy (strict unless params say otherwise) and the
        target's known_hosts (params', else the ssh config's UserKnownHostsFile, else the system's)."""
        known_hosts = (target or self.target).known_hosts
        client = paramiko.SSHClient()
        if known_hosts is None:
            client.load_system_host_keys()
        elif known_hosts.exists():
            client.load_host_keys(str(known_hosts))
        if self.ssh.host_key_policy == "trust_on_first_use":
            client.set_missing_host_key_policy(_TrustOnFirstUse(known_hosts, self._on_trust))
        else:
            client.set_missing_host_key_policy(paramiko.RejectPolicy())
        return client

    def client(self) -> paramiko.SSHClient:
        with self._lock:
            client = self._client
            transport = client.get_transport() if client else None
            if client is None or transport is None or not transport.is_active():
                self._client = None
                client = self.new_client()
                self._connect(client)
                self._client = client
            return client

    def connect(self) -> None:
        self.client()

    def streaming(self) -> Node:
        """A second connection with AES-GCM where the node offers one, else this node's usual connection."""
        fast = BulkNode(self.spec, self.ssh)
        try:
            fast.connect()
        except NodeError:
            return self
        return fast

    def _connect(self, client: paramiko.SSHClient, target: SSHTarget | None = None) -> None:
        target = target or self.target
        kwargs = self.connect_kwargs(target)
        where = f"{kwargs['username']}@{kwargs['hostname']}:{kwargs['port']}"
        try:
            self._connect_with_retry(client, kwargs, lambda: self._socket(target, kwargs))
        except paramiko.BadHostKeyException as exc:
            raise HostKeyMismatch(self.name, f"host key of {where} does not match {target.known_hosts} "
                                  f"(got {_fingerprint(exc.key)})", remediation="the node was reinstalled or this "
                                  "is not the node you think; verify, then update known_hosts") from None
        except paramiko.AuthenticationException:
            raise AuthRefused(self.name, f"{where} refused key {', '.join(target.key_files) or '(none given)'}",
                              remediation="add its public key to the node's authorized_keys") from None
        except paramiko.SSHException as exc:
            if "not found in known_hosts" in str(exc):
                raise HostKeyMismatch(self.name, f"{where} is not in {target.known_hosts}",
                                      remediation="add its host key (ssh-keyscan, verified) or set "
                                                  "ssh.host_key_policy: trust_on_first_use") from None
            if any(s in str(exc) for s in HANDSHAKE_STUCK):
                raise Unreachable(self.name, f"{where} accepted the connection but its sshd did not complete "
                                  f"the SSH handshake within {self.ssh.connect_timeout_s:g} s ({exc}): is sshd hung "
                                  "or stopped?") from None
            raise Unreachable(self.name, f"SSH to {where} failed: {exc}") from None
        except (TimeoutError, OSError) as exc:
            raise Unreachable(self.name, f"cannot reach {where} within {self.ssh.connect_timeout_s:g} s: "
                              f"{exc or type(exc).__name__}") from None

    def _socket(self, target: SSHTarget, kwargs: dict[str, object]) -> socket.socket | paramiko.Channel:
        """The byte stream to the target's sshd: a TCP connection, or a channel through its ProxyJump host (reached
        with the same host-key policy)."""
        if target.jump is None:
            return _tcp_nodelay(kwargs)
        hop = self.new_client(target.jump)
        self._connect(hop, target.jump)
        self._jumps.append(hop)
        return self._transport(hop).open_channel("direct-tcpip", (target.hostname, target.port), ("127.0.0.1", 0),
                                                timeout=self.ssh.connect_timeout_s)

    def _connect_with_retry(self, client: paramiko.SSHClient, kwargs: dict[str, Any],
                            sock: Callable[[], socket.socket | paramiko.Channel], tries: int = 3) -> None:
        """A loaded node can drop the banner exchange: retry that (after 1 s, 2 s, ...), never a refusal or a
        host-key problem."""
        Retrying(stop=stop_after_attempt(tries), wait=wait_incrementing(start=1, increment=1),
                 retry=retry_if_exception(lambda exc: isinstance(exc, paramiko.SSHException) and "banner" in str(exc)),
                 before_sleep=lambda state: client.close(), reraise=True)(
            lambda: client.connect(**kwargs, sock=sock()))

    def _transport(self, client: paramiko.SSHClient) -> paramiko.Transport:
        """The client's live transport (Unreachable where the connection has just gone)."""
        transport = client.get_transport()
        if transport is None:
            raise Unreachable(self.name, "the SSH connection closed")
        return transport

    def close(self) -> None:
        with self._lock:
            for client in filter(None, [self._client, *self._jumps]):
                client.close()
            self._client, self._jumps = None, []

    # --- commands ---------------------------------------------------------------------------
    def _exec(self, argv: list[str], deadline_s: float, stdin: bytes | None) -> tuple[str, str, int | None]:
        channel = self._transport(self.client()).open_session(timeout=self.ssh.connect_timeout_s)
        try:
            channel.settimeout(self.ssh.connect_timeout_s)
            channel.exec_command(shlex.join(argv))
            if stdin:
                channel.sendall(stdin)
            channel.shutdown_write()
            out = bytearray()
            err, code = _reply(channel, time.monotonic() + deadline_s, out.extend)
        finally:
            channel.close()
        return out.decode(errors="replace"), err.decode(errors="replace"), code

    def stream(self, argv: Sequence[str], *, source: IO[bytes] | None = None, sink: Sink | None = None,
               timeout: float | None = None, on_bytes: Callable[[int], None] | None = None) -> Result:
        """Run argv with stdin fed from `source` or stdout copied to `sink`, in chunks (for image streams)."""
        timeout = timeout or self.ssh.command_timeout_s
        started, t0 = datetime.now(UTC), time.monotonic()
        channel = self._transport(self.client()).open_session(timeout=self.ssh.connect_timeout_s)
        channel.settimeout(timeout)
        channel.exec_command(shlex.join(_remote_argv(argv, None, timeout)))
        out = bytearray()

        def on_stdout(chunk: bytes) -> None:
            if sink is None:
                out.extend(chunk)
                return
            sink.write(chunk)
            if on_bytes:
                on_bytes(len(chunk))

        try:
            if source is not None:
                while chunk := source.read(1 << 20):
                    channel.sendall(chunk)
                    if on_bytes:
                        on_bytes(len(chunk))
                channel.shutdown_write()
            err, code = _reply(channel, t0 + timeout + KILL_GRACE_S, on_stdout)
        finally:
            channel.close()  # a broken sink or source ends the remote side at once, not at its timeout
        return Result(self.name, tuple(argv), code, out.decode(errors="replace"), err.decode(errors="replace"),
                      started, time.monotonic() - t0, ended_by_timeout(code))

    def put(self, local: Path, remote: str) -> None:
        with self.client().open_sftp() as sftp:
            _sftp_timeout(sftp, self.ssh.command_timeout_s)
            sftp.put(str(local), remote)

    def get(self, remote: str, local: Path) -> None:
        with self.client().open_sftp() as sftp:
            _sftp_timeout(sftp, self.ssh.command_timeout_s)
            sftp.get(remote, str(local))


def _sftp_timeout(sftp: paramiko.SFTPClient, seconds: float) -> None:
    channel = sftp.get_channel()
    if channel is not None:
        channel.settimeout(seconds)


def _tcp_nodelay(kwargs: dict[str, object]) -> socket.socket:
    """The TCP connection for SSH, with Nagle off: small SSH packets (channel open, exec, exit status) otherwise
    wait out the peer's delayed ACK, 40 ms per command round trip (measured: `true` 49 ms with Nagle, 8 ms without)."""
    sock = socket.create_connection((str(kwargs["hostname"]), int(kwargs["port"])),  # type: ignore[call-overload]
                                    timeout=float(kwargs["timeout"]))  # type: ignore[arg-type]
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


class BulkNode(SSHNode):
    """A second SSH connection to a node for one image stream, with AES-GCM: paramiko's default
    aes-ctr + hmac-sha2-256 costs about a fifth more CPU per byte, which a busy 2-core node feels."""

    def connect_kwargs(self, target: SSHTarget | None = None) -> dict[str, object]:
        ciphers = [c for c in paramiko.Transport._preferred_ciphers if "-gcm@" not in c]  # type: ignore[attr-defined]
        return {**super().connect_kwargs(target), "disabled_algorithms": {"ciphers": ciphers}}


class LocalNode(Node):
    """The machine the notebooks run on, reached without SSH (a single box running its own runbook)."""

    local = True

    def connect(self) -> None:
        """Nothing to reach: commands run here."""

    def _exec(self, argv: list[str], deadline_s: float, stdin: bytes | None) -> tuple[str, str, int | None]:
        try:
            proc = subprocess.run(argv, input=stdin or b"", capture_output=True, timeout=deadline_s)
        except subprocess.TimeoutExpired as exc:
            return (exc.stdout or b"").decode(errors="replace"), (exc.stderr or b"").decode(errors="replace"), None
        return proc.stdout.decode(errors="replace"), proc.stderr.decode(errors="replace"), proc.returncode

    def stream(self, argv: Sequence[str], *, source: IO[bytes] | None = None, sink: Sink | None = None,
               timeout: float | None = None, on_bytes: Callable[[int], None] | None = None) -> Result:
        timeout = timeout or self.ssh.command_timeout_s
        started, t0 = datetime.now(UTC), time.monotonic()
        # stderr goes to a file: a pipe nobody reads while stdout is copied would stop the process when it fills
        with tempfile.TemporaryFile() as err_file, \
                subprocess.Popen(_remote_argv(argv, None, timeout), stdin=subprocess.PIPE if source else None,
                                 stdout=subprocess.PIPE, stderr=err_file) as proc:
            pipe_from = source if source else proc.stdout
            pipe_to: Sink | None = proc.stdin if source else sink
            while pipe_from is not None and pipe_to is not None and (chunk := pipe_from.read(1 << 20)):
                pipe_to.write(chunk)
                if on_bytes:
                    on_bytes(len(chunk))
            try:  # communicate() closes stdin after the source (closing it here first made it raise)
                out, _ = proc.communicate(timeout=max(0.0, t0 + timeout + KILL_GRACE_S - time.monotonic()))
                code = proc.returncode
            except subprocess.TimeoutExpired:  # a reply that ends at the deadline is cut: timed out, not complete
                proc.kill()
                out, code = b"", None
            err_file.seek(0)
            err = err_file.read()
        return Result(self.name, tuple(argv), code, (out or b"").decode(errors="replace"),
                      err.decode(errors="replace"), started, time.monotonic() - t0, ended_by_timeout(code))

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


def _reply(channel: paramiko.Channel, end: float, on_stdout: Callable[[bytes], None]) -> tuple[bytes, int | None]:
    """Read stdout (to `on_stdout`) and stderr until the channel's EOF, then its exit status; wakes on data.
    The exit status arrives apart from the output (an SSH server may send it first): only EOF ends the output.
    Returns (stderr, exit status); the status is None when `end` (monotonic) came first: the reply may be cut."""
    err = bytearray()
    poll = select.poll()
    poll.register(channel.fileno(), select.POLLIN)  # readable while either stream has data, and after EOF
    while True:
        ended = channel.eof_received or channel.closed  # read before draining: all data precedes the EOF
        while channel.recv_ready():
            on_stdout(channel.recv(1 << 20))
        while channel.recv_stderr_ready():
            err += channel.recv_stderr(1 << 20)
        left = end - time.monotonic()
        if ended or left <= 0:
            break
        poll.poll(left * 1000)
    if not ended or not channel.status_event.wait(max(0.0, end - time.monotonic())):
        return bytes(err), None
    return bytes(err), channel.exit_status


@dataclass
class Cluster:
    """The nodes of one params file, connected lazily."""

    params: Params
    on_trust: Callable[[str, str], None] | None = None
    # how fan-out shows nodes answering: (label, total) -> a context with advance(note=...); None shows nothing
    progress: Callable[[str, int], AbstractContextManager[Any]] | None = None
    nodes: dict[str, Node] = field(init=False)

    def __post_init__(self) -> None:
        self.nodes = {s.name: (LocalNode if s.transport == "local" else SSHNode)(s, self.params.ssh, self.on_trust)
                      for s in self.params.nodes}

    @property
    def head(self) -> Node:
        return self.nodes[self.params.head.name]

    @property
    def workers(self) -> list[Node]:
        return [self.nodes[s.name] for s in self.params.workers]

    def __iter__(self) -> Iterator[Node]:
        return iter(self.nodes.values())

    def fan_out(self, step: Callable[[Node], T], nodes: Sequence[Node] | None = None,
                timeout: float | None = None, label: str = "nodes answered") -> FanOut[T]:
        """Run `step` on every node in parallel; each node's error is kept, none hides another.
        The cluster's progress (`label`) counts the nodes as they answer."""
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
        with self.progress(label, len(targets)) if self.progress else nullcontext() as bar:
            try:
                for fut in as_completed(futures, timeout=timeout):
                    out = answered[futures[fut]] = fut.result()
                    if bar:
                        bar.advance(note=f"{out.node} {'answered' if out.ok else 'failed'} in {out.duration_s:.1f} s")
            except TimeoutError:
                pass
        pool.shutdown(wait=False, cancel_futures=True)
        got = {name: answered.get(name) or Outcome(name, error=NodeError(name, f"no answer within {timeout:g} s"),
                                                   duration_s=timeout) for name in futures.values()}
        return FanOut(got)

    def close(self) -> None:
        for node in self:
            node.close()
