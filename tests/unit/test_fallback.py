"""The driver's fall-back to the deployment before a run whose 04 set a live server's containers aside (issue 40,
item 1): which runs wait on one."""
from __future__ import annotations

import json
from pathlib import Path

from sparkbook.runbook import fallback


def events(run_dir: Path, *kinds: tuple[str, dict[str, object]]) -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "events.jsonl").write_text("".join(json.dumps({"at": "t", "stage": "04-ray-cluster", "kind": k,
                                                              "data": d}) + "\n" for k, d in kinds))
    return run_dir


ASIDE = {"run": "20261204T100000Z", "at": "2026-12-04T10:05:00+00:00", "nodes": ["lab-0", "lab-1"]}


def test_containers_set_aside_and_not_dropped_wait_for_the_rollback(tmp_path: Path) -> None:
    waiting = fallback.waiting_aside(events(tmp_path / "a", ("ray_join", {}), ("containers_set_aside", ASIDE)))
    assert waiting == fallback.SetAside("20261204T100000Z", "2026-12-04T10:05:00+00:00", ["lab-0", "lab-1"])


def test_nothing_waits_where_05_dropped_them_or_04_set_nothing_aside(tmp_path: Path) -> None:
    dropped = events(tmp_path / "b", ("containers_set_aside", ASIDE), ("containers_dropped", {"nodes": ["lab-0"]}))
    assert fallback.waiting_aside(dropped) is None, "the new server answered: nothing to roll back to"
    assert fallback.waiting_aside(events(tmp_path / "c", ("ray_join", {}))) is None
    assert fallback.waiting_aside(tmp_path / "no-events") is None
