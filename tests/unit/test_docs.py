"""The README stays a front page (at most 1,500 words, issue 54) whose depth lives in docs/, and no link of the
README or of a docs page leads nowhere: every relative link names a file, and every #anchor a heading of it."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def links(page: Path) -> list[str]:
    """The relative targets of a page's markdown links (web addresses left out)."""
    return [t for t in LINK.findall(page.read_text()) if not re.match(r"[a-z]+:", t)]


def anchors(page: Path) -> set[str]:
    """The anchors GitHub gives a page's headings: lower case, punctuation dropped, spaces as hyphens."""
    headings = re.findall(r"^#+ (.+)$", page.read_text(), flags=re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


def broken(page: Path) -> list[str]:
    found = []
    for target in links(page):
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.is_file():
            found.append(f"{target}: no such file")
        elif anchor and anchor not in anchors(dest):
            found.append(f"{target}: no such heading in {dest.name}")
    return found


def test_readme_is_a_front_page_of_at_most_1500_words() -> None:
    assert len((ROOT / "README.md").read_text().split()) <= 1500


def test_readme_links_every_docs_page() -> None:
    linked = {(ROOT / t.partition("#")[0]).resolve() for t in links(ROOT / "README.md")}
    assert [p.name for p in PAGES[1:] if p.resolve() not in linked] == []


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_relative_link_resolves(page: Path) -> None:
    assert broken(page) == []


def test_a_broken_link_and_a_missing_heading_are_found(tmp_path: Path) -> None:
    (tmp_path / "other.md").write_text("# Replicas behind vLLM's router\n")
    page = tmp_path / "page.md"
    page.write_text("[a](other.md#replicas-behind-vllms-router) [b](gone.md) [c](other.md#nope) [d](https://x.org)")
    assert broken(page) == ["gone.md: no such file", "other.md#nope: no such heading in other.md"]


def test_readme_gives_the_two_commands_in_the_order_ci_runs_them() -> None:
    readme, ci = (ROOT / "README.md").read_text(), (ROOT / ".ci" / "run").read_text()
    assert readme.index("make runbook") < readme.index("make test ")
    assert ci.index("make runbook") < ci.index("make test")
    assert "fresh Debian machine, as root" in readme
