"""Issue 43, item 7: `sparkbook runs` and `compare` write only into a cluster's outputs (or the `--html` file named),
never to a path a record's values build; a dir that holds no run sparkbook wrote is refused, one line and exit 2."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from rundirs import make_run

from sparkbook import cli
from sparkbook.cli import exits
from sparkbook.records import archive, pages

A, B = "20261201T100000Z", "20261201T110000Z"


@pytest.fixture
def users_dir(tmp_path: Path) -> Path:
    """A user's own site: its index.html, and a web app's manifest.json in a dir named like a run id."""
    site = tmp_path / "site"
    (site / A).mkdir(parents=True)
    (site / A / "manifest.json").write_text(json.dumps({"name": "my app", "start_url": "/"}))
    (site / "index.html").write_text("my own page")
    return site


def test_runs_refuses_a_dir_that_holds_no_run_and_leaves_its_index(users_dir: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["runs", str(users_dir)]) == exits.EXIT_INVALID
    err = capsys.readouterr().err
    assert err.startswith("refused: ") and err.count("\n") == 1 and "no cluster's outputs" in err
    assert (users_dir / "index.html").read_text() == "my own page"


def test_the_cluster_index_is_written_only_into_a_clusters_outputs(users_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(archive.NotOutputs):
        pages.write_cluster_index(users_dir)
    assert (users_dir / "index.html").read_text() == "my own page"
    make_run(tmp_path / "lab", A)
    assert pages.write_cluster_index(tmp_path / "lab").read_text().startswith("<!doctype html>")


def test_runs_by_cluster_name_refuses_one_without_runs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "lab" / "interactive").mkdir(parents=True)
    assert cli.main(["runs", "lab", "--outputs", str(tmp_path)]) == exits.EXIT_INVALID
    assert not (tmp_path / "lab" / "index.html").exists() and "refused" in capsys.readouterr().err


def test_compare_names_its_page_by_the_run_dirs_never_by_the_manifests(tmp_path: Path) -> None:
    """The planted case: `run_id: ../x` and `cluster: ../../evil` wrote the page out of the outputs (tmp/evil/...)."""
    outputs = tmp_path / "deep" / "outputs"
    for run_id in (A, B):
        run_dir = make_run(outputs / "lab", run_id)
        manifest = json.loads((run_dir / "manifest.json").read_text())
        manifest.update(run_id="../x", cluster="../../evil")
        (run_dir / "manifest.json").write_text(json.dumps(manifest))
    assert cli.main(["compare", str(outputs / "lab" / A), str(outputs / "lab" / B), "--outputs", str(outputs)]) == 0
    assert sorted(tmp_path.rglob("*.html")) == [outputs / "lab" / "compare" / f"{A}-vs-{B}.html"]


def test_compare_refuses_a_run_outside_any_outputs_unless_the_page_is_named(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    make_run(tmp_path / "lab", A)
    loose = tmp_path / "loose" / B  # named like a run, no manifest: no cluster's outputs holds it
    loose.mkdir(parents=True)
    assert cli.main(["compare", str(tmp_path / "lab" / A), str(loose)]) == exits.EXIT_INVALID
    assert "--html" in capsys.readouterr().err and list(tmp_path.rglob("*.html")) == []
    named = tmp_path / "mine.html"
    assert cli.main(["compare", str(tmp_path / "lab" / A), str(loose), "--html", str(named)]) == 0
    assert list(tmp_path.rglob("*.html")) == [named]
