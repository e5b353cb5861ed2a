"""serve.speculative (issue 32 item 1-2): validated per method, refused twice over in extra_args, passed to vLLM as
--speculative-config in 05's plan and `sparkbook plan`, and method mtp only for a model whose config.json declares
multi-token-prediction layers (config.json excerpts of published models)."""
from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest

from sparkbook.core.cluster.context import Context
from sparkbook.core.values.modelinfo import ModelFacts, mtp_layers
from sparkbook.core.values.params import ParamsError, Speculative, load_params
from sparkbook.stages.diagnose import checks
from sparkbook.stages.diagnose.checks import speculation_problem
from sparkbook.stages.serve import commands

# Excerpts of config.json as published. Qwen/Qwen3.6-27B (the Qwen3.5 architecture, qwen3_5): its MTP layer count
# under text_config, as vLLM's hf_config_override reads it for qwen3_5 (config quoted in full in a public model
# report found by code search).
QWEN36_27B = {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5",
              "text_config": {"model_type": "qwen3_5_text", "num_hidden_layers": 64, "hidden_size": 5120,
                              "mtp_num_hidden_layers": 1, "mtp_use_dedicated_embeddings": False}}
# deepseek-ai/DeepSeek-V3 config.json: one next-token-prediction (MTP) module beside its 61 layers.
DEEPSEEK_V3 = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "num_hidden_layers": 61,
               "num_nextn_predict_layers": 1}
# meta-llama/Meta-Llama-3-8B config.json: no MTP layers.
LLAMA3_8B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": 32}


def _load(write_params, base, speculative, **serve):
    base["serve"].update(speculative=speculative, **serve)
    return load_params(write_params(base))


def _problems(write_params, base, speculative, **serve):
    with pytest.raises(ParamsError) as exc:
        _load(write_params, base, speculative, **serve)
    return {p.field: p.message for p in exc.value.problems}


def test_each_methods_config_reaches_the_serve_argv_as_vllm_parses_it(write_params, base):
    draft = "/srv/models/eagle3-head"
    for spec, expected in [
        ({"method": "mtp", "num_speculative_tokens": 2}, {"method": "mtp", "num_speculative_tokens": 2}),
        ({"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 2, "prompt_lookup_max": 4},
         {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 2, "prompt_lookup_max": 4}),
        ({"method": "eagle3", "num_speculative_tokens": 3, "model": draft},
         {"method": "eagle3", "num_speculative_tokens": 3, "model": draft})]:
        params = _load(write_params, base, spec)
        for cmd in commands.plan(Context(params, None, None, Path("/tmp"), image="img"), "mp").commands:
            assert cmd.argv.count("--speculative-config") == 1
            assert json.loads(cmd.argv[cmd.argv.index("--speculative-config") + 1]) == expected


def test_no_speculation_no_flag(write_params, base):
    (cmd,) = commands.plan(Context(_load(write_params, base, None), None, None, Path("/tmp")), "ray").commands
    assert "--speculative-config" not in cmd.argv


def test_05s_plan_table_and_sparkbook_plan_show_it(write_params, base):
    params = _load(write_params, base, {"method": "ngram", "num_speculative_tokens": 4})
    ctx = Context(params, None, None, Path("/tmp"), image="img")
    (row,) = commands.plan(ctx, "ray").table()  # what 05's preview shows, and so `sparkbook plan`
    argv = shlex.split(row["command"])  # what an operator would paste
    assert json.loads(argv[argv.index("--speculative-config") + 1]) == {"method": "ngram", "num_speculative_tokens": 4}


@pytest.mark.parametrize("spec, field, says", [
    ({"method": "eagle3", "num_speculative_tokens": 3}, "serve.speculative.model", "needs the draft's directory"),
    ({"method": "draft_model", "num_speculative_tokens": 3}, "serve.speculative.model", "needs the draft's directory"),
    ({"method": "mtp", "num_speculative_tokens": 1, "model": "/srv/models/x"}, "serve.speculative.model",
     "the served model's own"),
    ({"method": "ngram", "num_speculative_tokens": 4, "model": "/srv/models/x"}, "serve.speculative.model",
     "drafts from the prompt"),
    ({"method": "mtp", "num_speculative_tokens": 1, "prompt_lookup_max": 4}, "serve.speculative.prompt_lookup_max",
     "only method ngram reads it"),
    ({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 5, "prompt_lookup_max": 3},
     "serve.speculative.prompt_lookup_min", "5 is above prompt_lookup_max 3"),
    ({"method": "medusa", "num_speculative_tokens": 4}, "serve.speculative.method", "'mtp'"),
    ({"method": "mtp", "num_speculative_tokens": 0}, "serve.speculative.num_speculative_tokens", ">= 1"),
    ({"method": "mtp"}, "serve.speculative.num_speculative_tokens", "Field required")])
def test_each_problem_names_its_field(write_params, base, spec, field, says):
    problems = _problems(write_params, base, spec)
    assert field in problems and says in problems[field].replace("greater than or equal to", ">=")


def test_a_draft_outside_the_mounted_cache_is_refused_for_docker(write_params, base):
    problems = _problems(write_params, base, {"method": "draft_model", "num_speculative_tokens": 3,
                                              "model": "/opt/drafts/qwen3-0.6b"})
    assert "not under model.cache_dir (/srv/models)" in problems["serve.speculative.model"]
    base["runtime"] = {"kind": "python", "python": "/opt/venv/bin/python"}  # no container: any path on the nodes
    params = _load(write_params, base, {"method": "draft_model", "num_speculative_tokens": 3,
                                        "model": "/opt/drafts/qwen3-0.6b"})
    assert params.serve.speculative.model == "/opt/drafts/qwen3-0.6b"


@pytest.mark.parametrize("args", [["--speculative-config", '{"method":"ngram"}'],
                                  ['--speculative-config={"method":"ngram"}'], ["-sc", '{"method":"ngram"}'],
                                  ["--speculative-config.method", "ngram"]])
def test_extra_args_cannot_carry_it_beside_the_field(write_params, base, args):
    problems = _problems(write_params, base, None, extra_args=args)
    assert "(use serve.speculative)" in problems["serve.extra_args"]


@pytest.mark.parametrize("config, layers", [(QWEN36_27B, 1), (DEEPSEEK_V3, 1), (LLAMA3_8B, 0)],
                         ids=["qwen3.6-text_config", "deepseek-v3", "llama3"])
def test_mtp_layers_where_the_config_declares_them(config, layers):
    assert mtp_layers(config) == layers


def facts(config: dict) -> ModelFacts:
    """02's facts of a model whose config is `config` (the figures beside the MTP layers do not matter here)."""
    return ModelFacts(architectures=config["architectures"], model_type=config["model_type"], dtype="bfloat16",
                      quantization=None, bytes_per_param=2.0, total_params=1, active_params=1, weight_bytes=2,
                      weight_source="estimate", num_layers=1, kv_bytes_per_token=1, kv_latent=False,
                      dir_on_nodes="/m", mtp_layers=mtp_layers(config))


def test_mtp_only_for_a_model_with_mtp_layers():
    mtp = Speculative(method="mtp", num_speculative_tokens=2)
    assert speculation_problem(facts(QWEN36_27B), mtp) is None
    assert speculation_problem(facts(DEEPSEEK_V3), mtp) is None
    problem = speculation_problem(facts(LLAMA3_8B), mtp)
    assert problem is not None and problem.startswith("serve.speculative.method: mtp, but LlamaForCausalLM's")
    assert "num_nextn_predict_layers or mtp_num_hidden_layers" in problem
    assert speculation_problem(facts(LLAMA3_8B), Speculative(method="ngram", num_speculative_tokens=4)) is None
    assert speculation_problem(facts(LLAMA3_8B), None) is None


def test_02_stops_on_mtp_for_a_model_without_mtp_layers(write_params, base):
    """The blocker is 02's, before 03 copies anything and long before vLLM would refuse after the weights load."""
    params = _load(write_params, base, {"method": "mtp", "num_speculative_tokens": 1})
    assert checks.speculation_findings(facts(QWEN36_27B), params) == []
    findings = checks.speculation_findings(facts(LLAMA3_8B), params)
    with pytest.raises(checks.Blocked) as exc:
        checks.gate(findings, params)
    assert "[speculation] serve.speculative.method: mtp, but LlamaForCausalLM's" in str(exc.value)
    assert "set serve.speculative to a method this model has" in str(exc.value)
