"""The runbook's seal on the run-dir files it acts on later (the manifest, state.json, the restore plan): an
HMAC-SHA256 over the file's bytes, in `<file>.sig` beside it, under a key only this controller's user can read. A
run dir is input anyone with write access to it (a colleague, a copied archive) could have planted; a file whose seal
does not match was not written by this runbook here, so nothing acts on it. Reading for display needs no seal."""
from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import stat
import tempfile
from pathlib import Path

from . import atomic
from .errors import SparkbookError

SUFFIX = ".sig"
KEY_NAME = "run-dir.key"


class SealError(SparkbookError):
    """A run-dir file the runbook would act on is not sealed by this controller's runbook, or the key is unsafe."""

    exit_kind = "invalid"


def key_file() -> Path:
    """~/.config/sparkbook/run-dir.key (XDG_CONFIG_HOME where set)."""
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "sparkbook" / KEY_NAME


def key() -> bytes:
    """The controller's sealing key, made on first use (mode 0600, never replaced once there); SealError where it is
    a link, another user's, or readable by group or others."""
    path = key_file()
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    if not path.exists() and not path.is_symlink():
        _create(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as exc:
        raise SealError(f"{path}: the sealing key cannot be opened ({exc.strerror})",
                        remediation="remove it (it must be a plain file): the next run makes a new one") from None
    with os.fdopen(fd, "rb") as fh:
        st = os.fstat(fh.fileno())
        if st.st_uid != os.geteuid() or stat.S_IMODE(st.st_mode) & 0o077 or not stat.S_ISREG(st.st_mode):
            raise SealError(f"{path}: the sealing key is another user's or readable by group/others "
                            f"(mode {stat.S_IMODE(st.st_mode):o})",
                            remediation=f"chmod 600 {path} if it is yours, else remove it")
        value = fh.read().strip()
    if len(value) < 32:
        raise SealError(f"{path}: the sealing key is empty or short", remediation="remove it: a new one is made")
    return value


def _create(path: Path) -> None:
    """Write a new key in full, then link it into place: a concurrent maker's key wins, never half of one."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".key.")
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(secrets.token_hex(32))
        try:
            os.link(tmp, path)
        except FileExistsError:
            pass
    finally:
        Path(tmp).unlink(missing_ok=True)


def signature(data: bytes) -> str:
    return hmac.new(key(), data, hashlib.sha256).hexdigest()


def sig_file(path: Path) -> Path:
    return path.with_name(path.name + SUFFIX)


def write(path: Path, data: str | bytes, mode: int | None = None) -> Path:
    """Write `path` atomically (with `mode`; None: as atomic.write keeps it) and its seal beside it."""
    raw = data.encode() if isinstance(data, str) else data
    sig = sig_file(path)
    sig.unlink(missing_ok=True)  # never a moment where the old seal vouches for new bytes
    atomic.write(path, raw, mode)
    atomic.write(sig, signature(raw) + "\n")
    return path


def problem(path: Path, raw: bytes | None = None) -> str | None:
    """Why `path` (whose bytes are `raw`, where read already) is not this runbook's (None: its seal matches)."""
    sig = sig_file(path)
    if not sig.is_file():
        return f"no {sig.name} beside it"
    try:
        raw = path.read_bytes() if raw is None else raw
    except OSError as exc:
        return f"it cannot be read ({exc.strerror})"
    if not hmac.compare_digest(sig.read_text().strip(), signature(raw)):
        return "its seal does not match (changed since this controller's runbook wrote it, or written elsewhere)"
    return None


def read(path: Path) -> bytes:
    """The bytes of `path`, verified against its seal; SealError (naming the file) where they are not this runbook's.
    FileNotFoundError where there is no file."""
    raw = path.read_bytes()
    why = problem(path, raw)
    if why is not None:
        raise SealError(f"{path}: not sealed by this controller's sparkbook ({why}); nothing was acted on",
                        remediation="use a run dir this controller's runbook wrote, or start a new run "
                                    "(`sparkbook run PARAMS`)")
    return raw
