"""The lab's builder dockerd: a host daemon (no namespace) whose data root is the lab's image cache.

It runs with its own data root, exec root and socket under LAB_HOME/builder, without iptables or a
bridge (builds and checks use ``--network host``). It is started on demand and stopped by its PID only.
"""
from __future__ import annotations

import fcntl
import logging
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import IO

LAB_HOME = Path(os.environ.get("SPARKBOOK_LAB_HOME", "/var/lib/sparkbook-lab"))
BUILDER_DIR = LAB_HOME / "builder"
SOCKET = BUILDER_DIR / "docker.sock"
PIDFILE = BUILDER_DIR / "dockerd.pid"
LOGFILE = BUILDER_DIR / "dockerd.log"
DOCKERD = "/usr/sbin/dockerd"
START_TIMEOUT_S = 60.0

Progress = Callable[[str], None]
log = logging.getLogger(__name__)


def docker_cmd(*args: str, host: str | None = None) -> list[str]:
    """A docker CLI argument list aimed at ``host`` (default: the builder)."""
    return ["docker", "-H", host or f"unix://{SOCKET}", *args]


def default_progress(progress: Progress | None) -> Progress:
    """The given callback, or one that logs each line at INFO."""
    return progress or (lambda line: log.info("%s", line))


@contextmanager
def lab_lock(name: str) -> Iterator[None]:
    """An exclusive file lock under LAB_HOME/builder, so concurrent callers build things once."""
    BUILDER_DIR.mkdir(parents=True, exist_ok=True)
    with open(BUILDER_DIR / f"{name}.lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def builder_pid() -> int | None:
    """The running builder dockerd's PID from its pidfile, or None (checks the process is ours)."""
    try:
        pid = int(PIDFILE.read_text().strip())
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except (OSError, ValueError):
        return None
    if not _alive(pid):
        return None
    ours = Path(cmdline[0].decode()).name == "dockerd" and f"unix://{SOCKET}".encode() in cmdline
    return pid if ours else None


def _daemon_answers() -> bool:
    ok = subprocess.run(docker_cmd("version", "--format", "{{.Server.Version}}"),
                        capture_output=True, timeout=15)
    return ok.returncode == 0


def ensure_builder() -> int:
    """Start the builder dockerd unless it runs already; return its PID."""
    with lab_lock("dockerd"):
        pid = builder_pid()
        if pid is not None and _daemon_answers():
            return pid
        for sub in ("data", "exec"):
            (BUILDER_DIR / sub).mkdir(parents=True, exist_ok=True)
        argv = [DOCKERD, "--data-root", str(BUILDER_DIR / "data"), "--exec-root", str(BUILDER_DIR / "exec"),
                "-H", f"unix://{SOCKET}", "--pidfile", str(PIDFILE), "--iptables=false", "--bridge=none"]
        with open(LOGFILE, "ab") as logfh:
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=logfh, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"builder dockerd exited with {proc.returncode}; see {LOGFILE}")
            if SOCKET.exists() and _daemon_answers():
                log.info("builder dockerd up: pid %d, %s", proc.pid, SOCKET)
                return proc.pid
            time.sleep(0.5)
        _terminate(proc.pid)
        raise TimeoutError(f"builder dockerd did not answer within {START_TIMEOUT_S:.0f}s; see {LOGFILE}")


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie child is reaped and counts as gone)."""
    try:
        if os.waitpid(pid, os.WNOHANG)[0] == pid:
            return False
    except ChildProcessError:
        pass
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _terminate(pid: int, timeout_s: float = 30.0) -> None:
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not _alive(pid):
            return
        time.sleep(0.3)
    os.kill(pid, signal.SIGKILL)


def running_containers() -> list[str]:
    """Names of the containers running on the builder (empty when it is down)."""
    res = subprocess.run(docker_cmd("ps", "--format", "{{.Names}}"), capture_output=True, text=True, timeout=30)
    return res.stdout.split() if res.returncode == 0 else []


def stop_builder(force: bool = False) -> bool:
    """Stop the builder dockerd by its PID (never by name); True if it was stopped.

    A builder with running containers (someone's checks) is left alone unless ``force``. Its data root
    (the image cache) stays; the netns bind mount it leaves in its exec root is unmounted.
    """
    with lab_lock("dockerd"):
        pid = builder_pid()
        if pid is None:
            return False
        busy = running_containers()
        if busy and not force:
            log.info("builder dockerd left running: containers %s", " ".join(busy))
            return False
        _terminate(pid)
        netns = BUILDER_DIR / "exec" / "netns" / "default"
        if os.path.ismount(netns):
            subprocess.run(["umount", str(netns)], check=False)
        return True


def stream(argv: Sequence[str], progress: Progress | None = None, *, stdin: int | IO[bytes] | None = None,
           env: dict[str, str] | None = None, cwd: Path | None = None) -> list[str]:
    """Run ``argv``, passing each output line (stdout+stderr) to ``progress``; return all lines.

    Raises CalledProcessError (with the last lines as output) when the command fails.
    """
    emit = default_progress(progress)
    lines: list[str] = []
    proc = subprocess.Popen(list(argv), stdin=stdin, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, errors="replace", env=env, cwd=cwd, bufsize=1)
    assert proc.stdout is not None
    for raw in proc.stdout:
        line = raw.rstrip("\n")
        lines.append(line)
        emit(line)
    if proc.wait() != 0:
        raise subprocess.CalledProcessError(proc.returncode, list(argv), output="\n".join(lines[-40:]))
    return lines


def image_id(tag: str, host: str | None = None) -> str | None:
    """The image ID of ``tag`` in the daemon at ``host`` (default: builder), or None if absent."""
    res = subprocess.run(docker_cmd("image", "inspect", "--format", "{{.Id}}", tag, host=host),
                         capture_output=True, text=True, timeout=60)
    return res.stdout.strip() if res.returncode == 0 else None


def image_label(tag: str, label: str) -> str | None:
    """The value of ``label`` on the builder's image ``tag``, or None."""
    res = subprocess.run(docker_cmd("image", "inspect", "--format", f'{{{{index .Config.Labels "{label}"}}}}',
                                    tag), capture_output=True, text=True, timeout=60)
    value = res.stdout.strip()
    return value if res.returncode == 0 and value not in ("", "<no value>") else None
