"""The requests of the answers checked at depth (core.analysis.quality) against a vLLM OpenAI-compatible server,
and where the agreement check's reference is kept. 05 calls `check` after its smoke test; 06 can call it at the end
of a soak.

The reference lies beside the cluster's runs (`outputs/<cluster>/quality/<key>.json`, core.values.rundir), not inside
one run dir: a later run of the same cluster finds it without knowing which earlier run recorded it, and an archived or
removed run dir does not take it away. One file per key (model identity and the plan's token-deciding settings,
`quality.reference_key`), so a changed plan starts its own reference instead of failing against another's."""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from ..analysis.quality import (
    ACCESS_CODE_QUESTION,
    AGREEMENT_PROMPTS,
    Agreement,
    Answer,
    Forced,
    Needle,
    Reference,
    Trace,
    answers_verdict,
    compare,
    fact,
    filler,
    known_answers_skipped,
    needle,
    sentences_for,
    shrunk,
    step,
    verdict,
)
from ..values.errors import SparkbookError
from ..values.params import ServeSettings
from ..values.rundir import quality_reference

MAX_REQUESTS = 8  # per prompt of the agreement check: one, plus one after each divergence (soup stops it early)
SAMPLE_SENTENCES = 64  # filler sentences tokenized to learn the tokens per sentence


class Api:
    """One server's OpenAI-compatible API as the checks use it: tokenize, greedy completions with logprobs, chat."""

    def __init__(self, base_url: str, model: str, settings: ServeSettings):
        self.base_url, self.model = base_url, model
        self.client = httpx.Client(timeout=httpx.Timeout(settings.quality.timeout_s, connect=10.0),
                                   headers=settings.headers())

    def close(self) -> None:
        self.client.close()

    def post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        r = self.client.post(self.base_url + path, json={"model": self.model, **body})
        r.raise_for_status()
        data: dict[str, Any] = r.json()
        return data

    def tokenize(self, body: dict[str, Any]) -> dict[str, Any]:
        """vLLM's /tokenize of a prompt or of chat messages: its `tokens`, `count` and the server's max_model_len."""
        return self.post("/tokenize", body)

    def greedy(self, prompt_ids: list[int], max_tokens: int) -> tuple[list[int], list[float]]:
        """A greedy continuation of token ids: each token's id and logprob (EOS ignored, so every run generates
        the same number of tokens)."""
        data = self.post("/v1/completions", {"prompt": prompt_ids, "max_tokens": max_tokens, "temperature": 0,
                                             "logprobs": 1, "ignore_eos": True, "return_tokens_as_token_ids": True})
        lp = data["choices"][0]["logprobs"]
        return [int(t.rsplit(":", 1)[1]) for t in lp["tokens"]], [float(x) for x in lp["token_logprobs"]]

    def chat(self, text: str, max_tokens: int) -> tuple[str, str]:
        data = self.post("/v1/chat/completions", {"messages": [{"role": "user", "content": text}],
                                                  "max_tokens": max_tokens, "temperature": 0})
        choice = data["choices"][0]
        return choice["message"].get("content") or "", choice.get("finish_reason") or ""


def tokens_per_sentence(api: Api) -> float:
    return float(api.tokenize({"prompt": " ".join(filler(SAMPLE_SENTENCES))})["count"]) / SAMPLE_SENTENCES


def messages_tokens(api: Api, text: str) -> int:
    return int(api.tokenize({"messages": [{"role": "user", "content": text}], "add_generation_prompt": True})["count"])


def fitted(api: Api, depth: float, position: float, window: int, reserve: int, per: float) -> tuple[Needle, int]:
    """The needle at `depth`, measured through the chat template and shrunk once where it would pass the window
    less the answer's `reserve`; with its prompt tokens."""
    overhead = messages_tokens(api, fact("0000") + "\n\n" + ACCESS_CODE_QUESTION)
    n = needle(depth, position, window, reserve, per, overhead)
    measured = messages_tokens(api, n.text)
    n2 = shrunk(n, measured, window - reserve, per)
    return n2, measured if n2 is n else messages_tokens(api, n2.text)


def known_answers(api: Api, settings: ServeSettings, window: int, max_tokens: int) -> list[Answer]:
    """Each depth's known-answer prompt asked through the chat API, greedy."""
    check, per, out = settings.quality, tokens_per_sentence(api), []
    for depth in check.depths:
        n, prompt_tokens = fitted(api, depth, check.fact_position, window, max_tokens, per)
        t0 = time.monotonic()
        text, finish = api.chat(n.text, max_tokens)
        out.append(Answer(depth, prompt_tokens, n.position, n.answer, text, finish, time.monotonic() - t0))
    return out


def prompt_set(api: Api, settings: ServeSettings, window: int) -> list[tuple[str, list[int]]]:
    """The agreement check's prompts as token ids: the fixed short ones, and filler cut to the deepest of
    serve.quality.depths (less the continuation's tokens), where a long context's kernels decide the tokens."""
    check = settings.quality
    out = [(name, [int(t) for t in api.tokenize({"prompt": text})["tokens"]]) for name, text in AGREEMENT_PROMPTS]
    deep = int(max(check.depths) * (window - check.agreement_tokens))
    count = sentences_for(deep, tokens_per_sentence(api)) + 1
    ids = [int(t) for t in api.tokenize({"prompt": " ".join(filler(count))})["tokens"]][:deep]
    return [*out, (f"filler, {len(ids)} tokens", ids)]


def traces(api: Api, settings: ServeSettings, window: int) -> list[Trace]:
    """The prompt set's greedy traces: what a first run records as the reference (later runs replay its token
    ids, so a changed prompt set or tokenizer never compares unlike prompts)."""
    out = []
    for name, ids in prompt_set(api, settings, window):
        got, logprobs = api.greedy(ids, settings.quality.agreement_tokens)
        out.append(Trace(name, ids, got, logprobs))
    return out


def forced(api: Api, ref: Trace) -> Forced:
    """This server's top-1 token at each position of the reference's continuation, under the reference's tokens
    before it: one greedy request, and after each divergence one more from the reference's next position."""
    got = Forced()
    for _ in range(MAX_REQUESTS):
        start = len(got.tokens)
        if start >= len(ref.tokens):
            break
        tokens, logprobs = api.greedy(ref.prompt_ids + ref.tokens[:start], len(ref.tokens) - start)
        if not step(ref, got, tokens, logprobs):
            break
    return got


@dataclass(frozen=True)
class QualityReport:
    """What the checks found: the known answers (or why they were skipped), the served window they reached, the
    reference compared with (None: none recorded yet for this key), this run's agreement with it, and this run's
    own traces where there was none to compare with (the reference it may record)."""

    key: str
    window: int
    skipped: str | None
    answers: list[Answer]
    reference: Reference | None
    agreements: list[Agreement]
    traces: list[Trace]
    seconds: float

    def problem(self, min_agreement: float) -> str | None:
        """The first failure: a known answer missing, else agreement below min_agreement (None: none)."""
        return answers_verdict(self.answers) or verdict(self.agreements, min_agreement)


def check(base_url: str, model: str, settings: ServeSettings, key: str, reference: Reference | None,
          answer_tokens: int) -> QualityReport:
    """Both checks against the server: the known answers at each depth (unless skipped), then agreement with
    `reference` where one exists, else this run's traces to record."""
    t0, api = time.monotonic(), Api(base_url, model, settings)
    try:
        window = int(api.tokenize({"prompt": "window"})["max_model_len"])
        skipped = known_answers_skipped(settings)
        answers = [] if skipped else known_answers(api, settings, window, answer_tokens)
        agreements = [compare(t, forced(api, t)) for t in reference.traces] if reference else []
        own = [] if reference else traces(api, settings, window)
    finally:
        api.close()
    return QualityReport(key, window, skipped, answers, reference, agreements, own, time.monotonic() - t0)


class BadReference(SparkbookError):
    """A quality reference beside the cluster's runs is not one 05 wrote for its key: nothing is compared with it."""

    exit_kind = "invalid"


def load_reference(run_dir: Path, key: str) -> Reference | None:
    """The reference recorded for `key` (None: none yet); BadReference naming the file where it is torn, empty or
    another key's (a foreign one would pass or fail this run by another model's or plan's traces)."""
    path = quality_reference(run_dir, key)
    if not path.is_file():
        return None
    remediation = f"move {path} aside: the next run that answers right records a new one"
    try:
        reference = Reference.from_json(path.read_bytes().decode())
    except (ValueError, KeyError) as exc:  # not JSON, not UTF-8, or not a reference
        raise BadReference(f"{path}: not a quality reference ({str(exc)[:120]})", remediation=remediation) from None
    if reference.key != key:
        raise BadReference(f"{path}: it is the reference of key {reference.key!r}, not {key!r}",
                           remediation=remediation)
    return reference


def save_reference(run_dir: Path, reference: Reference) -> Path:
    """Write the reference beside the cluster's runs, whole or not at all (a temporary file renamed)."""
    path = quality_reference(run_dir, reference.key)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(reference.to_json())
    tmp.replace(path)
    return path
