"""`sparkbook logs --follow`: each poll reads only what the log gained since the last one, from its byte offset.

Reading the whole log every poll grew with the log (a day's server log is megabytes, every 2 s, over SSH). One small
shell script on the node reads the log's size and the bytes from the offset up to that size, so what comes back is
exactly what was appended (a line still being written comes whole at the next poll). A log shorter than the offset
was written anew (a restart's 05 starts the same file again): it is read from its start and said so. More than
`limit` bytes new at once are skipped, but for their last `limit`, and the count is said."""
from __future__ import annotations

from dataclasses import dataclass

from ..core.cluster.nodes import Node, NodeError
from ..core.cluster.runtime import Place, Runtime

# $1 path, $2 offset, $3 limit: the line "SIZE START", then the bytes from max(START, SIZE - limit) up to SIZE
SCRIPT = ('size=$(wc -c <"$1") || exit 1; off=$2; [ "$size" -ge "$off" ] || off=0; from=$off; '
          '[ $((size - from)) -le "$3" ] || from=$((size - $3)); echo "$size $off"; '
          'tail -c +$((from + 1)) "$1" | head -c $((size - from))')
FOLLOW_LIMIT_BYTES = 1 << 20


@dataclass(frozen=True)
class Appended:
    """What one read found: `text` from the offset to `offset` (the log's size then, where the next read starts)."""

    offset: int
    text: str
    restarted: bool  # the log was shorter than the offset asked: written anew, read from its start
    skipped: int  # bytes new since the offset that were not read (more than the limit came at once)


def appended(runtime: Runtime, node: Node, place: Place, path: str, offset: int,
             limit: int = FOLLOW_LIMIT_BYTES) -> Appended:
    """The log's bytes from `offset` to its end (at most its last `limit`)."""
    out = runtime.exec(node, place, ["sh", "-c", SCRIPT, "sh", path, str(offset), str(limit)], timeout=30)
    head, _, text = out.stdout.partition("\n")
    try:
        size, start = (int(word) for word in head.split())
    except ValueError:
        raise NodeError(node.name, f"cannot read {path}: {(out.stderr or out.stdout).strip()[-200:]}") from None
    return Appended(size, text, start < offset, max(0, size - start - limit))
