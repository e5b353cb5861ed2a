"""modelinfo: parameter estimates against published sizes, quantization, weight bytes, memory fit."""
from __future__ import annotations

import pytest

from sparkbook.core.values.modelinfo import (
    GIB,
    RESERVE_BYTES,
    NodeMemory,
    estimate_params,
    kv_bytes_per_token,
    memory_fit,
    model_facts,
    quantization,
    ranks_per_node,
)
from sparkbook.core.values.params import load_params

QWEN3_30B_A3B = {  # published: 30.5B total, 3.3B active
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "torch_dtype": "bfloat16",
    "hidden_size": 2048, "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4,
    "head_dim": 128, "intermediate_size": 6144, "moe_intermediate_size": 768, "num_experts": 128,
    "num_experts_per_tok": 8, "decoder_sparse_step": 1, "mlp_only_layers": [], "vocab_size": 151936,
    "tie_word_embeddings": False,
}
LLAMA3_8B = {  # published: 8.03B
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "torch_dtype": "bfloat16", "hidden_size": 4096,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 14336,
    "vocab_size": 128256, "tie_word_embeddings": False,
}
DEEPSEEK_V3 = {  # published: 671B total, 37B active (plus a 14B MTP module not counted here)
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "torch_dtype": "bfloat16",
    "hidden_size": 7168, "num_hidden_layers": 61, "num_attention_heads": 128, "num_key_value_heads": 128,
    "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
    "intermediate_size": 18432, "moe_intermediate_size": 2048, "n_routed_experts": 256, "n_shared_experts": 1,
    "num_experts_per_tok": 8, "first_k_dense_replace": 3, "vocab_size": 129280, "tie_word_embeddings": False,
    "quantization_config": {"quant_method": "fp8", "fmt": "e4m3"},
}


@pytest.mark.parametrize("config,total,active", [
    (QWEN3_30B_A3B, 30.5e9, 3.3e9), (LLAMA3_8B, 8.03e9, 8.03e9), (DEEPSEEK_V3, 671e9, 37e9)])
def test_estimates_within_3_percent_of_published(config, total, active):
    t, a = estimate_params(config)
    assert t == pytest.approx(total, rel=0.03)
    assert a == pytest.approx(active, rel=0.03)


def test_multimodal_config_uses_text_config_and_quantization():
    cfg = {"architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe",
           "text_config": {k: v for k, v in QWEN3_30B_A3B.items() if k not in ("architectures", "model_type")},
           "quantization_config": {"quant_method": "fp8"}}
    facts = model_facts(cfg, None, [], "/m")
    assert facts.architectures == ["Qwen3_5MoeForConditionalGeneration"]
    assert facts.quantization == "fp8" and facts.bytes_per_param == 1.0
    assert facts.weight_source == "estimate" and facts.weight_bytes == facts.total_params
    assert facts.is_moe


def test_quantization_bits():
    assert quantization({"quantization_config": {"quant_method": "awq", "bits": 4}}) == ("awq", 0.5)
    assert quantization({"quantization_config": {"quant_method": "modelopt", "quant_algo": "NVFP4"}})[1] == 0.5
    assert quantization({}) == (None, None)


def test_weight_bytes_prefers_index_then_files():
    assert model_facts(LLAMA3_8B, {"metadata": {"total_size": 123}}, [5], "/m").weight_bytes == 123
    facts = model_facts(LLAMA3_8B, None, [5, 6], "/m")
    assert (facts.weight_bytes, facts.weight_source) == (11, "safetensors files")


def test_kv_per_token_gqa_and_mla():
    assert kv_bytes_per_token(LLAMA3_8B, 2) == (32 * 2 * 8 * 128 * 2, False)
    assert kv_bytes_per_token(DEEPSEEK_V3, 2) == (61 * 576 * 2, True)


def _seedlike(write_params, base, util):
    base["serve"] = {"tensor_parallel_size": 2, "gpu_memory_utilization": util, "max_model_len": 32768}
    return load_params(write_params(base))


def test_fit_split_over_two_nodes_and_a_finding_when_memory_is_taken(write_params, base):
    params = _seedlike(write_params, base, 0.7)
    facts = model_facts(QWEN3_30B_A3B, {"metadata": {"total_size": 60 * GIB}}, [], "/m")
    assert ranks_per_node(params) == {"a": 1, "b": 1}
    free = {n: NodeMemory(n, 120 * GIB, 110 * GIB, "MemTotal/MemAvailable", 110 * GIB, "test") for n in "ab"}
    rows = memory_fit(facts, params, free)
    assert [r.weights_gib for r in rows] == [30.0, 30.0]
    # vLLM takes 0.7 x 120 GiB; the KV cache is what weights and the per-rank reserve leave of it
    assert all(r.fits for r in rows) and rows[0].planned_gib == pytest.approx(84.0)
    assert rows[0].kv_gib == pytest.approx(84.0 - 30.0 - RESERVE_BYTES / GIB)
    busy = {**free, "b": NodeMemory("b", 120 * GIB, 25 * GIB, "MemTotal/MemAvailable", 25 * GIB, "test")}
    rows = memory_fit(facts, params, busy)
    assert rows[0].fits and not rows[1].fits
    assert "CUDA can allocate 25.00 GiB" in rows[1].why
