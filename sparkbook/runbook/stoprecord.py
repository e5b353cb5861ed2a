"""An operator's `sparkbook stop` as recorded in the run whose deployment it stopped: when, the nodes it stopped and
the nodes it could not reach. `stop` writes it whether it reached every node or not, and the watch reads it back:
an operator's stop is a decision the watch never undoes, a partial one included (what it could not reach was meant
to stop too, and a restart would bring back what it did stop)."""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ..core.values.evidence import read_events

KIND = "operator_stop"


@dataclass(frozen=True)
class OperatorStop:
    """One recorded stop: `stopped` the nodes it reached, `unreached` the others with why."""

    at: str
    stopped: list[str] = field(default_factory=list)
    unreached: dict[str, str] = field(default_factory=dict)

    @property
    def partial(self) -> bool:
        return bool(self.unreached)

    def describe(self) -> str:
        if not self.partial:
            return f"stopped by `sparkbook stop` at {self.at}"
        return (f"partly stopped by `sparkbook stop` at {self.at} (stopped on {', '.join(self.stopped) or 'no node'}; "
                f"not reached: {', '.join(self.unreached)})")


def payload(at: str, keep_ray: bool, stopped: Sequence[object], unreached: Mapping[str, str]) -> dict[str, object]:
    """The event's data as `stop` records it (`stopped`: each node's NodeStopped)."""
    return {"at": at, "keep_ray": keep_ray, "nodes": list(stopped), "unreached": dict(unreached),
            "partial": bool(unreached)}


def _read(event: dict[str, object]) -> OperatorStop:
    data = event.get("data")
    data = data if isinstance(data, dict) else {}
    nodes = data.get("nodes")
    unreached = data.get("unreached")
    return OperatorStop(str(data.get("at") or event["at"]),
                        [str(n["node"]) for n in nodes if isinstance(n, dict) and "node" in n]
                        if isinstance(nodes, list) else [],
                        {str(k): str(v) for k, v in unreached.items()} if isinstance(unreached, dict) else {})


def last(run_dir: Path, after: str) -> OperatorStop | None:
    """The run's last stop that holds now: a partial one whenever it came, a whole one after `after` (an ISO time;
    a deployment seen serving since a whole stop was brought back, and its next failure is not that stop's)."""
    stops = [_read(e) for e in read_events(run_dir, KIND)]
    holding = [s for s in stops if s.partial or s.at > after]
    return holding[-1] if holding else None
