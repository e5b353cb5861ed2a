"""The whole runbook on the path real hardware takes (issue 22): params/lab-hf.yaml's candidate shaped like vLLM's
official image (ENTRYPOINT `vllm serve`) and the model by hf_id from a hub cache that is not root's."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

import sparkbook.lab as sblab
from sparkbook.core import runbook
from sparkbook.core.record import read_events

pytestmark = pytest.mark.lab
PARAMS = Path(__file__).resolve().parents[2] / "params" / "lab-hf.yaml"
ENTRYPOINT_IMAGE = "sparkbook-lab/vllm-openai-cpu:0.32.0"


@pytest.fixture(scope="module")
def hf_run(lab, tmp_path_factory):  # type: ignore[no-untyped-def]
    if sblab.params_file(2) != sblab.REPO_PARAMS:
        pytest.skip("params/lab-hf.yaml describes the default lab (SPARKBOOK_LAB_ID unset)")
    sblab.reset()
    return runbook.run(PARAMS, out_root=tmp_path_factory.mktemp("outputs-hf"), parameters={"confirm_cleanup": True},
                       say=print)


def test_every_notebook_succeeds_with_the_entrypoint_image_and_the_model_by_hf_id(hf_run) -> None:  # type: ignore[no-untyped-def]
    run_dir, manifest = hf_run
    assert [(nb.name, nb.status) for nb in manifest.notebooks] == [(n, "ok") for n in runbook.notebook_names()], \
        json.dumps([nb.exception for nb in manifest.notebooks], indent=1)
    state = json.loads((run_dir / "state.json").read_text())
    text = json.dumps(state)
    assert ENTRYPOINT_IMAGE in text, "03 chose the image whose ENTRYPOINT is `vllm serve`"
    snapshot = "/home/lab/.cache/huggingface/hub/models--sparkbook-lab--hyv4-tiny/snapshots/"
    assert snapshot in text, "02 found the model's snapshot in the nodes' hub cache"
    commands = [e["data"] for e in read_events(run_dir, "decision")]
    assert commands
    served = (run_dir / "05-serve.ipynb").read_text()
    assert snapshot in served and "HF_HUB_CACHE=/home/lab/.cache/huggingface/hub" in served
    assert "HF_HUB_OFFLINE=1" in served
