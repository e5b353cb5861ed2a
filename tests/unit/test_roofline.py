"""The decode ceiling at each concurrency against hand computations: a dense model, a MoE model (the GPU records'
Qwen3-30B-A3B shapes) and the lab's tiny MLA model; the plot draws it per point."""
from __future__ import annotations

import json

import pytest
from committed import examples
from test_modelinfo import DEEPSEEK_V3, LLAMA3_8B, QWEN3_30B_A3B

from sparkbook.core.analysis import benchstats
from sparkbook.core.values.modelinfo import ModelFacts, model_facts
from sparkbook.core.values.sweeppoint import SweepPoint
from sparkbook.stages.bench import tables
from sparkbook.stages.bench.plot import throughput_figure

LAB_STATE = examples() / "lab/20261130T150551Z/state.json"


def test_experts_touched_is_k_for_one_token_and_tends_to_all_experts() -> None:
    assert benchstats.experts_touched(128, 8, 1) == pytest.approx(8.0)
    assert benchstats.experts_touched(128, 8, 16) == pytest.approx(128 * (1 - (120 / 128) ** 16))
    assert benchstats.experts_touched(128, 8, 16) == pytest.approx(82.42, abs=0.01)
    assert benchstats.experts_touched(128, 8, 4096) == pytest.approx(128.0)
    assert benchstats.experts_touched(0, 0, 16) == 0.0


def test_dense_ceiling_by_hand() -> None:
    """Llama-3-8B, bf16, TP=1 at 1000 GB/s, 128 in / 128 out (mean context 192)."""
    facts = model_facts(LLAMA3_8B, None, [], "/m")
    assert (facts.experts, facts.moe_layers, facts.active_params) == (0, 0, 8_030_257_152)
    step = benchstats.step_model(facts, "auto", 1, 1000.0, 128, 128)
    c = benchstats.batch_ceiling(step, 8, measured_tok_s=246.0)
    weights = 2 * 8_030_257_152                     # every weight once per step
    kv = 8 * 192 * (32 * 2 * 8 * 128 * 2)           # 8 sequences x 192 tokens x 131,072 B
    assert (c.weight_bytes, c.kv_bytes) == (weights, kv)
    assert c.ceiling_tok_s == pytest.approx(8 / ((weights + kv) / 1e12))
    assert c.ceiling_tok_s == pytest.approx(491.95, abs=0.01)
    assert c.percent_of_ceiling == pytest.approx(100 * 246.0 / c.ceiling_tok_s)
    # B = 1 without KV is the single-stream roofline
    no_kv = benchstats.batch_ceiling(benchstats.StepModel(**{**step.__dict__, "kv_bytes_per_token": 0.0}), 1)
    assert no_kv.ceiling_tok_s == pytest.approx(benchstats.roofline(facts.active_params, 2.0, 1, 1000.0).ceiling_tok_s)


def test_moe_ceiling_by_hand() -> None:
    """Qwen3-30B-A3B as in outputs/examples/h200-duo: bf16, TP=2 at 4800 GB/s per GPU, 64 in / 256 out (context 192)."""
    facts = model_facts(QWEN3_30B_A3B, None, [], "/m")
    expert = 3 * 2048 * 768
    assert (facts.experts, facts.experts_per_token, facts.moe_layers, facts.expert_params) == (128, 8, 48, expert)
    attn = 2 * 2048 * 32 * 128 + 2 * 2048 * 4 * 128 + 2 * 2048
    active = 48 * (attn + 2048 * 128 + 8 * expert) + 151936 * 2048 * 2
    assert facts.active_params == active == 3_353_018_368
    step = benchstats.step_model(facts, "auto", 2, 4800.0, 64, 256)
    assert step.dense_params == active - 48 * 8 * expert == 1_541_079_040
    points = [SweepPoint(max_concurrency=1, output_throughput=247.3),
              SweepPoint(max_concurrency=16, output_throughput=1675.2)]
    one, sixteen = benchstats.batch_ceilings(step, points)
    kv_token = 48 * 2 * 4 * 128 * 2
    e16 = 128 * (1 - (1 - 8 / 128) ** 16)
    for c, b, touched in ((one, 1, 8.0), (sixteen, 16, e16)):
        weights = 2 * (1_541_079_040 + 48 * expert * touched)
        kv = b * 192 * kv_token
        assert c.experts_touched == pytest.approx(touched)
        assert c.ceiling_tok_s == pytest.approx(b / ((weights + kv) / (2 * 4800e9)))
    assert one.ceiling_tok_s == pytest.approx(1427.5, abs=0.1)  # 6,724,911,104 B per step at 9.6 TB/s
    assert sixteen.ceiling_tok_s == pytest.approx(3772.1, abs=0.1)  # 2.6x the single stream, not 16x
    assert sixteen.percent_of_ceiling == pytest.approx(100 * 1675.2 / sixteen.ceiling_tok_s)
    text = tables.ceiling_markdown(step, [one, sixteen])
    assert "E = 128, k = 8" in text and "E_B = 82.4" in text and "1,541,079,040" in text and "3,772 tok/s" in text


def test_moe_shape_counts_only_the_layers_with_routed_experts() -> None:
    facts = model_facts(DEEPSEEK_V3, None, [], "/m")  # first_k_dense_replace 3 of 61 layers
    assert (facts.experts, facts.experts_per_token, facts.moe_layers, facts.expert_params) == (256, 8, 58,
                                                                                                3 * 7168 * 2048)


def test_the_lab_model_mla_latent_is_read_by_every_rank() -> None:
    """The lab's hyv4-tiny as 02 described it (an older state: no MoE fields, so treated as dense), served float32
    over TP=2 at the lab's 20 GB/s: the latent KV counts once per rank."""
    model = ModelFacts.model_validate(json.loads(LAB_STATE.read_text())["model"])
    step = benchstats.step_model(model, "float32", 2, 20.0, 64, 64)
    assert (step.bytes_per_param, step.kv_bytes_per_token, step.kv_replicated) == (4.0, 2304 * 2, True)
    c = benchstats.batch_ceiling(step, 8, 222.7)
    assert c.kv_bytes == 8 * 96 * 4608 * 2
    assert c.ceiling_tok_s == pytest.approx(8 / ((4 * 1_168_384 + 8 * 96 * 4608 * 2) / 40e9))


def test_the_plot_draws_the_ceiling_at_each_point() -> None:
    step = benchstats.step_model(model_facts(QWEN3_30B_A3B, None, [], "/m"), "auto", 2, 4800.0, 64, 256)
    points = [SweepPoint(max_concurrency=c, output_throughput=t) for c, t in ((1, 247.0), (4, 780.0), (16, 1675.0))]
    ceilings = benchstats.batch_ceilings(step, points)
    ax = throughput_figure(points, ceilings).axes[0]
    line = next(ln for ln in ax.get_lines() if ln.get_label() == "decode ceiling at each concurrency")
    assert list(line.get_xdata()) == [1, 4, 16]
    assert list(line.get_ydata()) == [c.ceiling_tok_s for c in ceilings]
    assert len(set(line.get_ydata())) == 3  # not a flat line
    assert [t.get_text() for t in ax.texts] == [f"{c.percent_of_ceiling:.0f}%" for c in ceilings]
