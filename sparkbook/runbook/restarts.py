"""The watch's restart rule: how long it waits before a restart, and when it stops restarting and gives up.

Like systemd's StartLimitBurst over StartLimitIntervalSec: at most `max_restarts` restarts within
`restart_window_s`, so an engine that dies once a week is brought back every time and one that dies every few minutes
ends the watch loudly instead of looping (each restart of a large model costs its whole load time). The restarts are
kept on disk per cluster (outputs/<cluster>/watch-restarts.json, wall-clock times, replaced whole at each change): a
watch that systemd restarts, or a crash, does not start a fresh budget."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from ..core.values import atomic
from ..core.values.errors import SparkbookError
from ..core.values.params import WatchSettings


class BudgetUnreadable(SparkbookError):
    """The cluster's restart budget file is not one the watch wrote: refused, never guessed at."""

    exit_kind = "invalid"
    label = "refused"


def backoff_s(settings: WatchSettings, earlier: int) -> float:
    """The wait before a restart that `earlier` restarts in the window preceded: none before the first (the failure
    was confirmed by watch.failures_to_restart checks), backoff_s before the second, doubled for each one after, at
    most backoff_max_s."""
    if earlier <= 0:
        return 0.0
    return min(settings.backoff_s * 2 ** (earlier - 1), settings.backoff_max_s)


@dataclass
class Restarts:
    """The restarts the cluster's watches made (seconds since the epoch), and what the next confirmed failure gets;
    with a `path`, every change is written there."""

    settings: WatchSettings
    at: list[float] = field(default_factory=list)
    path: Path | None = None

    @classmethod
    def kept(cls, settings: WatchSettings, path: Path) -> Restarts:
        """The budget as the cluster's last watch left it (none yet: an empty one)."""
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            return cls(settings, [], path)
        except OSError as exc:
            raise _unreadable(path, exc.strerror or str(exc)) from None
        with os.fdopen(fd) as fh:
            try:
                data = json.load(fh)
            except ValueError:
                raise _unreadable(path, "it is not JSON") from None
        at = data.get("restarts") if isinstance(data, dict) else None
        if not isinstance(at, list) or not all(isinstance(t, int | float) and not isinstance(t, bool) for t in at):
            raise _unreadable(path, 'it holds no "restarts" list of times')
        return cls(settings, [float(t) for t in at], path)

    def recent(self, now: float) -> int:
        """Restarts within the window ending now (one stamped later than now counts: a clock set back)."""
        return sum(1 for t in self.at if now - t < self.settings.restart_window_s)

    def next_wait(self, now: float) -> float | None:
        """The back-off before the next restart; None: the window's restarts are spent, give up."""
        earlier = self.recent(now)
        return None if earlier >= self.settings.max_restarts else backoff_s(self.settings, earlier)

    def made(self, now: float) -> int:
        """Count a restart (a failed one too: it cost the same) and return its number within the window."""
        self.at = [t for t in self.at if now - t < self.settings.restart_window_s] + [now]
        self._keep()
        return self.recent(now)

    def withdraw(self) -> None:
        """Uncount the last restart: it was refused before it touched anything (a run held the lock)."""
        self.at.pop()
        self._keep()

    def _keep(self) -> None:
        """Replace the file whole (a temporary file renamed over it): a watch killed mid-write leaves the old one."""
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        atomic.write(self.path, json.dumps({"restarts": self.at}), 0o600)


def _unreadable(path: Path, why: str) -> BudgetUnreadable:
    return BudgetUnreadable(f"{path} is not the watch's restart budget: {why}",
                            remediation="remove it to start the watch with a fresh budget")
