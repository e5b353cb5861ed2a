"""Issue 43, item 2: a value from the cluster or the model (an architecture name, an inspection error, a log line, a
manifest's field) reaches every page as text: no live script, no `onerror` handler, no `javascript:` link, and no
link out of the run dir, in the run page, the cluster index, the compare page and each notebook's nbconvert page."""
from __future__ import annotations

import json
from collections.abc import Callable
from datetime import UTC, datetime
from html.parser import HTMLParser
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

import nbformat
import pytest
from rundirs import NAMES, make_run

from sparkbook import cli
from sparkbook.core.cluster.nodes import Result
from sparkbook.core.values.evidence import Alternative, Decision
from sparkbook.records import pages
from sparkbook.runbook import driver, session
from sparkbook.runbook.manifest import Manifest

X = "<script>alert(1)</script><img src=x onerror=alert(2)>"
JS = "javascript:alert(3)"
NAMED = [JS, "/etc/passwd", "../../outside.ipynb", "[a](javascript:alert(4))"]  # notebook names a manifest gives
SECRET = "tok_en_value_1234"  # params' secret (SPARKBOOK_TEST_TOKEN): `_` is markdown's, the escape must not split it


class Tags(HTMLParser):
    """A page's elements as the browser builds them: each tag with its attributes, and the text between."""

    def __init__(self, page: str):
        super().__init__(convert_charrefs=True)
        self.tags: list[tuple[str, dict[str, str]]] = []
        self.text: list[str] = []
        self.feed(page)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append((tag, {k: v or "" for k, v in attrs}))

    def handle_data(self, data: str) -> None:
        self.text.append(data)

    def hrefs(self) -> list[str]:
        return [a[k] for _, a in self.tags for k in ("href", "src") if k in a]


def assert_inert(page: str) -> Tags:
    """No script, no onerror, no javascript: link; and the hostile values are there, as text."""
    tags = Tags(page)
    assert [t for t, _ in tags.tags if t == "script"] == []
    assert [a for _, a in tags.tags if "onerror" in a] == []
    assert [h for h in tags.hrefs() if urlsplit(h.strip()).scheme.lower() == "javascript"] == []
    text = "".join(tags.text)
    assert "<script>alert(1)</script>" in text and "onerror=alert(2)" in text, "the values are shown, as text"
    return tags


def hostile_decision(i: int = 0) -> dict[str, Any]:
    return {"question": f"Which image serves {X}?", "choice": f"img:{i}{X}", "reason": f"{X} {SECRET}", "key": X,
            "alternatives": [{"option": X, "rejected_because": f"failed to be inspected: {X}"}], "evidence": [X]}


def hostile_run(cluster_dir: Path, run_id: str, i: int) -> Path:
    """A failed run whose every recorded value carries X: decisions, findings, events, the failing stage's log, the
    manifest's fields (notebook names among them) and the restore outcome."""
    events = [{"at": X, "stage": "05-serve", "kind": "serve_attempts",
               "data": [{"node": X, "attempt": X, "ready": False, "cause": X, "seconds": X}]},
              {"at": X, "stage": "03", "kind": "decision", "data": {"question": X, "choice": f"start {X}"}},
              {"at": X, "stage": "01", "kind": "container_stop", "data": {"node": X, "name": X}},
              {"at": X, "stage": "-", "kind": "restore_outcome", "data": {
                  "result": X, "conflicts": [{"node": X, "target": X, "what": X, "clear": X}],
                  "stopped_new": [], "actions": [{"node": X, "name": X, "command": X, "ok": False, "detail": X}],
                  "checks": [{"node": X, "name": X, "ok": False, "state": X, "health": X, "memory": X,
                              "problems": [X], "log_tail": X}]}}]
    run_dir = make_run(cluster_dir, run_id, statuses=["ok"] * 4 + ["failed", "pending"],
                       exception={"ename": X, "evalue": X, "cell_index": 1}, events=events,
                       decisions={nb[:2]: [hostile_decision(i)] for nb in NAMES},
                       findings=[{"severity": s, "topic": X, "text": X} for s in ("blocker", X)],
                       params_yaml=f"cluster: lab\nmodel: {json.dumps(X + str(i))}\n")
    (run_dir / "logs").mkdir()
    (run_dir / "logs" / "05-serve-head.log").write_text(f"INFO starting\nERROR {X}\n")
    manifest = json.loads((run_dir / "manifest.json").read_text())
    for nb in manifest["notebooks"]:
        nb.update(cell_limit_s=X, cell_limit_reason=X)
    manifest["notebooks"] += [{"name": name, "status": X, "decisions": []} for name in NAMED]
    manifest.update(parameters={X: f"{X}{i}"}, params_source=X, sparkbook_version=X, sparkbook_commit=X, started=X)
    (run_dir / "manifest.json").write_text(json.dumps(manifest))
    for name in (JS, f"{JS}.html"):  # a crafted run dir holds files of those names, so the link test is real
        (run_dir / name).write_text("x")
    (cluster_dir.parent / "outside.html").write_text("x")
    state = json.loads((run_dir / "state.json").read_text())
    state["image"]["ref"] = X
    state["ab"] = {"kept": X, "reason": X, "crossing": X}
    (run_dir / "state.json").write_text(json.dumps(state))
    return run_dir


@pytest.fixture
def outputs(tmp_path: Path) -> Path:
    hostile_run(tmp_path / "outputs" / "lab", "20261201T100000Z", 1)
    hostile_run(tmp_path / "outputs" / "lab", "20261201T110000Z", 2)
    return tmp_path / "outputs"


def assert_links_stay_inside(tags: Tags, run_dir: Path, also: tuple[str, ...] = ()) -> None:
    """Every link of a run's page leads to a file of the run dir (or one of `also`, the page's own links up)."""
    for href in tags.hrefs():
        if href not in also:
            target = (run_dir / unquote(href)).resolve()
            assert target.is_relative_to(run_dir.resolve()) and target.exists(), href


def test_the_run_page_shows_every_recorded_value_as_text(outputs: Path) -> None:
    run_dir = outputs / "lab" / "20261201T110000Z"
    page = driver.write_index(run_dir, Manifest.read(run_dir, sealed=False)).read_text()  # a page shows, never acts
    tags = assert_inert(page)
    assert_links_stay_inside(tags, run_dir, also=("../index.html",))
    assert "javascript%3Aalert%283%29" in tags.hrefs(), "a file named javascript:... is linked as that file"
    assert "Restore" in page and "cell limit" in page


def test_the_cluster_index_shows_every_run_as_text(outputs: Path) -> None:
    tags = assert_inert(pages.write_cluster_index(outputs / "lab").read_text())
    for href in tags.hrefs():
        assert (outputs / "lab" / unquote(href)).resolve().is_relative_to((outputs / "lab").resolve()), href


def test_the_compare_page_shows_both_runs_as_text(outputs: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["compare", "20261201T100000Z", "20261201T110000Z", "--outputs", str(outputs)]) == 0
    page = outputs / "lab" / "compare" / "20261201T100000Z-vs-20261201T110000Z.html"
    assert_inert(page.read_text())
    assert X + "1" in capsys.readouterr().out, "the parameters that differ are compared"


def shown_bundles(run: session.Run, monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """What the session displays of hostile values: a decision, a title, a table, text, command results."""
    bundles: list[dict[str, Any]] = []
    monkeypatch.setattr(session, "_display", bundles.append)
    run.decide(Decision(**{**hostile_decision(), "alternatives": [Alternative(X, X)]}))
    run.show([{"node": X, "architecture": X}], title=f"Architectures {X} {JS} [a](javascript:alert(4))")
    run.show(f"{X}\nvLLM: {X}")
    run.results([Result(X, ("vllm", X), 1, f"{X}\n" * 5, X, datetime.now(UTC), 0.1)], title=X)
    return bundles


def test_each_notebook_page_shows_what_the_session_displayed_as_text(
        tmp_path: Path, write_params: Callable[[dict[str, Any]], Path], base: dict[str, Any],
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPARKBOOK_TEST_TOKEN", SECRET)
    run_dir = tmp_path / "outputs" / "unit" / "20261201T100000Z"
    run = session.open_run(write_params(base), run_dir, stage="02-diagnosis")
    bundles = shown_bundles(run, monkeypatch)
    assert any("text/markdown" in b for b in bundles) and any("text/html" in b for b in bundles)
    notebook = nbformat.v4.new_notebook()
    cell = nbformat.v4.new_code_cell("run.show_all(preview.shown())")
    cell.outputs = [nbformat.v4.new_output("display_data", data=b) for b in bundles]
    notebook.cells.append(cell)
    nbformat.write(notebook, run_dir / "02-diagnosis.ipynb")
    assert driver._to_html(run_dir, "02-diagnosis.ipynb", print) == "02-diagnosis.html"
    page = (run_dir / "02-diagnosis.html").read_text()
    tags = assert_inert(page)
    assert SECRET not in page and "tok\\_en" not in page, "redacted before it is escaped"
    assert [a for t, a in tags.tags if t == "a" and "alert" in unquote(a.get("href", ""))] == []


def test_decision_markdown_escapes_after_redacting() -> None:
    md = Decision(X, f"**{X}**", SECRET).markdown(lambda s: s.replace(SECRET, "[REDACTED]"))
    assert "<" not in md and "onerror" in md and SECRET not in md
    assert md.startswith("**Decision — &lt;script&gt;") and "Chosen: **\\*\\*&lt;script" in md
