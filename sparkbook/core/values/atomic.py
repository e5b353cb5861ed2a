"""Whole files or none: what the runbook reads back (state, manifest, restore plan, pages) is written to a temporary
file beside its target and renamed over it, so a reader (or a run cut short) never meets half a file."""
from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path


def write(path: Path, data: str | bytes, mode: int | None = None) -> Path:
    """`data` as the whole of `path` (a link there is replaced, never followed), with `mode` (None: the mode of the
    file it replaces, 0644 for a new one)."""
    if mode is None:
        mode = stat.S_IMODE(path.lstat().st_mode) if path.is_file() and not path.is_symlink() else 0o644
    raw = data.encode() if isinstance(data, str) else data
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(raw)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path
