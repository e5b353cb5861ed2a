"""Progress for long steps: a live widget in JupyterLab, plain lines under papermill and in terminals."""
from __future__ import annotations

import os
import sys
import time

HEADLESS_ENV = "SPARKBOOK_HEADLESS"


def interactive() -> bool:
    """True in a kernel with a live front end; the runner and tests set SPARKBOOK_HEADLESS=1."""
    if os.environ.get(HEADLESS_ENV):
        return False
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    shell = get_ipython()
    return shell is not None and getattr(shell, "kernel", None) is not None


class Progress:
    """`with Progress("copy image", total=bytes) as p: p.advance(n)`; lines at most every `every_s` seconds."""

    def __init__(self, label: str, total: float | None = None, unit: str = "", every_s: float = 5.0):
        self.label, self.total, self.unit, self.every_s = label, total, unit, every_s
        self.done = 0.0
        self.t0 = self._last = time.monotonic()
        self._widget = self._make_widget() if interactive() else None

    def _make_widget(self):  # type: ignore[no-untyped-def]
        import ipywidgets as widgets
        from IPython.display import display

        bar = widgets.FloatProgress(min=0, max=self.total or 1, description=self.label[:20])
        text = widgets.Label()
        box = widgets.HBox([bar, text])
        display(box)
        return bar, text

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.finish("failed" if exc[0] else "done")

    def advance(self, amount: float = 1, note: str = "") -> None:
        self.update(self.done + amount, note)

    def update(self, done: float, note: str = "") -> None:
        self.done = done
        now = time.monotonic()
        if self._widget:
            bar, text = self._widget
            bar.value = min(done, bar.max)
            text.value = self._status(note)
        elif now - self._last >= self.every_s:
            self._last = now
            print(f"[{self.label}] {self._status(note)}", file=sys.stdout, flush=True)

    def finish(self, outcome: str = "done") -> None:
        message = f"{outcome} in {time.monotonic() - self.t0:.1f} s"
        if self._widget:
            self._widget[1].value = f"{self._status('')} — {message}"
        else:
            print(f"[{self.label}] {message} ({self._status('')})", flush=True)

    def _status(self, note: str) -> str:
        elapsed = time.monotonic() - self.t0
        amount = f"{self.done:,.0f}{self.unit}" + (f" / {self.total:,.0f}{self.unit}" if self.total else "")
        rate = f", {self.done / elapsed:,.1f}{self.unit}/s" if elapsed > 0 and self.unit else ""
        return f"{amount}{rate}, {elapsed:.0f} s" + (f" — {note}" if note else "")
