"""Every link of every committed HTML page under outputs/examples/ (the cluster indexes, each run's index.html)
resolves to a file committed in the repo, so the pages open on a clean clone with no broken links (issue 18, item 6).
Pages are read as git holds them (a copy of the index), never from the working tree: a local run writes its own
outputs/<cluster>/ beside the examples and must not change what these tests see (issue 27)."""
from __future__ import annotations

import os
import re
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest
from committed import EXAMPLES, examples, tracked


class Links(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.links: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.links += [v for k, v in attrs if k in ("href", "src") and v]


def local_links(page: Path) -> list[str]:
    """The page's links to files (external addresses, in-page anchors and data: URIs left out)."""
    parser = Links()
    parser.feed(page.read_text())
    return [link for link in parser.links
            if not urlsplit(link).scheme and not link.startswith("#") and not link.startswith("//")]


PAGES = tracked(f"{EXAMPLES}/*.html")


def test_the_cluster_indexes_and_run_pages_are_committed():
    clusters = {p.split("/")[2] for p in tracked(f"{EXAMPLES}/*/manifest.json")}
    assert clusters >= {"lab", "h200-duo", "h200-duo-mp"}
    for cluster in clusters:
        assert f"{EXAMPLES}/{cluster}/index.html" in PAGES
    for manifest in tracked(f"{EXAMPLES}/*/manifest.json"):
        assert str(Path(manifest).parent / "index.html") in PAGES


def broken_links(root: Path, page: str, files: set[str]) -> list[str]:
    """The page's file links (relative to its folder) whose target is not among `files` (paths from `root`)."""
    return [link for link in local_links(root / page)
            if os.path.normpath(os.path.join(os.path.dirname(page), unquote(urlsplit(link).path))) not in files]


@pytest.mark.parametrize("page", PAGES)
def test_every_link_resolves_to_a_committed_file(page: str):
    root = examples().parents[1]  # the copy's repo root: it holds exactly what git tracks under outputs/examples
    assert local_links(root / page), f"{page} links to nothing"
    assert broken_links(root, page, set(tracked())) == [], f"{page} links to files not in the repo"


def test_a_broken_link_is_caught(tmp_path: Path):
    (tmp_path / "c" / "r").mkdir(parents=True)
    (tmp_path / "c" / "index.html").write_text(
        '<a href="r/index.html">run</a> <a href="https://example.org/x">x</a> <a href="#top">t</a>'
        '<a href="r/params.yaml">params</a><img src="r/bench/throughput.png">'
        '<a href="../c/r/06-benchmark.ipynb">06</a>')
    files = {"c/index.html", "c/r/index.html", "c/r/06-benchmark.ipynb"}
    assert broken_links(tmp_path, "c/index.html", files) == ["r/params.yaml", "r/bench/throughput.png"]


def test_a_run_page_says_why_it_shows_no_findings():
    """The H200 records keep their notebooks but no state.json: 02 ran, its findings are in the notebook."""
    from sparkbook.records import archive, pages
    run_dir = examples() / "h200-duo/20261130T144302Z"
    page = pages.run_page(archive.read_run(run_dir))
    assert "this run dir keeps no state.json: the findings are in 02-diagnosis.ipynb" in page
    lab = pages.run_page(archive.read_run(examples() / "lab/20261130T150551Z"))
    assert "1 blocker(s)" in lab and "none recorded" not in lab


# An absolute path that leads into a run dir (any run id) or a cluster's outputs: dead on any other machine (issue 31).
INTO_A_RUN_DIR = re.compile(r"(?<![\w.])/(?!\.\.)[\w.-]+(?:/[\w.-]+)*/(?:\d{8}T\d{6}Z|outputs\d*/[\w.-]+)(?![\w])")
# Kept verbatim: the terminal's transcript of an H200 run and the notes a person wrote beside it.
TRANSCRIPTS = ("console.txt", "README.md")


def test_no_committed_run_dir_holds_an_absolute_path_into_a_run_dir():
    """Evidence, bench_dir, logs, the papermill parameters: all relative to the run dir, so the copy resolves."""
    root = examples().parents[1]
    found = {}
    for path in tracked(f"{EXAMPLES}/*/*/*"):
        if re.search(r"/\d{8}T\d{6}Z/", path) and not path.endswith(TRANSCRIPTS) \
                and path.endswith((".json", ".jsonl", ".ipynb", ".html", ".sh", ".md", ".txt")):
            hits = INTO_A_RUN_DIR.findall((root / path).read_text(errors="replace"))
            if hits:
                found[path] = hits[:3]
    assert found == {}


def test_the_absolute_path_pattern_finds_what_issue_31_found():
    for dead in ('"bench_dir": "/tmp/issue18/outputs/lab/20261201T195946Z/bench"',
                 "no earlier run with bench results under /tmp/pytest-of-root/pytest-43/outputs0/lab",
                 "full log: /tmp/sparkbook-runs/h200-duo/20261130T144302Z/logs/03-inspect.txt"):
        assert INTO_A_RUN_DIR.search(dead), dead
    for fine in ('"bench_dir": "bench"', "../20261130T150551Z/index.html", "/tmp/sparkbook/logs/serve-1.log",
                 "/srv/models/hyv4-tiny", '"params_file": "/tmp/lab1-fail05.yaml"'):
        assert not INTO_A_RUN_DIR.search(fine), fine
