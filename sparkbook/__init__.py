"""sparkbook: a notebook runbook from an old GPU deployment to vLLM over Ray, benchmarked.

`open_run` is what a notebook calls; `sparkbook.api` is the library contract, one typed function per operation.
Both load lazily, so importing a value module (the state schema, the archive) loads neither SSH nor Docker."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .runbook.session import Run, open_run

__all__ = ["Run", "open_run"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from .runbook import session

        return getattr(session, name)
    raise AttributeError(f"module 'sparkbook' has no attribute {name!r}")
