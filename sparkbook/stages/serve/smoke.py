"""05's smoke test: one chat completion and one completion through the API, each judged on where its answer is
(a client reads chat text from `content`, the thinking from `reasoning_content`), with the fix for a wrong one."""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any, Literal

import httpx

from ...core.params import ServeSettings
from ...core.record import Alternative, Decision
from .commands import ServeError

SmokeKind = Literal["chat", "completion"]
REASONING_TOKENS = 1024  # room for a thinking model to finish thinking and answer ("Say hello." ~400 for Qwen3.5)
PLAIN_TOKENS = 32
THINK_TAGS = ("<think>", "</think>")
REQUESTS: tuple[tuple[SmokeKind, str, dict[str, Any], str], ...] = (  # kind, path, body, prompt
    ("chat", "/v1/chat/completions", {"messages": [{"role": "user", "content": "Say hello."}]}, "Say hello."),
    ("completion", "/v1/completions", {"prompt": "The capital of France is"}, "The capital of France is"))


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


def smoke_tokens(settings: ServeSettings) -> int:
    """max_tokens per smoke request: serve.smoke_max_tokens, else room to think where a reasoning parser runs."""
    return settings.smoke_max_tokens or (REASONING_TOKENS if settings.reasoning_parser else PLAIN_TOKENS)


def judge(kind: SmokeKind, data: dict[str, Any], reasoning_parser: str | None, max_tokens: int) -> Reply:
    """Read a chat completion (`kind` "chat") or completion response body as vLLM returns it and say whether
    its answer is where clients read it: chat text in `content` without think tags, the thinking (if any) in
    `reasoning_content` (`reasoning` in vLLM >= 0.11)."""
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
    """One chat completion and one completion, each judged (`judge`); their text, time and token counts."""
    settings = settings or ServeSettings.model_validate({})
    max_tokens, out = smoke_tokens(settings), []
    with httpx.Client(timeout=timeout_s, headers=settings.headers()) as client:
        for kind, path, body, prompt in REQUESTS:
            t0 = time.monotonic()
            r = client.post(base_url + path, json={"model": model, "max_tokens": max_tokens, "temperature": 0, **body})
            r.raise_for_status()
            data = r.json()
            reply = judge(kind, data, settings.reasoning_parser, max_tokens)
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
    tokens = smoke_tokens(settings)
    evidence = [f"--host {settings.host}",
                f"--reasoning-parser {settings.reasoning_parser}" if settings.reasoning_parser
                else "no serve.reasoning_parser",
                f"--tool-call-parser {settings.tool_call_parser} --enable-auto-tool-choice" if settings.tool_call_parser
                else "no serve.tool_call_parser (no tool calls)",
                f"--chat-template {settings.chat_template}" if settings.chat_template
                else "the model's own chat template", f"max_tokens {tokens}"]
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

