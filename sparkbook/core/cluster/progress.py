"""Progress for long steps: a live widget in JupyterLab, plain lines under papermill and in terminals.

Headless (SPARKBOOK_HEADLESS set, as the runner, `make` and the tests do; or no kernel) a step prints a
line at most every `every_s` seconds and one closing line, so an archived notebook holds text, never
widget JSON. In a kernel with a front end the step shows a progress bar that updates while the cell runs.
"""
from __future__ import annotations

import os
import sys
import threading
import time
from typing import Any

HEADLESS_ENV = "SPARKBOOK_HEADLESS"
WIDGET_CLASS = "sparkbook-progress"  # the CSS class of the widget's box (the browser test looks for it)
WIDGET_EVERY_S = 0.25  # a bar fed per chunk would flood the front end with comm messages


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
    """`with Progress("copy image", total=bytes) as p: p.advance(n)`; safe to feed from worker threads."""

    def __init__(self, label: str, total: float | None = None, unit: str = "", every_s: float = 5.0):
        self.label, self.total, self.unit, self.every_s = label, total, unit, every_s
        self.done, self.note = 0.0, ""
        self.t0 = self._last = time.monotonic()
        self._printed = False
        self._lock = threading.Lock()
        self._widget = self._make_widget() if interactive() else None

    def _make_widget(self) -> tuple[Any, Any]:
        """The bar and its status label (ipywidgets has no type hints: Any)."""
        import ipywidgets as widgets
        from IPython.display import display

        bar = widgets.FloatProgress(min=0, max=self.total or 1, bar_style="info")
        text = widgets.Label(value=self._status(""))
        box = widgets.HBox([widgets.Label(value=self.label), bar, text])
        box.add_class(WIDGET_CLASS)
        display(box)  # type: ignore[no-untyped-call]  # IPython's display() has no annotations
        return bar, text

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.finish("failed" if exc[0] else "done")

    def advance(self, amount: float = 1, note: str = "") -> None:
        with self._lock:
            done = self.done + amount
        self.update(done, note)

    def update(self, done: float, note: str = "") -> None:
        with self._lock:
            self.done, self.note = done, note or self.note
            now = time.monotonic()
            every = WIDGET_EVERY_S if self._widget else self.every_s
            if now - self._last < every:
                return
            self._last = now
            if self._widget:
                bar, text = self._widget
                bar.value = min(done, bar.max)
                text.value = self._status(note)
            else:
                self._printed = True
                print(f"[{self.label}] {self._status(note)}", file=sys.stdout, flush=True)

    def finish(self, outcome: str = "done") -> None:
        """Close the step; headless, a step shorter than `every_s` that printed nothing stays silent."""
        elapsed = time.monotonic() - self.t0
        message = f"{outcome} in {elapsed:.1f} s"
        with self._lock:
            if self._widget:
                bar, text = self._widget
                bar.value = min(self.done, bar.max)
                bar.bar_style = "success" if outcome == "done" else "danger"
                text.value = f"{self._status(self.note)} — {message}"
            elif self._printed or elapsed >= self.every_s or outcome != "done":
                print(f"[{self.label}] {message} ({self._status(self.note)})", flush=True)

    def _status(self, note: str) -> str:
        elapsed = time.monotonic() - self.t0
        amount = f"{self.done:,.0f}{self.unit}" + (f" / {self.total:,.0f}{self.unit}" if self.total else "")
        rate = f", {self.done / elapsed:,.1f}{self.unit}/s" if elapsed > 0 and self.unit else ""
        return f"{amount}{rate}, {elapsed:.0f} s" + (f" — {note}" if note else "")
