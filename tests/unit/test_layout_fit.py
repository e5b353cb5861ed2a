"""02's layouts: the plan's split, one replica per node and expert parallel, each against two GB10s' memory (the
recorded nvidia-smi of a DGX Spark): the seeds' Qwen3.5-122B-A10B-FP8 fits only split, gpt-oss-120b fits a copy
per node (as kubis.ai served it: two replicas behind LiteLLM beat TP=2 at c=64)."""
from __future__ import annotations

import pytest
from test_diagnose_gate import QWEN35_122B, recorded
from test_modelinfo import LLAMA3_8B

from sparkbook.core.values.modelinfo import GIB, model_facts
from sparkbook.core.values.params import ParamsError, load_params
from sparkbook.stages.diagnose import checks, layoutfit
from sparkbook.stages.diagnose.layoutfit import EXPERT_PARALLEL, REPLICAS, TP

GPT_OSS_120B = {  # openai/gpt-oss-120b's published config.json (the fields the fit reads)
    "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "torch_dtype": "bfloat16", "hidden_size": 2880,
    "num_hidden_layers": 36, "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64,
    "intermediate_size": 2880, "num_local_experts": 128, "num_experts_per_tok": 4, "experts_per_token": 4,
    "sliding_window": 128, "layer_types": ["sliding_attention", "full_attention"] * 18, "vocab_size": 201088,
    "tie_word_embeddings": False, "quantization_config": {"quant_method": "mxfp4"}}
GPT_OSS_BYTES = 65 * 10 ** 9  # its safetensors: ~65 GB (MXFP4 experts, BF16 attention)
QWEN35_BYTES = 119 * 10 ** 9  # Qwen3.5-122B-A10B-FP8: ~119 GB


@pytest.fixture
def duo(write_params, base):
    """The seed's plan (params/spark-duo.yaml's serve): TP=2 over two Sparks at 0.7, 8 sequences of 32k."""
    base["serve"] = {"tensor_parallel_size": 2, "gpu_memory_utilization": 0.7, "max_model_len": 32768,
                     "max_num_seqs": 8}
    return load_params(write_params(base))


@pytest.fixture
def sparks():
    _, memory = recorded("nvidia-smi-gb10.txt")
    return {n: memory.for_fit(n) for n in "ab"}


def _by_layout(fits):
    return {f.layout: f for f in fits}


def test_seed_model_fits_only_split_and_02_says_replicas_do_not(duo, sparks):
    facts = model_facts(QWEN35_122B, {"metadata": {"total_size": QWEN35_BYTES}}, [], "/m")
    fits = layoutfit.layout_fits(facts, duo, sparks)
    got = _by_layout(fits)
    assert list(got) == [TP, REPLICAS, EXPERT_PARALLEL]
    tp, replicas, ep = got[TP], got[REPLICAS], got[EXPERT_PARALLEL]
    assert tp.fits and tp.servers == 1 and tp.split == "TP=2 PP=1 over a, b"
    assert [r.weights_gib for r in tp.rows] == [pytest.approx(QWEN35_BYTES / 2 / GIB, abs=0.01)] * 2
    assert tp.kv_gib == pytest.approx(0.7 * 121.69 - QWEN35_BYTES / 2 / GIB - 4, abs=0.05)  # what TP=2 leaves
    assert tp.needed_tokens == 8 * 32768 <= tp.kv_tokens
    # a whole copy (110.8 GiB) is more than the 101.3 GiB CUDA can allocate on a Spark: no KV cache is left
    assert not replicas.fits and not replicas.holds_weights and replicas.servers == 2 and replicas.kv_gib == 0
    assert all(r.ranks == 1 and r.weights_gib == pytest.approx(110.83, abs=0.01) for r in replicas.rows)
    assert "a: the weights (110.83 GiB)" in replicas.why and "more than the 101.29 GiB CUDA can allocate" \
        in replicas.why
    assert ep.fits and ep.rows == tp.rows and "256 routed experts over 2 ranks per stage: 128 per rank" in ep.note
    said = layoutfit.verdict(fits)
    assert "Replicas do not fit" in said and "must be split across the nodes" in said


def test_gpt_oss_120b_fits_a_replica_per_node(duo, sparks):
    facts = model_facts(GPT_OSS_120B, {"metadata": {"total_size": GPT_OSS_BYTES}}, [], "/m")
    assert (facts.experts, facts.experts_per_token, facts.quantization) == (128, 4, "mxfp4")
    got = _by_layout(layoutfit.layout_fits(facts, duo, sparks))
    replicas = got[REPLICAS]
    assert replicas.fits and replicas.why == "fits"
    # 0.7 x 121.69 GiB less 60.5 GiB of weights and the 4 GiB reserve; 36 layers x 2 x 8 heads x 64 x 2 B per token
    assert replicas.kv_gib == pytest.approx(0.7 * 121.69 - GPT_OSS_BYTES / GIB - 4, abs=0.05)
    assert replicas.kv_tokens == pytest.approx(replicas.kv_gib * GIB / 73728, rel=1e-4)
    assert replicas.kv_tokens >= 8 * 32768
    assert got[TP].fits and got[TP].kv_gib > replicas.kv_gib  # the split leaves more KV per node, one server
    assert "Replicas fit" in layoutfit.verdict(list(got.values()))


def test_replicas_held_to_the_full_load_and_no_experts_no_ep(write_params, base, sparks):
    """A copy that holds the weights but not max_num_seqs x max_model_len of KV cache does not fit; a dense model
    has no expert-parallel layout."""
    base["serve"] = {"tensor_parallel_size": 2, "gpu_memory_utilization": 0.7, "max_model_len": 131072,
                     "max_num_seqs": 64}
    facts = model_facts(GPT_OSS_120B, {"metadata": {"total_size": GPT_OSS_BYTES}}, [], "/m")
    replicas = _by_layout(layoutfit.layout_fits(facts, load_params(write_params(base)), sparks))[REPLICAS]
    assert not replicas.fits and replicas.holds_weights and f"{64 * 131072} are needed" in replicas.why
    said = layoutfit.verdict(layoutfit.layout_fits(facts, load_params(write_params(base)), sparks))
    assert f"Replicas: a whole copy fits each node, but its KV cache holds {replicas.kv_tokens} tokens" in said
    dense = model_facts(LLAMA3_8B, None, [], "/m")
    assert [f.layout for f in layoutfit.layout_fits(dense, load_params(write_params(base)), sparks)] == [TP, REPLICAS]


def test_one_node_has_no_replicas(write_params, base, sparks):
    base["nodes"] = base["nodes"][:1]
    base["serve"] = {"tensor_parallel_size": 1, "max_model_len": 4096}
    facts = model_facts(LLAMA3_8B, None, [], "/m")
    fits = layoutfit.layout_fits(facts, load_params(write_params(base)), sparks)
    assert [f.layout for f in fits] == [TP] and "One node: no replicas" in layoutfit.verdict(fits)


# --- serve.layout: the params field, 02's finding, 05's refusal -------------------------------------------------
def test_replicas_on_one_node_is_refused_naming_the_field(write_params, base):
    assert load_params(write_params(base)).serve.layout == "tp"
    base["nodes"] = base["nodes"][:1]
    base["serve"] = {"tensor_parallel_size": 1, "layout": "replicas"}
    with pytest.raises(ParamsError, match=r"serve.layout: replicas runs a copy of the model on each node .* this "
                                          r"cluster has one node \(set serve.layout: tp\)"):
        load_params(write_params(base))
    base["serve"]["layout"] = "dp"
    with pytest.raises(ParamsError, match="serve.layout"):
        load_params(write_params(base))


def test_02_stops_replicas_that_do_not_fit_naming_the_field(duo, sparks):
    facts = model_facts(QWEN35_122B, {"metadata": {"total_size": QWEN35_BYTES}}, [], "/m")
    replicas = duo.model_copy(update={"serve": duo.serve.model_copy(update={"layout": "replicas"})})
    fits = layoutfit.layout_fits(facts, replicas, sparks)
    (found,) = layoutfit.layout_findings(fits, replicas)
    assert (found.severity, found.topic) == ("blocker", "layout")
    assert found.text.startswith("serve.layout: replicas: a copy of the model with the KV cache of 262144 tokens "
                                 "does not fit one node: a: the weights (110.83 GiB)")
    (stop,) = checks.stopping([found], replicas)
    assert "set serve.layout: tp" in stop.remediation
    assert layoutfit.layout_findings(fits, duo) == []  # tp: the split fits, nothing to say


def test_02_lets_replicas_that_fit_go_on_to_05(duo, sparks):
    facts = model_facts(GPT_OSS_120B, {"metadata": {"total_size": GPT_OSS_BYTES}}, [], "/m")
    replicas = duo.model_copy(update={"serve": duo.serve.model_copy(update={"layout": "replicas"})})
    assert layoutfit.layout_findings(layoutfit.layout_fits(facts, replicas, sparks), replicas) == []
