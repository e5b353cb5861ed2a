"""The controller's store of what the runbook learned about images (core.values.learned): one file per answer in
the cluster's outputs (`outputs/<cluster>/learned/<kind>-<key>.json`, rundir.learned_file), beside the runs.

    recall(run_dir, kind, image_id, parts, cls) -> (Recalled | None, why refused | None)
    keep(run_dir, learned) -> Path

Why it is sealed: an answer read back stands in for a probe, so a planted or edited file would choose an image that
was never probed. Each file is written whole (core.values.atomic) with its HMAC beside it, as the run dirs' state is
(core.values.seal), in a dir only this user can enter; a file whose seal, key, kind, image ID or schema does not
match is refused, said, and the image asked again.
"""
from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import TypeVar

from pydantic import TypeAdapter, ValidationError

from ..values import seal
from ..values.evidence import now, to_data
from ..values.learned import Learned, Recalled, memo_key
from ..values.rundir import learned_file

T = TypeVar("T")


def recall(run_dir: Path, kind: str, image_id: str | None, parts: Mapping[str, str], cls: type[T]
           ) -> tuple[Recalled[T] | None, str | None]:
    """The answer kept for (kind, image ID, parts), validated as `cls`: (it, None); (None, None) where none is kept or
    the image has no ID; (None, why) where the file is refused (not sealed here, torn, another key's, or not `cls`)."""
    if image_id is None:
        return None, None
    key = memo_key(kind, image_id, parts)
    path = learned_file(run_dir, kind, key)
    if not path.is_file():
        return None, None
    try:
        return _read(path, kind, image_id, key, cls), None
    except ValidationError as exc:
        wrong = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors()[:2])
        return None, f"{path.name} refused (not {cls.__name__}'s schema: {wrong[:200]}): asked again"
    except (OSError, ValueError, TypeError) as exc:
        return None, f"{path.name} refused ({str(exc).splitlines()[0][:200]}): asked again"


def _read(path: Path, kind: str, image_id: str, key: str, cls: type[T]) -> Recalled[T]:
    raw = path.read_bytes()
    why = seal.problem(path, raw)
    if why is not None:
        raise ValueError(f"not sealed by this controller's sparkbook: {why}")
    doc = json.loads(raw)
    if not isinstance(doc, dict) or (doc.get("kind"), doc.get("image_id"), doc.get("key")) != (kind, image_id, key):
        raise ValueError("it holds another answer than its name says")
    value = TypeAdapter(cls).validate_python(doc.get("value"))
    return Recalled(kind, image_id, value, str(doc.get("run")), str(doc.get("at")))


def keep(run_dir: Path, learned: Learned[object]) -> Path:
    """Write `learned` beside the cluster's runs, sealed, readable by this user alone."""
    path = learned_file(run_dir, learned.kind, learned.key)
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    doc = {"kind": learned.kind, "image_id": learned.image_id, "key": learned.key, "run": run_dir.name,
           "at": now(), "value": to_data(learned.value)}
    return seal.write(path, json.dumps(doc, indent=1, sort_keys=True), 0o600)
