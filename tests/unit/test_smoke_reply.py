"""The smoke test's verdict on real vLLM chat replies (tests/unit/data/vllm_reasoning_replies.yaml, each with the
issue it comes from): the answer must be in content and the thinking out of it; a failure says which cause it is
and what to change."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import yaml

from sparkbook.core.values.errors import SparkbookError
from sparkbook.core.values.params import PLAIN_TOKENS, REASONING_TOKENS, ServeSettings
from sparkbook.stages.serve import smoke

REPLIES = yaml.safe_load((Path(__file__).parent / "data" / "vllm_reasoning_replies.yaml").read_text())


def body(name: str) -> dict:
    return json.loads(REPLIES[name]["body"])


def test_answer_in_content_and_thinking_in_reasoning_passes():
    reply = smoke.judge("chat", body("split_ok"), "deepseek_r1", 1024)
    assert reply.problem is None and reply.text.strip().startswith("Hello! I'm doing well")
    assert reply.reasoning.startswith("Thinking Process:")  # vLLM >= 0.11 names the field `reasoning`


def test_a_model_that_does_not_think_passes_without_a_parser():
    reply = smoke.judge("chat", body("plain"), None, 32)
    assert reply.problem is None and reply.reasoning == "" and reply.text.startswith("The main ideas")


@pytest.mark.parametrize("parser, fix", [
    (None, "set serve.reasoning_parser to the model's parser"),
    ("qwen3", "the parser qwen3 does not match the model's output")])
def test_think_tags_in_content_fail_naming_the_missing_or_wrong_parser(parser, fix):
    reply = smoke.judge("chat", body("think_in_content"), parser, 1024)
    assert "<think>/</think> tags" in reply.problem and fix in reply.remediation


@pytest.mark.parametrize("name", ["answer_in_reasoning", "answer_in_reasoning_long"])
def test_the_answer_in_reasoning_after_a_natural_stop_is_a_parser_mismatch(name):
    reply = smoke.judge("chat", body(name), "deepseek_r1", 1024)
    assert "content is empty though the model finished (finish_reason stop)" in reply.problem
    assert "--reasoning-parser deepseek_r1 does not match" in reply.problem
    assert reply.remediation.startswith("set serve.reasoning_parser") and "smoke_max_tokens" not in reply.remediation


def test_thinking_cut_at_max_tokens_asks_for_more_tokens_not_another_parser():
    # vllm#52640: a reply that reaches max_tokens before its thinking ends keeps the thinking, with content null
    # and finish_reason length; the real split_ok reply as it is when cut there
    data = body("split_ok")
    data["choices"][0]["message"]["content"] = None
    data["choices"][0]["finish_reason"] = "length"
    reply = smoke.judge("chat", data, "qwen3", 512)
    assert reply.problem.startswith("all 512 tokens went to thinking (finish_reason length")
    assert reply.remediation == "raise serve.smoke_max_tokens (now 512)"


def test_no_text_anywhere_fails():
    reply = smoke.judge("chat", body("empty"), None, 32)
    assert reply.problem.startswith("no text in the reply (neither content nor reasoning")


def test_completion_text_is_judged_only_for_being_there():
    paris = {"choices": [{"text": " Paris.", "finish_reason": "length"}]}
    assert smoke.judge("completion", paris, None, 32).problem is None
    assert smoke.judge("completion", {"choices": [{"text": "", "finish_reason": "stop"}]}, None, 32).problem


def _smoke(reply: smoke.Reply) -> smoke.Smoke:
    return smoke.Smoke(kind="chat", prompt="Say hello.", seconds=1.0, completion_tokens=9, **dataclasses.asdict(reply))


def test_check_smoke_raises_with_the_remediation_and_passes_good_replies():
    smoke.check_smoke([_smoke(smoke.judge("chat", body("split_ok"), "deepseek_r1", 1024))])
    with pytest.raises(SparkbookError) as exc:
        smoke.check_smoke([_smoke(smoke.judge("chat", body("think_in_content"), None, 32))])
    assert exc.value.stage == "05-serve" and "chat request ('Say hello.')" in exc.value.message
    assert exc.value.remediation.startswith("set serve.reasoning_parser")


def test_smoke_tokens_leave_room_to_think_only_where_a_parser_runs():
    assert ServeSettings().smoke_tokens() == PLAIN_TOKENS == 32
    assert ServeSettings(reasoning_parser="qwen3").smoke_tokens() == REASONING_TOKENS
    assert ServeSettings(reasoning_parser="qwen3", smoke_max_tokens=256).smoke_tokens() == 256


def test_the_decision_names_the_serve_output_fields():
    d = smoke.smoke_decision(ServeSettings(reasoning_parser="qwen3", tool_call_parser="qwen3_coder",
                                           chat_template="/srv/models/unsloth.jinja"))
    assert d.choice == "the answer in content, the thinking in reasoning_content"
    assert d.evidence == ["--host 0.0.0.0", "--reasoning-parser qwen3",
                          "--tool-call-parser qwen3_coder --enable-auto-tool-choice",
                          "--chat-template /srv/models/unsloth.jinja", f"max_tokens {REASONING_TOKENS}",
                          "answer must contain 'Paris' (serve.smoke.expect)",
                          "a get_weather call parsed into tool_calls"]
    plain = smoke.smoke_decision(ServeSettings())
    assert plain.choice == "text in content, without think tags" and "no serve.reasoning_parser" in plain.evidence


def test_the_lab_models_reply_passes_as_before():
    # the lab's tiny model (no reasoning parser, 32 tokens): its chat text in a lab run's events.jsonl, 2026-12-01
    lab = ("ial newlineshaarg where list can turtleile Ifdisho\ufffddd without)):QUscri iscolure "
           "decodeUTF charactthod(), will\u0012idathtypeample")
    reply = smoke.judge("chat", {"choices": [{"message": {"role": "assistant", "content": lab}}]}, None, 32)
    assert reply.problem is None and reply.text == lab


def test_an_answer_without_the_expected_text_is_a_wrong_answer():
    plain = body("plain")  # phi-2 on Jeff Walker's formula: text in content, but not what was asked
    reply = smoke.judge("chat", plain, None, 32, expect="Paris")
    assert reply.problem.startswith("wrong answer: 'Paris' expected in it, got 'The main ideas")
    assert "serve.smoke.expect" in reply.remediation and "chat template" in reply.remediation
    assert smoke.judge("chat", body("split_ok"), "deepseek_r1", 1024, expect="hello").problem is None  # casefold


def test_the_expectation_does_not_hide_where_the_answer_is():
    reply = smoke.judge("chat", body("think_in_content"), None, 1024, expect="Scrum")
    assert "<think>/</think> tags" in reply.problem  # the parser cause, not "wrong answer"


def with_function(data: dict, name: str) -> dict:
    data["choices"][0]["message"]["tool_calls"][0]["function"]["name"] = name
    return data


def test_a_call_parsed_into_tool_calls_passes():
    reply = smoke.judge("tool", with_function(body("tool_call_parsed"), "get_weather"), None, 32,
                        tool_parser="qwen3_coder")
    assert reply.problem is None and reply.text == 'get_weather({"input_num": 1024})'


def test_a_call_of_another_function_or_without_json_arguments_is_unparsed():
    reply = smoke.judge("tool", body("tool_call_parsed"), None, 32, tool_parser="qwen3_coder")
    assert reply.problem.startswith("unparsed call: tool_calls holds 'square_the_number(")
    bad = with_function(body("tool_call_parsed"), "get_weather")
    bad["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"] = "<parameter=city>Paris"
    assert smoke.judge("tool", bad, None, 32, tool_parser="hermes").problem.startswith("unparsed call")


def test_a_call_left_in_the_text_names_the_parser():
    reply = smoke.judge("tool", body("tool_call_unparsed"), None, 32, tool_parser="hermes")
    assert reply.problem.startswith("unparsed call: the model called the tool in its text but tool_calls is empty "
                                    "(--tool-call-parser hermes did not parse '<tool_call>")
    assert "qwen3_coder for <function=...> calls" in reply.remediation


def test_an_answer_without_any_call_is_no_tool_call():
    reply = smoke.judge("tool", body("plain"), None, 32, tool_parser="qwen3_coder")
    assert reply.problem.startswith("no tool call: the model answered in text ('The main ideas")


def test_the_tool_request_is_made_only_with_a_tool_parser_and_the_check_on():
    kinds = [k for k, *_ in smoke.requests(ServeSettings())]
    assert kinds == ["chat", "completion"]
    on = smoke.requests(ServeSettings(tool_call_parser="qwen3_coder"))
    assert [k for k, *_ in on] == ["chat", "completion", "tool"] and on[2][2]["tools"] == [smoke.TOOL]
    off = ServeSettings.model_validate({"tool_call_parser": "qwen3_coder", "smoke": {"tool_call": False}})
    assert [k for k, *_ in smoke.requests(off)] == ["chat", "completion"]
    assert smoke.requests(ServeSettings())[0][2]["messages"][0]["content"].startswith("What is the capital of France")


def test_dummy_weights_answer_noise_so_the_answer_is_not_checked():
    assert smoke.expectation(ServeSettings()) == "Paris"
    assert smoke.expectation(ServeSettings(extra_args=["--load-format", "dummy"])) is None
    assert smoke.expectation(ServeSettings(extra_args=["--load-format=dummy"])) is None
    assert smoke.expectation(ServeSettings.model_validate({"smoke": {"expect": None}})) is None
