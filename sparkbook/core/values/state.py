"""The run's state.json: the typed values one notebook hands the next, each under its key, with a schema version."""
from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError

from . import seal
from .errors import ExitKind, SparkbookError
from .rundir import STATE

VERSION_KEY = "schema_version"
VERSION = 2  # 1: untyped values and no schema_version (before the hand-offs were typed)


class Handoff(BaseModel):
    """A value one notebook leaves for the next: stored under `key` by `notebook`, validated when read."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    key: ClassVar[str]
    notebook: ClassVar[str]  # the notebook that writes it


H = TypeVar("H", bound=Handoff)


class StateError(SparkbookError):
    """state.json cannot give a value: another schema version wrote it, or the value fails its schema."""

    exit_kind: ClassVar[ExitKind] = "invalid"


class MissingState(StateError):
    """No notebook of this run has stored the hand-off yet: the one exception every notebook falls back on, naming
    the hand-off and the notebook that makes it."""

    exit_kind: ClassVar[ExitKind] = "failed"


class Handoffs:
    """The hand-offs a stage may read: a run dir's state.json (the runbook), or values given outright (`sparkbook
    plan` hands a preview what the previews before it would hand off). Read-only: stages return hand-offs, the
    notebook stores them."""

    def __init__(self, run_dir: Path | None = None, given: tuple[Handoff, ...] = (), stage: str | None = None):
        self.run_dir, self.given, self.stage = run_dir, given, stage

    def need(self, kind: type[H]) -> H:
        """The hand-off of type `kind`; MissingState (naming the notebook that writes it) where there is none."""
        for value in self.given:
            if isinstance(value, kind):
                return value
        if self.run_dir is None:
            raise MissingState(f"{kind.key!r} is not known yet", stage=self.stage,
                               remediation=f"run the notebook that sets it first ({kind.notebook})")
        return load(self.run_dir, kind, self.stage)

    def get(self, kind: type[H]) -> H | None:
        """The hand-off of type `kind`, None where no notebook of the run has stored it (the stage falls back)."""
        try:
            return self.need(kind)
        except MissingState:
            return None

    def adding(self, *values: Handoff) -> Handoffs:
        """These hand-offs beside the ones held (a later value of a kind wins)."""
        return Handoffs(self.run_dir, (*values, *self.given), self.stage)


def load(run_dir: Path, kind: type[H], stage: str | None = None, *, sealed: bool = True) -> H:
    """The value of type `kind` stored in the run dir, validated; with `sealed` (anything acted on) only from a
    state.json this controller's runbook sealed. `sealed=False`: for display only (a record from elsewhere)."""
    data = _read(run_dir, kind, stage, sealed)
    rerun = f"run {kind.notebook} (it writes {kind.key!r}) in this run dir again"
    if kind.key not in data:
        raise MissingState(f"{kind.key!r} is not in {run_dir / STATE}", stage=stage,
                           remediation=f"run the notebook that sets it first ({kind.notebook})")
    try:
        return kind.model_validate(data[kind.key])
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'value'}: {e['msg']}" for e in exc.errors()[:3])
        raise StateError(f"{run_dir / STATE}: {kind.key!r} does not match its schema ({problems})",
                         stage=stage, remediation=rerun) from None


def store(run_dir: Path, value: Handoff, redact: Callable[[Any], Any], stage: str | None = None) -> None:
    """Write `value` under its key, keeping the others; `redact` cleans the data before it is written."""
    data = _read(run_dir, type(value), stage)
    data[value.key] = redact(value.model_dump(mode="json"))
    data[VERSION_KEY] = VERSION
    seal.write(run_dir / STATE, json.dumps(data, indent=2, sort_keys=True))


def _read(run_dir: Path, kind: type[Handoff], stage: str | None, sealed: bool = True) -> dict[str, Any]:
    """The whole state ({} before the first value), verified against its seal (seal.SealError where this
    controller's runbook did not write it); a StateError when it is not this schema version's."""
    path = run_dir / STATE
    if not path.exists():
        return {}
    try:
        data = json.loads(seal.read(path) if sealed else path.read_bytes())
    except ValueError as exc:  # not JSON, or not UTF-8
        problem = f"is not JSON ({str(exc)[:100]})"
    else:
        version = data.get(VERSION_KEY) if isinstance(data, dict) else None
        if version == VERSION:
            state: dict[str, Any] = data
            return state
        problem = ("was written by an older sparkbook (no schema_version)" if version is None
                   else f"has schema_version {version!r}") + f", this sparkbook reads schema_version {VERSION}"
    remediation = (f"start a new run dir (sparkbook run PARAMS), or move {path} aside and run {kind.notebook} "
                   f"(it writes {kind.key!r}) and the notebooks after it again")
    raise StateError(f"{path} {problem}: {kind.key!r} cannot be trusted", stage=stage, remediation=remediation)
