"""The smoke test's verdict on real vLLM chat replies (tests/unit/data/vllm_reasoning_replies.yaml, each with the
issue it comes from): the answer must be in content and the thinking out of it; a failure says which cause it is
and what to change."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import yaml

from sparkbook.core.errors import SparkbookError
from sparkbook.core.params import ServeSettings
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
    assert smoke.smoke_tokens(ServeSettings()) == smoke.PLAIN_TOKENS == 32
    assert smoke.smoke_tokens(ServeSettings(reasoning_parser="qwen3")) == smoke.REASONING_TOKENS
    assert smoke.smoke_tokens(ServeSettings(reasoning_parser="qwen3", smoke_max_tokens=256)) == 256


def test_the_decision_names_the_serve_output_fields():
    d = smoke.smoke_decision(ServeSettings(reasoning_parser="qwen3", tool_call_parser="qwen3_coder",
                                           chat_template="/srv/models/unsloth.jinja"))
    assert d.choice == "the answer in content, the thinking in reasoning_content"
    assert d.evidence == ["--host 0.0.0.0", "--reasoning-parser qwen3",
                          "--tool-call-parser qwen3_coder --enable-auto-tool-choice",
                          "--chat-template /srv/models/unsloth.jinja", f"max_tokens {smoke.REASONING_TOKENS}"]
    plain = smoke.smoke_decision(ServeSettings())
    assert plain.choice == "text in content, without think tags" and "no serve.reasoning_parser" in plain.evidence


def test_the_lab_models_reply_passes_as_before():
    # the lab's tiny model (no reasoning parser, 32 tokens): its chat text in a lab run's events.jsonl, 2026-12-01
    lab = ("ial newlineshaarg where list can turtleile Ifdisho\ufffddd without)):QUscri iscolure "
           "decodeUTF charactthod(), will\u0012idathtypeample")
    reply = smoke.judge("chat", {"choices": [{"message": {"role": "assistant", "content": lab}}]}, None, 32)
    assert reply.problem is None and reply.text == lab
