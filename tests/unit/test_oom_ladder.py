"""The graph-capture OOM ladder from 02's memory fit (issue 23 item 2), speculation dropped first where it may have
crashed the start (issue 32 item 4), on vLLM's own log and error texts."""
from __future__ import annotations

from pathlib import Path

import pytest

from sparkbook.core.cluster.context import Context
from sparkbook.core.values.modelinfo import GIB, RESERVE_BYTES, ModelFacts, utilization_floor
from sparkbook.core.values.params import ServeSettings, Speculative, load_params
from sparkbook.stages.serve import bringup, commands, launch
from sparkbook.stages.serve.failures import GRAPH_CRASH, GRAPH_OOM, ILLEGAL_ACCESS, UNKNOWN, classify, remedy

# A Ray worker's graph-capture OOM, vllm-project/vllm#15598 (its log lines; the error line is the title).
GRAPH_OOM_RAY = """\
(RayWorkerWrapper pid=1463574, ip=192.168.10.60) INFO 03-27 10:29:01 [worker.py:267] the current vLLM instance can use total_gpu_memory (44.53GiB) x gpu_memory_utilization (0.98) = 43.64GiB [repeated 30x across cluster]
(RayWorkerWrapper pid=1463574, ip=192.168.10.60) INFO 03-27 10:29:01 [worker.py:267] model weights take 20.64GiB; non_torch_memory takes 0.28GiB; PyTorch activation peak memory takes 1.52GiB; the rest of the memory reserved for KV Cache is 21.20GiB. [repeated 30x across cluster]
RayWorkerWrapper pid=1861983) INFO 03-27 10:29:03 [model_runner.py:1442] Capturing cudagraphs for decoding. This may lead to unexpected consequences if the model is not static. To run the model in eager mode, set 'enforce_eager=True' or use '--enforce-eager' in the CLI. If out-of-memory error occurs during cudagraph capture, consider decreasing `gpu_memory_utilization` or switching to eager mode. You can also reduce the `max_num_seqs` as needed to decrease memory usage.
torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 MiB. GPU 6 has a total capacity of 44.53 GiB of which 448.00 KiB is free.
"""  # noqa: E501 (log lines as vLLM wrote them)

# A V1 worker's capture ending in the CUDA driver's own OOM, vllm-project/vllm#19186.
GRAPH_OOM_V1 = """\
(VllmWorker rank=3 pid=1090) ERROR 06-05 06:18:13 [multiproc_executor.py:470]   File "/usr/local/lib/python3.10/site-packages/vllm/compilation/backends.py", line 681, in __call__
(VllmWorker rank=3 pid=1090) ERROR 06-05 06:18:13 [multiproc_executor.py:470]     with torch.cuda.graph(cudagraph, pool=self.graph_pool):
(VllmWorker rank=3 pid=1090) ERROR 06-05 06:18:13 [multiproc_executor.py:470]   File "/usr/local/lib/python3.10/site-packages/torch/cuda/graphs.py", line 186, in __exit__
(VllmWorker rank=3 pid=1090) ERROR 06-05 06:18:13 [multiproc_executor.py:470]     self.cuda_graph.capture_end()
(VllmWorker rank=3 pid=1090) ERROR 06-05 06:18:13 [multiproc_executor.py:470] RuntimeError: CUDA error: out of memory
"""  # noqa: E501 (log lines as vLLM wrote them)

# vLLM's KV-cache errors, as raised: vllm/v1/core/kv_cache_utils.py (_check_enough_kv_cache_memory, commit 001cabc1;
# the numbers in the second are made up) and vllm/worker/worker.py (raise_if_cache_size_invalid, before V1).
KV_NONE = ("ValueError: No available memory for the cache blocks. Try increasing `gpu_memory_utilization` when "
           "initializing the engine. See https://docs.vllm.ai/en/latest/configuration/conserving_memory/ for more "
           "details.")
KV_TOO_SMALL_V1 = ("ValueError: To serve at least one request with the models's max seq len (262144), (24.00 GiB KV "
                   "cache is needed, which is larger than the available KV cache memory (3.50 GiB). Based on the "
                   "available memory, the estimated maximum model length is 38224. Try increasing "
                   "`gpu_memory_utilization` or decreasing `max_model_len` when initializing the engine. See "
                   "https://docs.vllm.ai/en/latest/configuration/conserving_memory/ for more details.")
KV_TOO_SMALL_V0 = ("ValueError: The model's max seq len (32768) is larger than the maximum number of tokens that can "
                   "be stored in KV cache (19456). Try increasing `gpu_memory_utilization` or decreasing "
                   "`max_model_len` when initializing the engine.")

GB10 = int(121.7 * GIB)  # one DGX Spark's memory as nvidia-smi reports it


def _facts(weight_gib: float) -> ModelFacts:
    """A 2-node-sized MoE: 48 attention layers, 4 KV heads of 128 at bf16 (96 KiB of KV per token)."""
    return ModelFacts(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", dtype="bfloat16",
                      quantization="fp8", bytes_per_param=1.0, total_params=10**11, active_params=10**10,
                      weight_bytes=int(weight_gib * GIB), weight_source="safetensors index", num_layers=48,
                      kv_bytes_per_token=48 * 2 * 4 * 128 * 2, kv_latent=False, dir_on_nodes="/m")


@pytest.fixture
def duo(write_params, base):
    """The seed's shape: TP=2 over two GB10s at utilization 0.8, max_model_len 32768, max_remedies 3 (default)."""
    base["serve"] = {"tensor_parallel_size": 2, "gpu_memory_utilization": 0.8, "max_model_len": 32768}
    return load_params(write_params(base))


@pytest.mark.parametrize("log", [GRAPH_OOM_RAY, GRAPH_OOM_V1], ids=["ray-v0", "v1"])
def test_real_graph_capture_oom_texts_are_classified(log):
    assert classify({"spark-1": log}).cause == GRAPH_OOM


@pytest.mark.parametrize("text", [KV_NONE, KV_TOO_SMALL_V1, KV_TOO_SMALL_V0], ids=["none", "v1", "v0"])
def test_no_memory_for_the_kv_cache_is_its_own_cause(text):
    d = classify({"spark-0": "INFO Loading weights took 59.50 GiB\n" + text})
    assert d.cause == "no memory left for the KV cache" and d.cause != UNKNOWN
    assert d.evidence == text
    assert all(w in d.remediation for w in ("max_model_len", "gpu_memory_utilization", "more nodes"))
    assert remedy(d, ServeSettings(), floor=0.5) is None  # a person chooses what to give up


def test_floor_holds_weights_kv_for_max_model_len_and_the_reserve(duo):
    # per rank: 59.5 GiB weights + 32768 x 48 KiB KV (1.5 GiB) + the 4 GiB reserve = 65 GiB of 121.7 -> 0.5341
    assert RESERVE_BYTES == 4 * GIB
    assert utilization_floor(_facts(119), duo, {"a": GB10, "b": GB10}) == 0.54
    seqs = duo.model_copy(update={"serve": duo.serve.model_copy(update={"max_num_seqs": 16})})
    assert utilization_floor(_facts(119), seqs, {"a": GB10, "b": GB10}) == 0.72  # 16 x 1.5 GiB of KV: 87.5 GiB of 121.7
    assert utilization_floor(_facts(119), duo, {"a": GB10}) is None  # no memory for node b
    no_len = duo.model_copy(update={"serve": duo.serve.model_copy(update={"max_model_len": None})})
    assert utilization_floor(_facts(119), no_len, {"a": GB10, "b": GB10}) is None


def no_node_operations(monkeypatch):
    """bring_up's node operations replaced: a whole cluster, nothing serving, every launch spawned (wait_ready,
    patched by each test, decides how it ends)."""
    monkeypatch.setattr(bringup, "lost", lambda *a, **kw: {})
    monkeypatch.setattr(bringup, "find_running", lambda *a: (None, "nothing serving"))
    for name in ("stop_earlier", "stop_serving", "remember", "read_serving"):
        monkeypatch.setattr(bringup, name, lambda *a: None)
    monkeypatch.setattr(bringup, "port_taken", lambda *a: None)
    monkeypatch.setattr(bringup, "launch", lambda ctx, plan, attempt: launch.Launch(plan, attempt, {}, 0.0))


def test_a_graph_capture_oom_serve_reaches_eager_within_max_remedies(duo, monkeypatch):
    """bring_up with every node operation replaced: each launch with CUDA graphs OOMs in capture (the real V1
    text), an eager one is ready. Each remedy steps down by serve.utilization_step while the fit holds (a floor of
    0.7, as the seed's start needed), then goes eager."""
    no_node_operations(monkeypatch)

    def wait_ready(ctx, launched, timeout_s, on_round):
        if launched.plan.settings.enforce_eager:
            return launch.Readiness(True, 300.0, 290.0, ["model"], {})
        logs = {"a": GRAPH_OOM_V1}
        return launch.Readiness(False, 600.0, None, [], logs, classify(logs))

    monkeypatch.setattr(bringup, "wait_ready", wait_ready)
    ctx = Context(duo, None, None, Path("/tmp"), image="img")  # every node operation is replaced above
    up = bringup.bring_up(ctx, commands.plan(ctx, "ray"), floor=0.7)
    assert up.ok and len(up.attempts) == duo.serve.max_remedies + 1 == 4
    assert [r.change for r in up.remedies] == [{"gpu_memory_utilization": 0.75}, {"gpu_memory_utilization": 0.7},
                                               {"enforce_eager": True}]
    assert "--enforce-eager" in up.launched.plan.commands[0].argv
    assert up.launched.plan.settings.gpu_memory_utilization == 0.7
    assert [d.question for d in up.decisions()][1:] == [f"How to retry after {GRAPH_OOM}?"] * 3
    assert "serve.utilization_step (0.05) down to 0.75" in up.remedies[0].reason


def test_without_a_fit_or_when_nothing_fits_lower_the_ladder_goes_straight_to_eager(duo):
    oom = classify({"a": GRAPH_OOM_RAY})
    unknown = remedy(oom, duo.serve, floor=None)
    assert unknown.change == {"enforce_eager": True} and "no memory fit" in unknown.reason
    # 240 GiB of weights: 120 GiB per GB10 before KV and reserve -> a floor above 1.0, no utilization holds it
    too_big = utilization_floor(_facts(240), duo, {"a": GB10, "b": GB10})
    assert too_big > 1.0
    fix = remedy(oom, duo.serve, floor=too_big)
    assert fix.change == {"enforce_eager": True} and "no gpu_memory_utilization holds" in fix.reason
    assert remedy(oom, fix.settings, floor=too_big) is None



# Speculation's crashes (issue 32 item 4), vLLM's log lines as the issues quote them.
# MTP in CUDA graph capture, vllm-project/vllm#48749 ("[MRV2] MTP speculative decoding crashes with
# cudaErrorStreamCaptureUnsupported during CUDA graph capture"); the quote breaks off inside the error line, which is
# completed here with CUDA's text for cudaErrorStreamCaptureUnsupported.
MTP_CAPTURE = """\
(EngineCore pid=1140) ERROR 07-15 00:27:03 core.py:1231]   File "/usr/local/lib/python3.12/dist-packages/vllm/v1/worker/gpu/cudagraph_utils.py", line 359, in capture
(EngineCore pid=1140) ERROR 07-15 00:27:03 core.py:1231]     with torch.cuda.graph(graph, self.pool):
(EngineCore pid=1140) ERROR 07-15 00:27:03 core.py:1231]   File "/usr/local/lib/python3.12/dist-packages/torch/cuda/graphs.py", line 265, in __exit__
(EngineCore pid=1140) ERROR 07-15 00:27:03 core.py:1231]     self.cuda_graph.capture_end()
(EngineCore pid=1140) ERROR 07-15 00:27:03 core.py:1231]   File "/usr/local/lib/python3.12/dist-packages/torch/cuda/graphs.py", line 126, in capture_end
(EngineCore pid=1140) ERROR 07-15 00:27:03 core.py:1231]     super().capture_end()
(EngineCore pid=1140) ERROR 07-15 00:27:03 core.py:1231] torch.AcceleratorError: CUDA error: operation not permitted when stream is capturing
"""  # noqa: E501 (log lines as vLLM wrote them)

# MTP's illegal memory access on long sequences, vllm-project/vllm#40756 (Qwen3.6-27B-FP8, vLLM 0.19.1).
MTP_ILLEGAL = """\
(EngineCore pid=175)     self._seq_lens_cpu = self.seq_lens.to("cpu")
(APIServer pid=100) ERROR 05-05 14:59:18 [serving.py:1137] vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue. See stack trace (above) for the root cause.
(EngineCore pid=175) torch.AcceleratorError: CUDA error: an illegal memory access was encountered
(EngineCore pid=175) Search for `cudaErrorIllegalAddress' in https://docs.nvidia.com/cuda/cuda-runtime-api/group__CUDART__TYPES.html for more information.
(EngineCore pid=175) CUDA kernel errors might be asynchronously reported at some other API call, so the stacktrace below might be incorrect.
"""  # noqa: E501 (log lines as vLLM wrote them)

MTP = Speculative(method="mtp", num_speculative_tokens=2)


@pytest.mark.parametrize("log, cause", [(MTP_CAPTURE, GRAPH_CRASH), (MTP_ILLEGAL, ILLEGAL_ACCESS)],
                         ids=["capture", "illegal-access"])
def test_speculations_real_crashes_are_classified(log, cause):
    d = classify({"spark-0": log})
    assert d.cause == cause
    assert "CUDA error: " in d.evidence and d.evidence in log


@pytest.mark.parametrize("log", [MTP_CAPTURE, MTP_ILLEGAL, GRAPH_OOM_V1], ids=["capture", "illegal-access", "oom"])
def test_with_speculation_on_the_first_remedy_drops_it(duo, log):
    settings = duo.serve.model_copy(update={"speculative": MTP})
    fix = remedy(classify({"a": log}), settings, floor=0.7)
    assert fix.change == {"speculative": None}
    assert fix.settings.speculative is None
    assert fix.settings.gpu_memory_utilization == settings.gpu_memory_utilization  # nothing else given up
    assert "mtp, 2 tokens" in fix.reason


def test_without_speculation_an_illegal_access_needs_a_person_and_a_capture_oom_steps_memory(duo):
    assert remedy(classify({"a": MTP_ILLEGAL}), duo.serve, floor=0.7) is None
    assert remedy(classify({"a": MTP_CAPTURE}), duo.serve, floor=0.7) is None
    assert remedy(classify({"a": GRAPH_OOM_V1}), duo.serve, floor=0.7).change == {"gpu_memory_utilization": 0.75}


def test_speculation_dropped_then_the_memory_ladder(duo, monkeypatch):
    """bring_up with every node operation replaced: launches with speculation crash in capture (#48749's text), the
    first one without it OOMs in capture, the next one with less memory is ready."""
    no_node_operations(monkeypatch)

    def wait_ready(ctx, launched, timeout_s, on_round):
        settings = launched.plan.settings
        if settings.gpu_memory_utilization < 0.8:
            return launch.Readiness(True, 300.0, 290.0, ["model"], {})
        logs = {"a": MTP_CAPTURE if settings.speculative else GRAPH_OOM_V1}
        return launch.Readiness(False, 600.0, None, [], logs, classify(logs))

    monkeypatch.setattr(bringup, "wait_ready", wait_ready)
    spec = duo.model_copy(update={"serve": duo.serve.model_copy(update={"speculative": MTP})})
    ctx = Context(spec, None, None, Path("/tmp"), image="img")
    first = commands.plan(ctx, "ray")
    assert "--speculative-config" in first.commands[0].argv
    up = bringup.bring_up(ctx, first, floor=0.7)
    assert up.ok and [r.change for r in up.remedies] == [{"speculative": None}, {"gpu_memory_utilization": 0.75}]
    assert [r.cause for r in up.remedies] == [GRAPH_CRASH, GRAPH_OOM]
    assert "--speculative-config" not in up.launched.plan.commands[0].argv
    assert [d.choice for d in up.decisions()][1:] == ["speculative=None", "gpu_memory_utilization=0.75"]
