"""Standalone programs that run on a node, in its container or in a candidate image (stdlib only, any Python 3).

Every probe defines `main() -> dict`; `source(name)` is its text with the one output convention appended:
one line `SPARKBOOK-JSON {document}`, then the line `SPARKBOOK-END`. `parse` takes a reply back to that
document and raises ProbeOutputError (naming node, probe, what is missing and the bytes received) for a reply
that is cut short, lacks either line or does not decode: never half a document. follow.py is no probe but a
wrapper: its main() ends the process with the wrapped command's status, so it prints no document.
"""
from __future__ import annotations

import json
from importlib.resources import files
from typing import TYPE_CHECKING, Any

from ...values.errors import ProbeOutputError

if TYPE_CHECKING:
    from ...cluster.nodes import Result

PREFIX = "SPARKBOOK-JSON "
END = "SPARKBOOK-END"
_RUN = f"""

import json as _json
print({PREFIX!r} + _json.dumps(main()) + "\\n" + {END!r}, flush=True)
"""


def source(name: str) -> str:
    """The program `name` (e.g. "registry"), to pass as `python3 -c SOURCE ARGS...`: prints its document."""
    return (files(__name__) / f"{name}.py").read_text() + _RUN


def parse(reply: Result | str, *, node: str, probe: str) -> dict[str, Any]:
    """The document of a probe's whole reply (a command's Result or its stdout); ProbeOutputError otherwise."""
    text = reply if isinstance(reply, str) else reply.stdout
    lines = text.splitlines()
    at = next((i for i in range(len(lines) - 1, -1, -1) if lines[i].startswith(PREFIX)), None)
    if at is None:
        raise ProbeOutputError(node, probe, "SPARKBOOK-JSON line", _size(text))
    if END not in (line.strip() for line in lines[at + 1:]):
        raise ProbeOutputError(node, probe, "end marker", _size(text))
    try:
        document = json.loads(lines[at].removeprefix(PREFIX))
    except ValueError:
        document = None
    if not isinstance(document, dict):
        raise ProbeOutputError(node, probe, "decodable JSON document", _size(text))
    return document


def _size(text: str) -> int:
    return len(text.encode(errors="replace"))
