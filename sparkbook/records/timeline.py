"""What the run changed on the cluster, in order: each stop, disable, kill, copy, image load, container or Ray
start, server start/replace/rollback and failure, with its time and node, read from events.jsonl.

Events are read by kind: the kinds below say how to list their actions; any other kind whose name says it acts
(ACTING) and whose data names a node is listed as it is, so a stage that records a new action needs no change here.
"""
from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

ACTING = re.compile(r"stop|disable|kill|copy|load|start|replace|rollback|fail|restore|remove")


@dataclass(frozen=True)
class Step:
    at: str
    node: str
    action: str
    detail: str


Data = Any
Extract = Callable[[str, Data], Iterator[Step]]


def _stopped(at: str, data: Data) -> Iterator[Step]:
    for s in data.get("stopped") or []:
        yield Step(at, str(s.get("node")), "stop", f"{s.get('name')}" + ("" if s.get("stopped") else " (still there)"))


def _copies(at: str, data: Data) -> Iterator[Step]:
    for c in data.get("copies") or []:
        what = data.get("image") or data.get("root") or "-"
        yield Step(at, str(c.get("node")), "image load" if data.get("image") else "copy",
                   f"{what}" + (f": {c['error']}" if c.get("error") else ""))


def _ray(at: str, data: Data) -> Iterator[Step]:
    for node in data.get("joined") or []:
        yield Step(at, str(node), "Ray node", "in the cluster (started or reused: see the decision)")
    for node in data.get("missing") or []:
        yield Step(at, str(node), "failure", "did not join the Ray cluster")


def _serve(at: str, data: Data) -> Iterator[Step]:
    for a in data or []:
        node = a.get("node") or "head"
        yield Step(at, str(node), "server start", f"attempt {a.get('attempt')}: "
                   + ("ready" if a.get("ready") else f"failed: {a.get('cause') or 'not ready'}")
                   + (f" after {a['seconds']} s" if a.get("seconds") is not None else ""))


def _decision(at: str, data: Data) -> Iterator[Step]:
    choice = str(data.get("choice") or "")
    if choice.startswith(("start", "replace", "stop", "reused", "roll")):
        yield Step(at, "-", "decision", f"{data.get('question')} {choice}")


KINDS: dict[str, Extract] = {"cleanup_verification": _stopped, "distribution": _copies, "model_copy": _copies,
                             "ray_join": _ray, "serve_attempts": _serve, "decision": _decision}


def _generic(kind: str, at: str, data: Data) -> Iterator[Step]:
    for item in data if isinstance(data, list) else [data]:
        if isinstance(item, dict) and item.get("node"):
            detail = ", ".join(f"{k} {v}" for k, v in item.items() if k != "node" and isinstance(v, str | int | float))
            yield Step(at, str(item["node"]), kind.replace("_", " "), detail[:300])


def steps(events: list[dict[str, Any]], failure: Step | None = None) -> list[Step]:
    """The run's actions in time order; `failure` (the failing notebook's end) is added at its time."""
    out: list[Step] = []
    for event in events:
        kind, at, data = event.get("kind", ""), str(event.get("at", "-")), event.get("data")
        if kind in KINDS:
            out += KINDS[kind](at, data)
        elif ACTING.search(kind):
            out += _generic(kind, at, data)
    if failure:
        out.append(failure)
    return sorted(out, key=lambda s: s.at)
