"""One value per node of a fan-out, its error beside it (fabric's GroupResult): plain values, no I/O."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar, cast

from .errors import SparkbookError

T = TypeVar("T")


@dataclass
class Outcome(Generic[T]):
    """One node's part of a fan-out: its value or its error, never both."""

    node: str
    value: T | None = None
    error: Exception | None = None
    duration_s: float = 0.0

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def ok_value(self) -> T:
        """The value of an outcome that is ok (test `ok` first): typed as T, where `value` may be None."""
        if self.error is not None:
            raise self.error
        return cast(T, self.value)


class FanOut(dict[str, Outcome[T]], Generic[T]):
    """A fan-out's outcomes by node name (a dict, in the order the nodes were given), with the failed and the
    succeeded ones apart and every failure told at once: none hides another."""

    @property
    def failed(self) -> FanOut[T]:
        return FanOut({name: o for name, o in self.items() if not o.ok})

    @property
    def succeeded(self) -> FanOut[T]:
        return FanOut({name: o for name, o in self.items() if o.ok})

    def errors(self) -> str:
        """Every failed node with its error, "; "-joined (an error that already names its node is not prefixed)."""
        return "; ".join(str(o.error) if str(o.error).startswith(f"{name}:") else f"{name}: {o.error}"
                         for name, o in self.failed.items())

    def values_or_raise(self, error: Callable[[str], Exception] = SparkbookError) -> list[T]:
        """Every node's value, in order; or one `error` naming every failed node with its error."""
        if self.failed:
            raise error(self.errors())
        return [o.value for o in self.values()]  # type: ignore[misc]
