"""The one root of every failure sparkbook expects: it names the node and stage where known, what to do, and what
kind of failure it is (which exit code a command line maps it to)."""
from __future__ import annotations

from typing import ClassVar, Literal

# What kind of failure it is: failed (a step, a notebook or a command on a node failed), invalid (the input is not
# one sparkbook can act on: params, a run request, a restore plan), locked (the run lock is held or cannot be taken),
# node (a node cannot be reached or used), gave_up (the watch's restarts did not keep the deployment serving).
ExitKind = Literal["failed", "invalid", "locked", "node", "gave_up"]


class SparkbookError(Exception):
    """An expected failure: `node` and `stage` say where, `remediation` what the engineer should do; the class says
    its `exit_kind` and the `label` a one-line report of it starts with.

    The text is the message, then ": remediation" where one is given. A stage's error class names its stage
    once, as the class attribute `stage`."""

    stage: str | None = None
    exit_kind: ClassVar[ExitKind] = "failed"
    label: ClassVar[str] = "error"

    def __init__(self, message: str, *, node: str | None = None, stage: str | None = None,
                 remediation: str | None = None):
        self.message, self.node, self.remediation = message, node, remediation
        self.stage = stage or self.stage
        super().__init__(f"{message}: {remediation}" if remediation else message)


class ProbeOutputError(SparkbookError):
    """A probe's reply is not whole (cut short, or without its end marker): never parsed as if it were."""

    def __init__(self, node: str, probe: str, missing: str, received_bytes: int):
        self.probe, self.missing, self.received_bytes = probe, missing, received_bytes
        super().__init__(f"{node}: {probe}: the probe's output has no {missing} ({received_bytes} bytes received)",
                         node=node, remediation="run the step again; if it repeats, run the probe by hand on the node")
