"""The one root of every failure sparkbook expects: it names the node and stage where known, and what to do."""
from __future__ import annotations


class SparkbookError(Exception):
    """An expected failure: `node` and `stage` say where, `remediation` what the engineer should do.

    The text is the message, then ": remediation" where one is given. A stage's error class names its stage
    once, as the class attribute `stage`."""

    stage: str | None = None

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
