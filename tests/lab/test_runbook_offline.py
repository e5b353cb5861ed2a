"""The session's full run on the path real hardware takes (issues 22, 16): the candidate shaped like vLLM's official
image (ENTRYPOINT `vllm serve`), the model by hf_id from a hub cache that is not root's and that only the head holds at
the start: 03 copies it to the worker over the fabric, as to the seed's worker without internet, and the entrypoint
image to a worker that holds the plain 0.32.0 build as the delta of the layers it lacks. The shared `full_run`
(conftest) is that run: one whole run proves this path and what test_runbook_lab, test_idempotence and test_lab_ab
read, instead of a whole run of its own after a second lab reset (issue 44)."""
from __future__ import annotations

import json

import pytest

from sparkbook.core.values.evidence import read_events
from sparkbook.runbook import driver

pytestmark = pytest.mark.lab
ENTRYPOINT_IMAGE = "sparkbook-lab/vllm-openai-cpu:0.32.0"
HUB = "/home/lab/.cache/huggingface/hub"  # the nodes' hub cache, not root's


def test_every_notebook_succeeds_with_the_entrypoint_image_and_the_model_by_hf_id(full_run) -> None:  # type: ignore[no-untyped-def]
    run_dir, manifest = full_run
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
    (image_copy,) = [e["data"] for e in read_events(run_dir, "distribution")][-1]["copies"]
    assert image_copy["node"] == "lab-1" and image_copy["mode"].startswith("delta: "), image_copy  # test_faults' 0.32.0
    assert state["benchmark"]["failed_requests"] == 0 and state["benchmark"]["single_stream_output_tok_s"] > 0
