"""02's memory fit against what CUDA can allocate (recorded nvidia-smi of an H200 and a GB10), and the blockers that
stop 02 (those 03 resolves do not; an override goes on, as a decision)."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

from sparkbook.core.analysis.hostfacts import meminfo, memory_from, sections
from sparkbook.core.values.evidence import Finding
from sparkbook.core.values.modelinfo import GIB, SEED_SHARE, memory_fit, model_facts
from sparkbook.core.values.params import load_params
from sparkbook.stages.diagnose import checks

DATA = Path(__file__).parent / "data"


def recorded(name: str):
    s = sections((DATA / name).read_text(), "node", "node facts", ("meminfo",))
    return s, memory_from(meminfo(s["meminfo"]), s["gpumem"])


def test_h200_fit_is_measured_and_matches_what_torch_could_allocate():
    s, memory = recorded("nvidia-smi-h200.txt")
    assert (memory.gpu_total, memory.gpus, memory.unified) == (143771 << 20, 1, False)
    node = memory.for_fit("h200")
    (free, total), = ast.literal_eval(s["torch"][0])  # torch.cuda.mem_get_info() on the same idle GPU
    assert node.total_bytes > total > free
    assert node.cuda_bytes == pytest.approx(free, abs=1 << 20)
    assert node.cuda_source.startswith("measured")


def test_gb10_reports_no_gpu_memory_and_the_fit_takes_the_documented_share():
    s, memory = recorded("nvidia-smi-gb10.txt")
    assert s["kernel"][1] == "aarch64" and "Not Supported" in (DATA / "nvidia-smi-gb10.txt").read_text()
    assert memory.gpu_total is None and memory.unified
    node = memory.for_fit("spark-1")
    assert node.total_bytes / GIB == pytest.approx(121.69, abs=0.01)
    assert 101.0 < node.cuda_bytes / GIB < 102.2  # CUDA's free memory on a headless GB10: 101.3-102.2 GiB
    assert "unified" in node.cuda_source


def test_no_gpu_fit_is_memavailable():
    memory = memory_from({"MemTotal": 8 * GIB, "MemAvailable": 5 * GIB}, [])
    node = memory.for_fit("lab-0")
    assert not memory.unified and node.cuda_bytes == 5 * GIB and node.cuda_source == "no GPU: MemAvailable"


QWEN35_122B = {  # the seed's model class: a 122B MoE in FP8 (~119 GB of weights), split TP=2 over two Sparks
    "architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe", "torch_dtype": "bfloat16",
    "hidden_size": 3072, "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 2,
    "head_dim": 256, "intermediate_size": 12288, "moe_intermediate_size": 1024, "num_experts": 256,
    "num_experts_per_tok": 8, "vocab_size": 248320, "layer_types": ["linear_attention"] * 36 + ["full_attention"] * 12,
    "quantization_config": {"quant_method": "fp8"}}


@pytest.mark.parametrize("util,fits,tight", [(0.7, True, True), (0.87, False, False), (0.6, True, False)])
def test_gb10_seed_plan(write_params, base, util, fits, tight):
    """At 0.87 vLLM asks for 105.9 GiB where CUDA has ~101.3 (the startup check fails); 0.7 fits but above 0.8."""
    base["serve"] = {"tensor_parallel_size": 2, "gpu_memory_utilization": util, "max_model_len": 32768}
    params = load_params(write_params(base))
    _, memory = recorded("nvidia-smi-gb10.txt")
    facts = model_facts(QWEN35_122B, {"metadata": {"total_size": 119 * 10 ** 9}}, [], "/m")
    rows = memory_fit(facts, params, {n: memory.for_fit(n) for n in "ab"})
    assert [(r.fits, r.tight) for r in rows] == [(fits, tight)] * 2
    found = checks.fit_findings(rows)
    if not fits:
        assert [f.severity for f in found] == ["blocker"] * 2 and "CUDA can allocate 101.29 GiB" in found[0].text
    elif tight:
        assert [f.severity for f in found] == ["warning"] * 2 and f"{SEED_SHARE:.0%}" in found[0].text
    else:
        assert found == []


# --- the gate ------------------------------------------------------------------------------------------
IMAGE = Finding("blocker", "image", "sparkbook-lab/vllm-cpu:0.28.0 (vLLM 0.28.0) does not register HYV4ForCausalLM")
NOT_ON_NETDEV = Finding("blocker", "fabric", "b: 10.9.0.99 is not on eth0 (found ['10.9.0.2'])")
NO_PING = Finding("blocker", "fabric", "b -> a (head) at 10.9.0.1: no answer to ping: b cannot reach a on the fabric")
MTU = Finding("warning", "fabric", "a: eth0 MTU is 1500, the fabric is meant to have 9000")


@pytest.fixture
def params(write_params, base):
    return load_params(write_params(base))


def test_what_03_resolves_and_warnings_do_not_stop(params):
    assert checks.gate([IMAGE, MTU, Finding("fact", "gpu", "a: no GPU")], params) is None


def test_blockers_stop_with_each_node_and_remediation(params):
    with pytest.raises(checks.Blocked) as caught:
        checks.gate([IMAGE, NOT_ON_NETDEV, NO_PING, MTU], params)
    err = caught.value
    assert err.stage == "02-diagnosis" and err.node == "b"
    assert NOT_ON_NETDEV.text in err.message and NO_PING.text in err.message
    assert IMAGE.text not in err.message and MTU.text not in err.message
    assert checks.REMEDIATION["fabric"] in err.message and "proceed_despite_blockers=true" in err.remediation


def test_blockers_on_several_nodes_name_each(params):
    model = Finding("blocker", "model", "a: Org/Model-1B is not in /srv/models")
    blockers = checks.stopping([model, NOT_ON_NETDEV, Finding("blocker", "model", "the nodes hold different "
                                                                                    "config.json files: ['x', 'y']")],
                                 params)
    assert [(b.node, b.topic) for b in blockers] == [("a", "model"), ("b", "fabric"), (None, "model")]
    with pytest.raises(checks.Blocked) as caught:
        checks.gate([model, NOT_ON_NETDEV], params)
    assert caught.value.node is None


def test_override_is_a_decision_listing_what_it_overrode(params):
    decision = checks.gate([IMAGE, NOT_ON_NETDEV], params, proceed_despite_blockers=True)
    assert decision.choice == "go on" and decision.alternatives[0].option == "stop at 02"
    assert decision.evidence == [f"[fabric] {NOT_ON_NETDEV.text} -> {checks.REMEDIATION['fabric']}"]
    assert "proceed_despite_blockers" in decision.reason


def test_what_a_later_stage_resolves_is_listed_with_that_stage():
    assert checks.left_to_later([IMAGE, NOT_ON_NETDEV, MTU]) == [
        f"[image] {IMAGE.text} -> {checks.RESOLVED_LATER['image']}"]
