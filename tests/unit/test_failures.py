"""The log classifier names the cause from real-looking log lines, and the OOM remediation ladder."""
from __future__ import annotations

import pytest

from sparkbook.core.values.params import ServeSettings
from sparkbook.stages.serve.failures import TIMEOUT, UNKNOWN, classify, not_ready, remedy

SAMPLES = {
    "argument not recognized":  # the lab's vLLM 0.32 given an argument it does not have (issue 18's failed run)
        "usage: vllm [-h] [-v] {chat,complete,serve,bench,collect-env,run-batch} ...\n"
        "vllm: error: unrecognized arguments: --planted-unknown-flag",
    "architecture not supported":
        "ValueError: Model architectures ['HYV4ForCausalLM'] are not supported for now. Supported architectures: ...",
    "architecture failed to be inspected":
        "ERROR Error in inspecting model architecture 'HYV4ForCausalLM'\n"
        "ValueError: Model architectures ['HYV4ForCausalLM'] failed to be inspected. Please check the logs",
    "CUDA out of memory during graph capture":
        "INFO Capturing CUDA graphs (mixed prefill-decode, PIECEWISE): 40%\n"
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB\n"
        "RuntimeError: Worker failed with error 'CUDA out of memory'",
    "placement group not scheduled":
        "WARNING Waiting for creating a placement group of specs for 60 seconds. specs=[{'GPU': 1.0}]\n"
        "Error: No available node types can fulfill resource request {'GPU': 1.0}",
    "duplicate node IP":
        "RuntimeError: Every node should have a unique IP address. Got 2 nodes with node ids [...]",
    "NCCL timeout":
        "[Rank 1] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=1, OpType=ALLREDUCE) ran for 600000 ms",
    "rank never joined":
        "torch.distributed.DistStoreError: Timed out after 601 seconds waiting for clients. 1/2 clients joined.",
    "address already in use":
        "OSError: [Errno 98] error while attempting to bind on address ('10.77.0.10', 8000): address already in use",
    "configuration refused":  # the lab's vLLM 0.32, max_model_len 8192 over the model's 4096 (after the argv check)
        "pydantic_core._pydantic_core.ValidationError: 1 validation error for ModelConfig\n"
        "  Value error, User-specified max_model_len (8192) is greater than the derived max_model_len "
        "(max_position_embeddings=4096.0 or model_max_length=None in model's config.json).",
    "worker died":
        "ERROR WorkerProc hit an exception.\nRuntimeError: Engine core initialization failed. See root cause above.",
}


@pytest.mark.parametrize("cause", sorted(SAMPLES))
def test_each_signature_names_its_cause(cause):
    d = classify({"lab-0": "INFO starting\n" + SAMPLES[cause] + "\nINFO shutting down"})
    assert d.cause == cause
    assert d.node == "lab-0"
    assert d.evidence in SAMPLES[cause]
    assert d.remediation


def test_root_cause_beats_its_consequences_on_other_nodes():
    d = classify({"lab-0": SAMPLES["rank never joined"], "lab-1": SAMPLES["architecture failed to be inspected"]})
    assert (d.cause, d.node) == ("architecture failed to be inspected", "lab-1")
    assert "rank never joined on lab-0" in d.also


def test_oom_outside_graph_capture_is_not_the_graph_capture_cause():
    assert classify({"a": "torch.OutOfMemoryError: CUDA out of memory while loading weights"}).cause == UNKNOWN


def test_a_dead_container_explains_a_rank_that_never_joined():
    d = classify({"lab-0": SAMPLES["rank never joined"]}, observed={"lab-1": "container sb-lab-1 is not running"})
    assert (d.cause, d.node, d.evidence) == ("worker died", "lab-1", "container sb-lab-1 is not running")


def test_a_logged_root_cause_beats_the_observed_exit_it_caused():
    d = classify({"lab-0": SAMPLES["address already in use"]}, observed={"lab-0": "its `vllm serve` process exited"})
    assert d.cause == "address already in use"


def test_a_refused_configuration_beats_the_exit_it_caused_and_names_the_setting():
    d = classify({"lab-0": SAMPLES["configuration refused"]}, observed={"lab-0": "its `vllm serve` process exited"})
    assert d.cause == "configuration refused" and d.evidence.startswith("Value error, User-specified max_model_len")


def test_unknown_keeps_the_last_line():
    d = classify({"lab-0": "INFO a\nsomething odd\n\n"})
    assert (d.cause, d.evidence, d.known) == (UNKNOWN, "something odd", False)


def test_graph_capture_oom_ladder_lowers_memory_then_goes_eager():
    oom = classify({"a": SAMPLES["CUDA out of memory during graph capture"]})
    first = remedy(oom, ServeSettings(gpu_memory_utilization=0.8), floor=0.7)
    assert first.change == {"gpu_memory_utilization": 0.75}
    assert first.settings.gpu_memory_utilization == 0.75 and not first.settings.enforce_eager
    second = remedy(oom, first.settings, floor=0.7)
    assert second.change == {"gpu_memory_utilization": 0.7}
    assert remedy(oom, second.settings, floor=0.7).change == {"enforce_eager": True}  # 0.65 is under the floor
    assert remedy(oom, ServeSettings(gpu_memory_utilization=0.8, utilization_step=0.1), floor=0.7).change == \
        {"gpu_memory_utilization": 0.7}
    floor = remedy(oom, ServeSettings(gpu_memory_utilization=0.35), floor=0.7)
    assert floor.change == {"enforce_eager": True}
    assert remedy(oom, floor.settings) is None


def test_no_automatic_remedy_for_causes_that_need_a_person():
    assert remedy(classify({"a": SAMPLES["address already in use"]}), ServeSettings()) is None


def test_a_slow_start_is_not_ready_in_time_with_its_last_phase():
    d = not_ready({"lab-0": "INFO Loading weights\nINFO Initializing a V1 LLM engine\n", "lab-1": "INFO waiting"},
                  "lab-0", 301)
    assert (d.cause, d.node, d.evidence) == (TIMEOUT, "lab-0", "INFO Initializing a V1 LLM engine")
    assert classify({"lab-0": SAMPLES["duplicate node IP"]}).cause == not_ready(
        {"lab-0": SAMPLES["duplicate node IP"]}, "lab-0", 301).cause
