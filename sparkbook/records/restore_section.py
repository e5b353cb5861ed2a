"""The Restore section of a run's page: each `sparkbook restore` of the run as its recorded outcome."""
from __future__ import annotations

import html
from pathlib import Path
from typing import Any

from ..core.values.evidence import read_events


def _lines(out: dict[str, Any]) -> list[str]:
    """What stood in the way, what was stopped and restored, and each restored service's check."""
    esc = html.escape
    lines = [f"{esc(c['node'])}: {esc(c['target'])}: {esc(c['what'])} (clear it: <code>{esc(c['clear'])}</code>)"
             for c in out["conflicts"]]
    lines += [f"{esc(a['node'])}: {esc(a['name'])}: <code>{esc(a['command'])}</code> "
              f"{'ok' if a['ok'] else 'FAILED: ' + esc(a['detail'])}" for a in out["stopped_new"] + out["actions"]]
    lines += [f"{esc(c['node'])}: {esc(c['name'])}: {'verified' if c['ok'] else 'NOT BACK'} — "
              f"{esc(c['state'])}; health {esc(c['health'])}; memory {esc(c['memory'])}"
              + "".join(f"<br>{esc(p)}" for p in c["problems"])
              + (f"<pre>{esc(c['log_tail'])}</pre>" if c["log_tail"] else "") for c in out["checks"]]
    return lines


def restore_section(run_dir: Path) -> str:
    """Each `sparkbook restore` of this run: refused with what stood in the way, or what it stopped and restored
    and each target's verdict ('' when none ran)."""
    items = []
    for event in read_events(run_dir, "restore_outcome"):
        try:
            out = event["data"]
            items.append(f'<li class="{html.escape(out["result"])}"><b>{html.escape(out["result"])}</b> at '
                         f"{html.escape(event['at'])}<ul>{''.join(f'<li>{line}</li>' for line in _lines(out))}"
                         "</ul></li>")
        except (KeyError, TypeError, AttributeError):  # a planted or older event: said, never half-rendered
            items.append(f"<li>a restore_outcome event at {html.escape(str(event.get('at')))} is not one sparkbook "
                         "writes: not shown</li>")
    return f"<h2>Restore</h2><ul>{''.join(items)}</ul>" if items else ""
