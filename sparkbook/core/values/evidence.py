"""A run's evidence as plain values: the decisions, findings and events the stages return and the session records;
nothing here displays, connects or writes (the session that does is `runbook.session`)."""
from __future__ import annotations

import dataclasses
import html
import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Protocol

from .errors import SparkbookError
from .fanout import Outcome
from .learned import Learned
from .rundir import EVENTS
from .state import Handoff

# What markdown (CommonMark, as nbconvert's mistune and JupyterLab read it) would make a link, an image, emphasis, code
# or a table of; backslash-escaped, each stands for itself.
MARKDOWN_SYNTAX = re.compile(r"([\\`*_\[\]()!#|~])")


def markdown_text(value: object) -> str:
    """`value` as literal text inside markdown: a value from the cluster or the model (an architecture name, a log
    line, an image's inspection error) shows as what it says, never as HTML or a link the page would act on."""
    return MARKDOWN_SYNTAX.sub(r"\\\1", html.escape(str(value), quote=False))


def now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


@dataclass(frozen=True)
class Alternative:
    option: str
    rejected_because: str


@dataclass(frozen=True)
class Decision:
    """A choice made by a stage: what, over which alternatives, why, on what evidence."""

    question: str
    choice: str
    reason: str
    alternatives: list[Alternative] = field(default_factory=list)
    evidence: list[str] = field(default_factory=list)
    key: str | None = None  # stable name the records read it by ("image", "executor"), whatever the question's words

    def markdown(self, redact: Callable[[str], str]) -> str:
        """The decision as a cell's markdown, each value redacted and then escaped (`markdown_text`): redacting the
        escaped text would miss a secret the escapes split (`hf\\_...`)."""
        def v(text: str) -> str:
            return markdown_text(redact(text))

        lines = [f"**Decision — {v(self.question)}**", "", f"Chosen: **{v(self.choice)}** — {v(self.reason)}"]
        lines += [f"- rejected **{v(a.option)}**: {v(a.rejected_because)}" for a in self.alternatives]
        if self.evidence:
            lines += ["", "Evidence: " + "; ".join(v(x) for x in self.evidence)]
        return "\n".join(lines)


@dataclass(frozen=True)
class Finding:
    severity: str  # blocker | warning | fact
    topic: str
    text: str


@dataclass(frozen=True)
class Event:
    """One piece of evidence for events.jsonl that is not a decision: its kind ("serve_attempts") and its data."""

    kind: str
    data: object


@dataclass(frozen=True)
class Shown:
    """One thing a notebook cell shows: a title and a value the session renders (rows, text, a dataclass)."""

    title: str
    value: object


class Preview(Protocol):
    """What every stage's `preview` returns: what it would do, to show, and the hand-offs it would leave as far as a
    preview can tell (`sparkbook plan` hands them to the next stage's preview)."""

    @property
    def assumed(self) -> tuple[Handoff, ...]: ...

    def shown(self) -> list[Shown]: ...


class NotKnownYet(SparkbookError):
    """What a preview cannot tell before a run acts (the image is not on the node yet): `sparkbook plan` shows it
    as unknown, which is no failure; a node it cannot reach is one."""


def table_rows(data: object) -> list[dict[str, Any]] | None:
    """Plain data (`to_data`'s) as table rows where it is table-like: rows of mappings, or one mapping of scalars
    as field/value rows; None for text and nested data. The session and the command line render tables alike."""
    if isinstance(data, list) and data and all(isinstance(r, dict) for r in data):
        return data
    if isinstance(data, dict) and data and all(not isinstance(v, (dict, list)) for v in data.values()):
        return [{"field": k, "value": v} for k, v in data.items()]
    return None


@dataclass(kw_only=True)
class StageOutcome:
    """What every stage's `run` returns beside its own typed fields: the evidence in the order it happened
    (decisions and events), the hand-offs for the notebooks after it, the logs to keep, and the error that ended
    it (None: it ended ok), and what it learned about an image to keep by its ID (core.values.learned). The
    notebook records it (`Run.record_outcome`), which raises `error` once it is recorded, so a failed stage leaves
    the same evidence as a good one."""

    records: list[Decision | Event] = field(default_factory=list)
    handoffs: list[Handoff] = field(default_factory=list)
    logs: dict[str, str] = field(default_factory=dict)  # name under the run dir's logs/ -> text (redacted on write)
    learned: list[Learned[object]] = field(default_factory=list)
    error: SparkbookError | None = None

    def decide(self, decision: Decision) -> Decision:
        self.records.append(decision)
        return decision

    def event(self, kind: str, data: object) -> None:
        self.records.append(Event(kind, data))


def unreachable(outcomes: dict[str, Outcome[Any]]) -> list[Finding]:
    """Each node that failed, by name (NodeError messages already start with it)."""
    return [Finding("blocker", "node", str(o.error) if str(o.error).startswith(f"{n}:") else f"{n}: {o.error}")
            for n, o in outcomes.items() if not o.ok]


def to_data(value: Any) -> Any:
    """Plain JSON-able data from dataclasses, paths, datetimes and containers."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: to_data(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        return {str(k): to_data(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set)):
        return [to_data(v) for v in value]
    if isinstance(value, (Path, datetime)):
        return str(value)
    if hasattr(value, "model_dump"):
        return value.model_dump(mode="json")
    return value


@dataclass(frozen=True)
class ProbedBefore:
    """The image ID an earlier run of the cluster recorded under a candidate's name (its 03's image_probe event)."""

    image_id: str | None
    run: str  # that run's id


class EventsError(SparkbookError, ValueError):
    """A line of events.jsonl is not an event the session writes (torn by a write cut short, or planted)."""

    exit_kind = "invalid"


def read_events(run_dir: Path, kind: str | None = None) -> list[dict[str, Any]]:
    """The run's recorded events (all, or of one kind), oldest first; EventsError naming the first line that is not
    an event (a JSON object with its stage, kind and data)."""
    path = run_dir / EVENTS
    rows = []
    for number, line in enumerate(path.read_text(errors="replace").splitlines() if path.exists() else [], 1):
        try:
            row = json.loads(line)
        except ValueError:
            row = None
        if not (isinstance(row, dict) and isinstance(row.get("kind"), str) and "data" in row
                and isinstance(row.get("at", ""), str)):
            raise EventsError(f"{path}:{number}: not an event sparkbook writes (a torn or foreign line)",
                              remediation=f"move {path} aside, or delete that line, and run the command again")
        rows.append(row)
    return [r for r in rows if kind is None or r["kind"] == kind]


def tail(text: str, lines: int = 20) -> str:
    kept = text.rstrip().splitlines()[-lines:]
    return "\n".join(kept)
