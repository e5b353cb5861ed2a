"""The whole runbook on the path real hardware takes (issues 22, 16): params/lab-hf.yaml's candidate shaped like vLLM's
official image (ENTRYPOINT `vllm serve`), the model by hf_id from a hub cache that is not root's and that only the head
holds at the start: 03 copies it to the worker over the fabric, as to the seed's worker without internet. The
lab is reset with the worker's images kept: it holds the full run's 0.32.0 build, so the entrypoint image (the same
layers under another config) goes as a delta, as it would to a worker that served the plain image before.
It runs after test_runbook_lab (file order): its reset would remove the shared full run's server that those tests
read; test_unit_managed, later, resets the lab again and leaves the old deployment stopped for nbval."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

import sparkbook.lab as sblab
from sparkbook.core.record import read_events
from sparkbook.runbook import driver

pytestmark = pytest.mark.lab
PARAMS = Path(__file__).resolve().parents[2] / "params" / "lab-hf.yaml"
ENTRYPOINT_IMAGE = "sparkbook-lab/vllm-openai-cpu:0.32.0"
HUB = "/home/lab/.cache/huggingface/hub"  # the nodes' hub cache, not root's


@pytest.fixture(scope="module")
def hf_run(lab, tmp_path_factory):  # type: ignore[no-untyped-def]
    if sblab.params_file(2) != sblab.REPO_PARAMS:
        pytest.skip("params/lab-hf.yaml describes the default lab (SPARKBOOK_LAB_ID unset)")
    sblab.reset(keep_worker_images=True)
    return driver.run(PARAMS, out_root=tmp_path_factory.mktemp("outputs-hf"), parameters={"confirm_cleanup": True},
                       say=print)


def test_every_notebook_succeeds_with_the_entrypoint_image_and_the_model_by_hf_id(hf_run) -> None:  # type: ignore[no-untyped-def]
    run_dir, manifest = hf_run
    assert [(nb.name, nb.status) for nb in manifest.notebooks] == [(n, "ok") for n in driver.notebook_names()], \
        json.dumps([nb.exception for nb in manifest.notebooks], indent=1)
    state = json.loads((run_dir / "state.json").read_text())
    assert state["image"]["ref"] == ENTRYPOINT_IMAGE, "03 chose the image whose ENTRYPOINT is `vllm serve`"
    assert len(set(state["image"]["nodes"].values())) == 1 and set(state["image"]["nodes"]) == {"lab-0", "lab-1"}
    snapshot = state["model"]["dir_on_nodes"]
    assert snapshot.startswith(HUB + "/models--sparkbook-lab--hyv4-tiny/snapshots/"), snapshot
    for node, argv in state["endpoint"]["commands"].items():
        assert argv[2] == snapshot, (node, argv)
        assert {"HF_HUB_CACHE": HUB, "HF_HUB_OFFLINE": "1"}.items() <= state["endpoint"]["env"][node].items()
    (copy,) = [e["data"] for e in read_events(run_dir, "model_copy")]
    (to_worker,) = copy["copies"]  # the lab's worker starts without the weights, as the seed's offline worker did
    assert (copy["source"], to_worker["node"]) == ("lab-0", "lab-1") and to_worker["bytes_sent"] > 2_000_000
    assert to_worker["verified"] and not to_worker["error"], to_worker
    assert state["benchmark"]["failed_requests"] == 0 and state["benchmark"]["single_stream_output_tok_s"] > 0
