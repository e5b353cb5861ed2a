"""05's smoke test: a chat question with a known answer, a completion and, where a tool-call parser runs, one tool
call, each judged as a client reads it (chat text from `content`, the thinking from `reasoning_content`, calls from
`tool_calls`), with the fix for a wrong one."""
from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass
from typing import Any, Literal

import httpx

from ...core.analysis.quality import dummy_weights
from ...core.values.evidence import Alternative, Decision
from ...core.values.params import ServeSettings
from .commands import ServeError

SmokeKind = Literal["chat", "completion", "tool"]
THINK_TAGS = ("<think>", "</think>")
COMPLETION_PROMPT = "The capital of France is"
TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "the city's name"}},
                   "required": ["city"]}}}
TOOL_PROMPT = "What is the weather in Paris right now? Call the get_weather tool."
# What a tool call looks like when it stays in the text: hermes' <tool_call>{json}</tool_call>, qwen3_coder's
# <tool_call><function=NAME><parameter=...> (vLLM's tool parsers), a bare JSON object naming the function.
UNPARSED_CALL = ("<tool_call>", "<function=", '"name": "get_weather"', '"name":"get_weather"')


def expectation(settings: ServeSettings) -> str | None:
    """What the chat answer must contain: serve.smoke.expect, except with dummy weights (`--load-format dummy`),
    whose answers are noise by design."""
    return None if dummy_weights(settings) else settings.smoke.expect


def requests(settings: ServeSettings) -> list[tuple[SmokeKind, str, dict[str, Any], str]]:
    """(kind, path, body, prompt) of each smoke request: the question, the completion, and the tool call where a
    tool-call parser runs and serve.smoke.tool_call is on."""
    check = settings.smoke
    out: list[tuple[SmokeKind, str, dict[str, Any], str]] = [
        ("chat", "/v1/chat/completions", {"messages": [{"role": "user", "content": check.prompt}]}, check.prompt),
        ("completion", "/v1/completions", {"prompt": COMPLETION_PROMPT}, COMPLETION_PROMPT)]
    if settings.tool_call_parser and check.tool_call:
        out.append(("tool", "/v1/chat/completions", {"messages": [{"role": "user", "content": TOOL_PROMPT}],
                                                      "tools": [TOOL], "tool_choice": "auto"}, TOOL_PROMPT))
    return out


@dataclass(frozen=True)
class Reply:
    """One reply as a client reads it: the answer (chat `content` or completion `text`), the separated thinking,
    and what is wrong with it (None when nothing is), with what to change."""

    text: str
    reasoning: str
    finish_reason: str
    problem: str | None = None
    remediation: str | None = None


@dataclass(frozen=True)
class Smoke:
    kind: SmokeKind
    prompt: str
    text: str
    seconds: float
    completion_tokens: int
    reasoning: str = ""
    finish_reason: str = ""
    problem: str | None = None
    remediation: str | None = None


def judge(kind: SmokeKind, data: dict[str, Any], reasoning_parser: str | None, max_tokens: int,
          expect: str | None = None, tool_parser: str | None = None) -> Reply:
    """Read a chat completion (`kind` "chat"), completion or tool-call response body as vLLM returns it and say
    whether its answer is where clients read it: chat text in `content` without think tags, the thinking (if any)
    in `reasoning_content` (`reasoning` in vLLM >= 0.11), holding `expect` where given; a tool call in `tool_calls`."""
    if kind == "tool":
        return judge_tool(data, tool_parser)
    reply = _judge_text(kind, data, reasoning_parser, max_tokens)
    if reply.problem or expect is None or expect.casefold() in reply.text.casefold():
        return reply
    return dataclasses.replace(reply, problem=f"wrong answer: {expect!r} expected in it, got {reply.text[:160]!r}",
                               remediation="a model that serves but answers wrongly: check the chat template "
                               "(serve.chat_template), the dtype and quantization (broken FP8 kernels write noise) "
                               "and the weights; for a model that cannot answer it set serve.smoke.expect (or null)")


def judge_tool(data: dict[str, Any], tool_parser: str | None) -> Reply:
    """The tool-call reply: a call of get_weather in `tool_calls` with JSON arguments; a call left in the text
    (the parser did not parse it) and an answer without any call are failures, each named."""
    choice = data["choices"][0]
    finish, message = choice.get("finish_reason") or "", choice["message"]
    text, calls = message.get("content") or "", message.get("tool_calls") or []
    parser = f"--tool-call-parser {tool_parser}"
    if calls:
        function = calls[0].get("function") or {}
        name, arguments = function.get("name"), function.get("arguments") or ""
        shown = f"{name}({arguments})"
        try:
            parsed = json.loads(arguments)
        except ValueError:
            parsed = None
        if name == TOOL["function"]["name"] and isinstance(parsed, dict):  # type: ignore[index]
            return Reply(shown, "", finish)
        return Reply(shown, "", finish, f"unparsed call: tool_calls holds {shown[:160]!r}, not get_weather with JSON "
                     f"arguments ({parser})", "set serve.tool_call_parser to the parser for this model's call format "
                     "(vLLM docs: Tool Calling)")
    if any(mark in text for mark in UNPARSED_CALL):
        return Reply(text, "", finish, f"unparsed call: the model called the tool in its text but tool_calls is empty "
                     f"({parser} did not parse {text.strip()[:120]!r})",
                     "set serve.tool_call_parser to the parser for the format the model writes (qwen3_coder for "
                     "<function=...> calls, hermes for <tool_call>{json}; vLLM docs: Tool Calling), and check the "
                     "chat template; speculative decoding has been reported to break qwen3_coder calls")
    return Reply(text, "", finish, f"no tool call: the model answered in text ({text.strip()[:120]!r}) though asked to "
                 "call get_weather", "check that the chat template renders `tools` (serve.chat_template) and that "
                 "the model was trained for tool calls")


def _judge_text(kind: SmokeKind, data: dict[str, Any], reasoning_parser: str | None, max_tokens: int) -> Reply:
    choice = data["choices"][0]
    finish = choice.get("finish_reason") or ""
    if kind != "chat":
        text = choice.get("text") or ""
        return Reply(text, "", finish) if text.strip() else Reply(text, "", finish, *_nothing(finish, max_tokens))
    message = choice["message"]
    text = message.get("content") or ""
    reasoning = message.get("reasoning_content") or message.get("reasoning") or ""
    parser = f"--reasoning-parser {reasoning_parser}" if reasoning_parser else "no reasoning parser"
    if any(tag in text for tag in THINK_TAGS):
        return Reply(text, reasoning, finish, f"the answer holds the model's thinking with its {'/'.join(THINK_TAGS)} "
                     f"tags ({parser}): clients would show the thinking as the answer",
                     "set serve.reasoning_parser to the model's parser (qwen3 for Qwen3/Qwen3.5, deepseek_r1 for "
                     "DeepSeek-R1; vLLM docs: Reasoning Outputs)" if reasoning_parser is None else
                     f"the parser {reasoning_parser} does not match the model's output: set serve.reasoning_parser to "
                     "the one for this model and its chat template (vLLM docs: Reasoning Outputs)")
    if not text.strip() and reasoning.strip():
        if finish == "length":
            return Reply(text, reasoning, finish, f"all {max_tokens} tokens went to thinking (finish_reason length, "
                         "content empty): the model was cut off before it answered",
                         f"raise serve.smoke_max_tokens (now {max_tokens})")
        return Reply(text, reasoning, finish, f"the whole answer is in reasoning_content and content is empty though "
                     f"the model finished (finish_reason {finish or 'none'}): {parser} does not match the model's "
                     "output", "set serve.reasoning_parser to the parser for this model and its chat template, or "
                     "remove it for a model that does not think (vLLM docs: Reasoning Outputs)")
    if not text.strip():
        return Reply(text, reasoning, finish, *_nothing(finish, max_tokens))
    return Reply(text, reasoning, finish)


def _nothing(finish: str, max_tokens: int) -> tuple[str, str]:
    return (f"no text in the reply (neither content nor reasoning; finish_reason {finish or 'none'}, "
            f"max_tokens {max_tokens})", "read the serve log tail in the run's logs/ and send the request by hand")


def smoke_test(base_url: str, model: str, settings: ServeSettings | None = None,
               timeout_s: float = 180) -> list[Smoke]:
    """The smoke requests (`requests`), each judged (`judge`); their text, time and token counts."""
    settings = settings or ServeSettings.model_validate({})
    max_tokens, out = settings.smoke_tokens(), []
    with httpx.Client(timeout=timeout_s, headers=settings.headers()) as client:
        for kind, path, body, prompt in requests(settings):
            t0 = time.monotonic()
            r = client.post(base_url + path, json={"model": model, "max_tokens": max_tokens, "temperature": 0, **body})
            r.raise_for_status()
            data = r.json()
            reply = judge(kind, data, settings.reasoning_parser, max_tokens,
                          expectation(settings) if kind == "chat" else None, settings.tool_call_parser)
            out.append(Smoke(kind=kind, prompt=prompt, seconds=time.monotonic() - t0,
                             completion_tokens=data["usage"]["completion_tokens"], **dataclasses.asdict(reply)))
    return out


def check_smoke(smoke: list[Smoke]) -> None:
    """ServeError, naming the request and what to change, for the first reply whose answer is not usable."""
    for s in smoke:
        if s.problem:
            raise ServeError(f"smoke test, {s.kind} request ({s.prompt!r}): {s.problem}", remediation=s.remediation)


def smoke_decision(settings: ServeSettings) -> Decision:
    """What the smoke test expects of the chat reply, given how vLLM was told to shape the model's output."""
    tokens = settings.smoke_tokens()
    evidence = [f"--host {settings.host}",
                f"--reasoning-parser {settings.reasoning_parser}" if settings.reasoning_parser
                else "no serve.reasoning_parser",
                f"--tool-call-parser {settings.tool_call_parser} --enable-auto-tool-choice" if settings.tool_call_parser
                else "no serve.tool_call_parser (no tool calls)",
                f"--chat-template {settings.chat_template}" if settings.chat_template
                else "the model's own chat template", f"max_tokens {tokens}",
                f"answer must contain {expectation(settings)!r} (serve.smoke.expect)" if expectation(settings)
                else "any answer text (serve.smoke.expect null, or dummy weights)",
                "a get_weather call parsed into tool_calls" if settings.tool_call_parser and settings.smoke.tool_call
                else "no tool-call request"]
    if settings.reasoning_parser:
        return Decision("What must the smoke test's chat reply hold?",
                        "the answer in content, the thinking in reasoning_content",
                        f"vLLM separates the model's thinking with the {settings.reasoning_parser} parser; {tokens} "
                        "tokens leave room to finish thinking and answer",
                        [Alternative("any text in content (32 tokens)", "a reply cut off while thinking has no "
                                     "content, and thinking left in content would pass as an answer")], evidence)
    return Decision("What must the smoke test's chat reply hold?", "text in content, without think tags",
                    f"no reasoning parser runs, so a model that thinks would put its tagged thinking in content: the "
                    f"test fails on it ({tokens} tokens)",
                    [Alternative("the answer in content, the thinking in reasoning_content",
                                 "vLLM returns no reasoning_content without serve.reasoning_parser")], evidence)

