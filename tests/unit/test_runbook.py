"""The papermill runner: manifest, index, stop at the first failure, resume, unknown parameters, redaction."""
from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from stubnotebooks import write_notebook

from sparkbook import cli
from sparkbook.core.values.params import load_params
from sparkbook.runbook import driver, limits
from sparkbook.runbook.driver import RunOptions

TOKEN = "hf_" + "Zq8" * 10


PARAMETERS = 'params_file = ""\nrun_dir = ""\nfail = False'


@pytest.fixture
def notebooks(tmp_path: Path) -> Path:
    folder = tmp_path / "notebooks"
    folder.mkdir()
    stage = ('import os, sparkbook\nfrom sparkbook.core.values.evidence import Alternative, Decision\n'
             'run = sparkbook.open_run(params_file, run_dir, stage="{stage}")\n'
             'print("token is", os.environ["SPARKBOOK_TEST_TOKEN"])\n'
             'run.decide(Decision("which?", "{stage}", "because", [Alternative("other", "worse")]))\n')
    write_notebook(folder, "01-first.ipynb", PARAMETERS, stage.format(stage="01-first"))
    write_notebook(folder, "02-second.ipynb", PARAMETERS,
                   stage.format(stage="02-second") + 'assert not fail, "planted failure"\n')
    write_notebook(folder, "03-third.ipynb", PARAMETERS, stage.format(stage="03-third"))
    return folder


@pytest.fixture
def params_file(base: dict[str, Any], write_params: Callable[..., Path], tmp_path: Path) -> Path:
    """Nodes on this machine (local transport): the run lock is real, in a directory of this test."""
    for node in base["nodes"]:  # the run lock, in the head's state dir: this test's own
        node.update(transport="local", state_dir=str(tmp_path / "state" / node["name"]))
    return write_params(base)


@pytest.fixture(autouse=True)
def planted_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPARKBOOK_TEST_TOKEN", TOKEN)


def _all_text(folder: Path) -> str:
    return "".join(p.read_text(errors="replace") for p in folder.rglob("*") if p.is_file())


def test_run_writes_manifest_index_and_decisions(notebooks: Path, params_file: Path, tmp_path: Path,
                                                 capfd: pytest.CaptureFixture[str]) -> None:
    run_dir, manifest = driver.execute(params_file, RunOptions(out_root=tmp_path / "out", folder=notebooks))
    assert manifest.status == "ok"
    assert "without encryption" not in capfd.readouterr().err  # the kernels talk over IPC: no TCP warning each
    assert [nb.status for nb in manifest.notebooks] == ["ok", "ok", "ok"]
    assert manifest.notebooks[1].decisions[0]["choice"] == "02-second"
    written = json.loads((run_dir / "manifest.json").read_text())
    assert written["notebooks"][2]["duration_s"] > 0
    index = (run_dir / "index.html").read_text()
    assert all(f'href="{n}"' in index for n in ("01-first.ipynb", "02-second.ipynb", "03-third.ipynb"))
    assert all(f'href="{n}"' in index for n in ("01-first.html", "02-second.html", "03-third.html"))
    assert [nb.html for nb in manifest.notebooks] == ["01-first.html", "02-second.html", "03-third.html"]
    assert "because" in (run_dir / "02-second.html").read_text()  # nbconvert's page of the executed notebook
    assert manifest.sparkbook_version == "0.1.0" and len(manifest.sparkbook_commit or "") == 40
    assert manifest.params_hash and manifest.params_hash in index and "written by sparkbook 0.1.0" in index
    assert "because" in index
    assert TOKEN not in _all_text(run_dir) and "[REDACTED]" in (run_dir / "01-first.ipynb").read_text()
    archive = driver.pack_run(run_dir)
    assert archive.stat().st_size > 0


def test_failure_stops_the_run_and_resume_continues(notebooks: Path, params_file: Path, tmp_path: Path) -> None:
    run_dir, manifest = driver.execute(params_file, RunOptions(out_root=tmp_path / "out", folder=notebooks,
                                                               parameters={"fail": True}))
    assert [nb.status for nb in manifest.notebooks] == ["ok", "failed", "not run"]
    failed = manifest.notebooks[1]
    assert failed.exception["ename"] == "AssertionError" and "planted failure" in failed.exception["evalue"]
    assert failed.exception["cell_index"] is not None
    assert not (run_dir / "03-third.ipynb").exists()
    assert "failed at 02" in (run_dir.parent / "index.html").read_text()  # the cluster's index, after every run
    assert load_params(run_dir / "params.yaml") == load_params(params_file)  # its ssh files resolved, loadable there

    seen: list[str] = []
    run_dir2, manifest = driver.execute(params_file, RunOptions(resume=run_dir, folder=notebooks,
                                                                parameters={"fail": False}), say=seen.append)
    assert run_dir2 == run_dir
    assert [nb.status for nb in manifest.notebooks] == ["ok", "ok", "ok"]
    assert not any("01-first" in line for line in seen), "resume must not rerun what succeeded"


def test_an_only_run_is_partial_in_its_manifest(notebooks: Path, params_file: Path, tmp_path: Path) -> None:
    """Issue 31: an --only 02 run said "ok" in its manifest with the other notebooks "pending"."""
    run_dir, manifest = driver.execute(params_file, RunOptions(out_root=tmp_path / "out", folder=notebooks, only="02"))
    assert manifest.status == "partial"
    assert [nb.status for nb in manifest.notebooks] == ["skipped (--only 02)", "ok", "skipped (--only 02)"]
    assert json.loads((run_dir / "manifest.json").read_text())["status"] == "partial"
    assert "partial: 02 ran" in (run_dir / "index.html").read_text()


def test_a_run_to_nn_stops_after_it_and_says_so(notebooks: Path, params_file: Path, tmp_path: Path) -> None:
    """`sparkbook run --to NN` (the H200 sessions needed four --only runs to get 01 to 04): the notebooks after NN are
    skipped (--to NN), not "not run" as after a failure, and the run is partial."""
    _, manifest = driver.execute(params_file, RunOptions(out_root=tmp_path / "out", folder=notebooks, upto="02"))
    assert [nb.status for nb in manifest.notebooks] == ["ok", "ok", "skipped (--to 02)"]
    assert manifest.status == "partial"
    assert cli.parser().parse_args(["run", "p.yaml", "--from", "02", "--to", "02"]).upto == "02"


def test_only_and_from_select_notebooks() -> None:
    names = ["01-a.ipynb", "02-b.ipynb", "03-c.ipynb"]
    assert driver.select(names, only="02") == ["02-b.ipynb"]
    assert driver.select(names, start="02") == ["02-b.ipynb", "03-c.ipynb"]
    with pytest.raises(driver.RunbookError):
        driver.select(names, only="09")


def test_unknown_parameter_is_an_error(notebooks: Path, params_file: Path, tmp_path: Path) -> None:
    with pytest.raises(driver.RunbookError, match="confirm_cleanpu"):
        driver.execute(params_file, RunOptions(out_root=tmp_path / "out", folder=notebooks,
                                               parameters={"confirm_cleanpu": True}))
    assert not (tmp_path / "out").exists()


def test_repo_notebooks_declare_their_parameters() -> None:
    for name in driver.notebook_names():
        assert {"params_file", "run_dir"} <= driver.declared_parameters(driver.NOTEBOOKS / name), name
    assert len(driver.notebook_names()) == 6


def test_each_notebook_is_passed_only_the_parameters_it_declares() -> None:
    given = {"params_file": "p.yaml", "run_dir": "r", "confirm_cleanup": True}
    assert driver.parameters_for(driver.NOTEBOOKS / "01-cleanup.ipynb", given) == given
    assert driver.parameters_for(driver.NOTEBOOKS / "02-diagnosis.ipynb", given) == {"params_file": "p.yaml",
                                                                                       "run_dir": "r"}


def test_a_ready_wait_longer_than_30_minutes_gets_a_cell_limit_above_it(base: dict[str, Any],
                                                                      write_params: Callable[..., Path]) -> None:
    """05's cells may wait every serve attempt's ready_timeout_s: papermill must not end them first (issue 23)."""
    base["serve"] = {**base.get("serve", {}), "ready_timeout_s": 2400, "max_remedies": 2}
    base["ray"] = {**base.get("ray", {}), "join_timeout_s": 3000}
    params = load_params(write_params(base))
    limit, why = limits.cell_limit(params, "05-serve.ipynb")
    assert limit >= 3 * 2400, (limit, why)
    assert "3 attempts" in why and "2400" in why
    assert limits.cell_limit(params, "04-ray-cluster.ipynb")[0] >= 3000
    assert limits.cell_limit(params, "02-diagnosis.ipynb") == (limits.BASE_CELL_S,
                                                              f"the default {limits.BASE_CELL_S} s")


def test_the_cell_limit_is_in_the_manifest_and_the_index(notebooks: Path, params_file: Path, tmp_path: Path) -> None:
    run_dir, manifest = driver.execute(params_file, RunOptions(out_root=tmp_path / "out", folder=notebooks))
    written = json.loads((run_dir / "manifest.json").read_text())["notebooks"][0]
    assert written["cell_limit_s"] == limits.BASE_CELL_S and written["cell_limit_reason"]
    assert f"cell limit {limits.BASE_CELL_S} s" in (run_dir / "index.html").read_text()


def test_the_notebooks_load_the_run_dirs_own_params_and_the_page_names_it(notebooks: Path, params_file: Path,
                                                                           tmp_path: Path) -> None:
    """Issue 39: the injected parameters cell and the run page name the run dir's params.yaml, not a temporary
    source path; the source is named only where it lies inside the repo that holds the outputs."""
    run_dir, manifest = driver.execute(params_file, RunOptions(out_root=tmp_path / "out", folder=notebooks, only="01"))
    executed = json.loads((run_dir / "01-first.ipynb").read_text())
    injected = "".join(next(c for c in executed["cells"] if "injected-parameters" in c["metadata"].get("tags", []))
                       ["source"])
    assert 'params_file = "params.yaml"' in injected  # the run dir's own copy, written relative to the run dir
    assert manifest.params_source == params_file.name  # tmp_path holds both the params and the outputs
    page = (run_dir / "index.html").read_text()
    assert '<a href="params.yaml">params.yaml</a>' in page and f"copied from <code>{params_file.name}</code>" in page
    assert str(params_file) not in page


def test_the_params_source_is_named_relative_to_the_repo_only_inside_it(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    assert driver.params_source(repo / "params" / "lab.yaml", repo / "outputs") == "params/lab.yaml"
    assert driver.params_source(tmp_path / "elsewhere.yaml", repo / "outputs") is None


def test_the_params_copy_loads_from_the_run_dir_when_the_source_names_its_ssh_files_relatively(
        base: dict[str, Any], write_params: Callable[..., Path], tmp_path: Path) -> None:
    (tmp_path / "keys").mkdir()
    (tmp_path / "keys" / "known_hosts").write_text("")
    base["ssh"] = {**base.get("ssh", {}), "known_hosts": "keys/known_hosts"}
    source = write_params(base)
    (tmp_path / "run").mkdir()
    copy = driver.copy_params(source, load_params(source), tmp_path / "run")
    assert load_params(copy) == load_params(source)
    assert load_params(copy).ssh.known_hosts == (source.parent / "keys" / "known_hosts").resolve()


def test_a_new_run_from_a_later_notebook_starts_from_the_newest_run_that_recorded_its_hand_offs(
        notebooks: Path, params_file: Path, tmp_path: Path) -> None:
    """Issue 40, item 3: `--from 03` in a new run takes the Diagnosis an earlier run recorded, and says from where."""
    from sparkbook.core.values import state
    from sparkbook.core.values.handoff import Diagnosis

    earlier, _ = driver.execute(params_file, RunOptions(out_root=tmp_path / "out", folder=notebooks, only="01"))
    state.store(earlier, Diagnosis(findings=[], question_for_03="which image?", installed_image=None), lambda d: d)
    seen: list[str] = []
    run_dir, manifest = driver.execute(params_file, RunOptions(out_root=tmp_path / "out", folder=notebooks,
                                                               start="03"), say=seen.append)
    assert run_dir != earlier and [nb.status for nb in manifest.notebooks][-1] == "ok"
    assert state.load(run_dir, Diagnosis).question_for_03 == "which image?"
    assert any(f"Diagnosis (diagnosis) from run {earlier.name}" in line and "ModelFacts: no run recorded it" in line
               for line in seen), seen
