"""02's fit on a redeploy (issue 40, item 2): what this runbook's own answering server holds counts free, since 05
stops it before it starts; on recorded nvidia-smi (H200) and /proc/meminfo (GB10) texts, the lab having no GPU
memory."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from sparkbook.core.analysis.hostfacts import meminfo, memory_from, sections
from sparkbook.core.cluster.topology import LiveServer
from sparkbook.core.values.modelinfo import GIB, memory_fit, model_facts
from sparkbook.core.values.params import load_params
from sparkbook.stages.diagnose import checks

DATA = Path(__file__).parent / "data"
QWEN3_30B_A3B = {  # params/h200-one.yaml's model (config.json of /work/shared/gpu/model-qwen3moe)
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "torch_dtype": "bfloat16",
    "hidden_size": 2048, "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4,
    "head_dim": 128, "intermediate_size": 6144, "moe_intermediate_size": 768, "num_experts": 128,
    "num_experts_per_tok": 8, "decoder_sparse_step": 1, "mlp_only_layers": [], "vocab_size": 151936,
    "tie_word_embeddings": False}
FACTS = model_facts(QWEN3_30B_A3B, {"metadata": {"total_size": int(56.87 * GIB)}}, [], "/m")
# The second run on one H200 (issue 40): 02 saw 9.78 GiB CUDA could allocate with the first run's server up
SERVER_UP_USED_MIB = 132614


def recorded(name: str):
    s = sections((DATA / name).read_text(), "node", "node facts", ("meminfo",))
    return memory_from(meminfo(s["meminfo"]), s["gpumem"])


def one_node(write_params, base, node: str):
    base["nodes"] = [{**base["nodes"][0], "name": node}]
    base["serve"] = {"tensor_parallel_size": 1, "max_model_len": 8192}
    return load_params(write_params(base))


def test_a_redeploy_on_one_h200_fits_once_its_own_server_is_counted(write_params, base):
    params = one_node(write_params, base, "h200")
    idle = recorded("nvidia-smi-h200.txt")  # before the first run's launch
    up = dataclasses.replace(idle, gpu_used=SERVER_UP_USED_MIB << 20)  # the first run's server ready
    held = idle.taken_by(up)
    assert held == SERVER_UP_USED_MIB << 20
    (alone,) = memory_fit(FACTS, params, checks.fit_memory({"h200": up}, None))
    assert not alone.fits and "the plan takes 126.36 GiB" in alone.why and "CUDA can allocate 9.78 GiB" in alone.why
    server = LiveServer("20261203T101010Z", "http://127.0.0.1:8000/v1", "qwen3moe", {"h200": held})
    (row,) = memory_fit(FACTS, params, checks.fit_memory({"h200": up}, server))
    assert row.fits and row.held_by == "20261203T101010Z"
    assert row.allocatable_now_gib == pytest.approx(9.78, abs=0.01)
    assert row.allocatable_gib == pytest.approx(idle.for_fit("h200").cuda_bytes / GIB, abs=0.01)
    assert "20261203T101010Z" in row.allocatable_source
    assert [f.severity for f in checks.fit_findings([row])] == ["warning"]  # 90% of the GPU: tight, no blocker
    assert [f.severity for f in checks.fit_findings([alone])] == ["blocker"]


def test_on_unified_memory_the_server_s_share_of_memavailable_counts_and_no_more_than_cuda_reaches(write_params, base):
    base_util = one_node(write_params, base, "spark-1")
    params = base_util.model_copy(update={"serve": base_util.serve.model_copy(update={"gpu_memory_utilization": 0.7})})
    idle = recorded("nvidia-smi-gb10.txt")
    up = dataclasses.replace(idle, mem_available=idle.mem_available - 100 * GIB)
    held = idle.taken_by(up)
    assert held == 100 * GIB and up.unified
    server = LiveServer("r1", "http://10.0.0.1:8000/v1", "m", {"spark-1": held})
    after, now = checks.fit_memory({"spark-1": up}, server)["spark-1"], up.for_fit("spark-1")
    assert after.cuda_bytes == idle.for_fit("spark-1").cuda_bytes  # MemTotal less GB10's share caps it, as idle
    assert after.held_bytes == after.cuda_bytes - now.cuda_bytes and after.held_by == "r1"
    (row,) = memory_fit(FACTS, params, {"spark-1": after})
    assert row.fits and row.held_gib == pytest.approx(after.held_bytes / GIB, abs=0.01)


def test_a_server_without_a_measure_or_on_another_node_frees_nothing(write_params, base):
    up = dataclasses.replace(recorded("nvidia-smi-h200.txt"), gpu_used=SERVER_UP_USED_MIB << 20)
    for server in (None, LiveServer(None, "u", "m", {}), LiveServer("r", "u", "m", {"other": 1 << 30})):
        got = checks.fit_memory({"h200": up}, server)["h200"]
        assert got == up.for_fit("h200") and got.held_by is None


def test_a_process_that_freed_memory_holds_nothing():
    idle = recorded("nvidia-smi-h200.txt")
    busy = dataclasses.replace(idle, gpu_used=1 << 30)
    assert busy.taken_by(idle) == 0 and idle.taken_by(busy) == 1 << 30
    assert busy.without(4 << 30).gpu_used == 0  # never below nothing used
