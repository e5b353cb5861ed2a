"""The whole runbook, headless, against the lab: what `make runbook` does, asserted end to end."""
from __future__ import annotations

import json
import tarfile
from pathlib import Path

import httpx
import pytest

from sparkbook.core import runbook
from sparkbook.core.params import load_params

pytestmark = pytest.mark.lab


def test_every_notebook_succeeds_and_is_recorded(full_run: tuple[Path, runbook.Manifest]) -> None:
    run_dir, manifest = full_run
    assert [(nb.name, nb.status) for nb in manifest.notebooks] == [(n, "ok") for n in runbook.notebook_names()], \
        json.dumps([nb.exception for nb in manifest.notebooks], indent=1)
    assert all((run_dir / nb.name).exists() for nb in manifest.notebooks)
    assert any(nb.decisions for nb in manifest.notebooks)
    index = (run_dir / "index.html").read_text()
    assert all(nb.name in index for nb in manifest.notebooks)


def test_the_lab_serves_the_new_model_afterwards(full_run: tuple[Path, runbook.Manifest]) -> None:
    run_dir, manifest = full_run
    state = json.loads((run_dir / "state.json").read_text())
    params = load_params(manifest.params_file)
    assert state["image"]["ref"].endswith(":0.32.0")
    assert len(set(state["image"]["nodes"].values())) == 1, "every node holds the same image ID"
    reply = httpx.post(f"{state['endpoint']['base_url']}/v1/completions", timeout=120,
                       json={"model": params.model.served_name, "prompt": "Hello", "max_tokens": 8})
    assert reply.status_code == 200 and reply.json()["choices"][0]["text"]


def test_planted_secret_is_in_no_written_file(full_run: tuple[Path, runbook.Manifest], planted: str) -> None:
    """Every file under the outputs root (run dir, index, logs, state, notebooks) and every member of the
    archive, decompressed; the secret was really in the run's environment and named in its params."""
    run_dir, manifest = full_run
    assert "HF_TOKEN" in load_params(manifest.params_file).secrets
    archive = runbook.archive(run_dir)
    written = [p for p in run_dir.parent.parent.rglob("*") if p.is_file()]
    assert archive in written and len(written) > 10
    for path in written:
        assert planted.encode() not in path.read_bytes(), path
    with tarfile.open(archive) as tar:
        members = [m for m in tar.getmembers() if m.isfile()]
        assert len(members) == len([p for p in run_dir.rglob("*") if p.is_file()])
        for member in members:
            assert planted.encode() not in tar.extractfile(member).read(), member.name
