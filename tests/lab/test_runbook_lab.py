"""The whole runbook, headless, against the lab: what `make runbook` does, asserted end to end."""
from __future__ import annotations

import json
import os
import tarfile
from pathlib import Path

import httpx
import pytest

from sparkbook import runbook
from sparkbook.params import load_params

pytestmark = pytest.mark.lab
ROOT = Path(__file__).resolve().parents[2]
PLANTED = "hf_" + "Pl4nted" * 4


@pytest.fixture(scope="module")
def full_run(lab, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, runbook.Manifest]:
    """One confirmed run of all six notebooks, with a planted secret in the environment."""
    import sparkbook.lab as sblab

    sblab.reset()
    os.environ["HF_TOKEN"] = PLANTED
    params = tmp_path_factory.mktemp("params") / "lab.yaml"
    params.write_text((ROOT / "params" / "lab.yaml").read_text().replace("secrets: []", "secrets: [HF_TOKEN]"))
    try:
        return runbook.run(params, out_root=tmp_path_factory.mktemp("outputs"),
                           parameters={"confirm_cleanup": True}, say=print)
    finally:
        del os.environ["HF_TOKEN"]


def test_every_notebook_succeeds_and_is_recorded(full_run: tuple[Path, runbook.Manifest]) -> None:
    run_dir, manifest = full_run
    assert [(nb.name, nb.status) for nb in manifest.notebooks] == [(n, "ok") for n in runbook.notebook_names()], \
        json.dumps([nb.exception for nb in manifest.notebooks], indent=1)
    assert all((run_dir / nb.name).exists() for nb in manifest.notebooks)
    assert any(nb.decisions for nb in manifest.notebooks)
    index = (run_dir / "index.html").read_text()
    assert all(nb.name in index for nb in manifest.notebooks)


def test_the_lab_serves_the_new_model_afterwards(full_run: tuple[Path, runbook.Manifest]) -> None:
    run_dir, _ = full_run
    state = json.loads((run_dir / "state.json").read_text())
    params = load_params(ROOT / "params" / "lab.yaml")
    assert state["image"]["ref"].endswith(":0.32.0")
    assert len(set(state["image"]["nodes"].values())) == 1, "every node holds the same image ID"
    reply = httpx.post(f"{state['endpoint']['base_url']}/v1/completions", timeout=120,
                       json={"model": params.model.served_name, "prompt": "Hello", "max_tokens": 8})
    assert reply.status_code == 200 and reply.json()["choices"][0]["text"]


def test_planted_secret_is_in_no_written_file(full_run: tuple[Path, runbook.Manifest]) -> None:
    run_dir, _ = full_run
    for path in run_dir.rglob("*"):
        if path.is_file():
            assert PLANTED.encode() not in path.read_bytes(), path
    with tarfile.open(runbook.archive(run_dir)) as tar:
        for member in tar.getmembers():
            if member.isfile():
                assert PLANTED.encode() not in tar.extractfile(member).read(), member.name
