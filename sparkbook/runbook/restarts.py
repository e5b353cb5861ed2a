"""The watch's restart rule: how long it waits before a restart, and when it stops restarting and gives up.

Like systemd's StartLimitBurst over StartLimitIntervalSec: at most `max_restarts` restarts within
`restart_window_s`, so an engine that dies once a week is brought back every time and one that dies every few minutes
ends the watch loudly instead of looping (each restart of a large model costs its whole load time)."""
from __future__ import annotations

from dataclasses import dataclass, field

from ..core.values.params import WatchSettings


def backoff_s(settings: WatchSettings, earlier: int) -> float:
    """The wait before a restart that `earlier` restarts in the window preceded: none before the first (the failure
    was confirmed by watch.failures_to_restart checks), backoff_s before the second, doubled for each one after, at
    most backoff_max_s."""
    if earlier <= 0:
        return 0.0
    return min(settings.backoff_s * 2 ** (earlier - 1), settings.backoff_max_s)


@dataclass
class Restarts:
    """The restarts one watch made (monotonic seconds), and what the next confirmed failure gets."""

    settings: WatchSettings
    at: list[float] = field(default_factory=list)

    def recent(self, now: float) -> int:
        """Restarts within the window ending now."""
        return sum(1 for t in self.at if now - t < self.settings.restart_window_s)

    def next_wait(self, now: float) -> float | None:
        """The back-off before the next restart; None: the window's restarts are spent, give up."""
        earlier = self.recent(now)
        return None if earlier >= self.settings.max_restarts else backoff_s(self.settings, earlier)

    def made(self, now: float) -> int:
        """Count a restart (a failed one too: it cost the same) and return its number within the window."""
        self.at.append(now)
        return self.recent(now)

    def withdraw(self) -> None:
        """Uncount the last restart: it was refused before it touched anything (a run held the lock)."""
        self.at.pop()
