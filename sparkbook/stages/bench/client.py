"""sparkbook's own streaming load client for an OpenAI-compatible /v1/completions server (vLLM).

Prompts are text of an exact token count (random token ids decoded, re-encoded and adjusted by the server's
own tokenizer, as `vllm bench serve`'s random dataset does: the server's tokenization is part of TTFT, as it is
for a user's text); output length is fixed with max_tokens + ignore_eos; output tokens are counted from the
streamed token ids (`return_token_ids`), the prompt's from usage (`stream_options.include_usage`). Timing follows
`vllm bench serve`'s request function; see sparkbook.core.analysis.benchstats for the definitions. Every call has a
timeout.
"""
from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Coroutine
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any, TypeVar

import aiohttp

from ...core.analysis.benchstats import RequestRecord
from ...core.values.params import bearer

T = TypeVar("T")
Prompt = str | list[int]  # text of a fixed token count, or the token ids where no text has that count
TEMPERATURE = 0.0  # greedy; `vllm bench serve` no longer defaults to it, so its reference run is told the same
FIT_TRIES = 10  # decode/re-encode rounds before a prompt is sent as its token ids
SEED_TEXT = ("The cluster serves a new model over Ray and every node streams tokens back to the client "
             "while the benchmark measures time to first token, time per output token and throughput. ")


@dataclass(frozen=True)
class CompletionsServer:
    """Where to send requests: the server's base URL and served model name, and the environment variable holding
    its API key (serve.api_key_env; its value is read where the request is sent, never carried or recorded)."""

    base_url: str
    model: str
    request_timeout_s: float = 300.0
    connect_timeout_s: float = 10.0
    api_key_env: str | None = None

    def session(self, connector: aiohttp.BaseConnector | None = None) -> aiohttp.ClientSession:
        """A session whose every request carries the API key's bearer token, when there is one."""
        return aiohttp.ClientSession(connector=connector, headers=bearer(self.api_key_env))

    def url(self, path: str) -> str:
        return self.base_url.rstrip("/") + path

    def timeout(self, total: float | None = None) -> aiohttp.ClientTimeout:
        return aiohttp.ClientTimeout(total=total or self.request_timeout_s, connect=self.connect_timeout_s)


@dataclass(frozen=True)
class LoadResult:
    """What one client process measured for one batch of requests."""

    records: list[RequestRecord]
    started_at: float   # wall clock when the first request could go
    finished_at: float  # wall clock when the last one ended
    cpu_s: float        # CPU time of the thread running the event loop
    chunks: int


async def _json(session: aiohttp.ClientSession, target: CompletionsServer, method: str, path: str,
                body: dict[str, Any] | None = None) -> Any:
    async with session.request(method, target.url(path), json=body, timeout=target.timeout(30)) as resp:
        resp.raise_for_status()
        return await resp.json(content_type=None)


async def _tokenize(target: CompletionsServer, text: str) -> list[int]:
    async with target.session() as session:
        return await _token_ids(session, target, text)


async def _detokenize(session: aiohttp.ClientSession, target: CompletionsServer, ids: list[int]) -> str:
    return str((await _json(session, target, "POST", "/detokenize", {"model": target.model, "tokens": ids}))["prompt"])


async def _token_ids(session: aiohttp.ClientSession, target: CompletionsServer, text: str) -> list[int]:
    body = {"model": target.model, "prompt": text, "add_special_tokens": False}
    return list((await _json(session, target, "POST", "/tokenize", body))["tokens"])


async def _fit_text(session: aiohttp.ClientSession, target: CompletionsServer, ids: list[int], pool: list[int],
                    rng: random.Random) -> Prompt:
    """Text that the server tokenizes to exactly len(ids) tokens: decode, re-encode, truncate or pad, repeat.
    Where the tokenizer does not settle within FIT_TRIES, the ids themselves (the length is what is fixed)."""
    length, first = len(ids), ids
    for _ in range(FIT_TRIES):
        text = await _detokenize(session, target, ids)
        again = await _token_ids(session, target, text)
        if len(again) == length:
            return text
        ids = again[:length] + [pool[rng.randrange(len(pool))] for _ in range(length - len(again))]
    return first


async def _text_prompts(target: CompletionsServer, id_prompts: list[list[int]], pool: list[int],
                        seed: int) -> list[Prompt]:
    rng = random.Random(seed)
    async with target.session() as session:
        return [await _fit_text(session, target, ids, pool, rng) for ids in id_prompts]


async def _metrics_page(target: CompletionsServer) -> str:
    async with target.session() as session:
        async with session.get(target.url("/metrics"), timeout=target.timeout(30)) as resp:
            resp.raise_for_status()
            return await resp.text()


async def _models(target: CompletionsServer) -> list[str]:
    async with target.session() as session:
        return [m["id"] for m in (await _json(session, target, "GET", "/v1/models"))["data"]]


def make_prompts(pool: list[int], count: int, length: int, seed: int) -> list[list[int]]:
    """`count` prompts of exactly `length` random token ids from `pool` (no shared prefixes to cache)."""
    rng = random.Random(seed)
    return [[pool[rng.randrange(len(pool))] for _ in range(length)] for _ in range(count)]


def request_body(target: CompletionsServer, prompt: Prompt, output_len: int) -> dict[str, Any]:
    """The completion request: fixed output length, streamed with usage and per-chunk token ids."""
    return {"model": target.model, "prompt": prompt, "max_tokens": output_len,
            "ignore_eos": True, "temperature": TEMPERATURE, "stream": True, "return_token_ids": True,
            "stream_options": {"include_usage": True}}


async def one_request(session: aiohttp.ClientSession, target: CompletionsServer, prompt: Prompt,
                      output_len: int, first_token: asyncio.Event | None = None) -> RequestRecord:
    """Send one streamed completion; time every chunk (vLLM's way: TTFT at the first chunk with choices);
    `first_token` is set at that chunk (its prefill done)."""
    sent_at, t0 = time.time(), time.perf_counter()
    ttft = last = None
    gaps: list[float] = []
    counts: list[int] = []
    streamed: int | None = None  # token ids the chunks carried (None: the server sends none)
    usage: dict[str, Any] = {}

    def failed(error: str) -> RequestRecord:  # timed to its failure: the soak dates an engine's death by it
        return RequestRecord(False, sent_at, e2el_s=time.perf_counter() - t0, error=error)

    try:
        async with session.post(target.url("/v1/completions"), json=request_body(target, prompt, output_len),
                                timeout=target.timeout()) as resp:
            if resp.status != 200:
                return failed(f"HTTP {resp.status}: {(await resp.text())[:200]}")
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data:") or line == b"data: [DONE]":
                    continue
                data = json.loads(line[5:])
                if choices := data.get("choices"):
                    now = time.perf_counter()
                    ids = choices[0].get("token_ids")
                    if ids is not None:
                        streamed = (streamed or 0) + len(ids)
                    if ttft is None or last is None:
                        ttft = now - t0
                        if first_token is not None:
                            first_token.set()
                    else:
                        gaps.append(now - last)
                        counts.append(len(ids) if ids is not None else 1)
                    last = now
                if data.get("usage"):
                    usage = data["usage"]
    except (TimeoutError, aiohttp.ClientError, json.JSONDecodeError) as exc:
        return failed(f"{type(exc).__name__}: {exc}"[:200])
    if ttft is None or last is None:
        return failed("no tokens streamed")
    return RequestRecord(True, sent_at, ttft, last - t0, gaps, counts, usage.get("prompt_tokens"),
                         output_tokens(streamed, usage, len(gaps) + 1))


def output_tokens(streamed: int | None, usage: dict[str, Any], chunks: int) -> int:
    """The tokens a request received: those its chunks carried, counted from the stream, because `usage` counts
    more than the client got under speculative decoding (issue 32); usage only where no chunk carries its ids,
    the chunks as the last resort."""
    if streamed is not None:
        return streamed
    return int(usage.get("completion_tokens") or chunks)


async def _load(target: CompletionsServer, prompts: list[Prompt], output_len: int, concurrency: int,
                start_at: float | None) -> LoadResult:
    if start_at is not None:
        await asyncio.sleep(max(0.0, start_at - time.time()))
    started, cpu0 = time.time(), time.thread_time()
    limit = asyncio.Semaphore(concurrency)
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    async with target.session(connector) as session:
        async def limited(prompt: Prompt) -> RequestRecord:
            async with limit:
                return await one_request(session, target, prompt, output_len)

        records = await asyncio.gather(*(limited(p) for p in prompts))
    finished = max([started] + [r.done_at for r in records])
    chunks = sum(len(r.chunk_gaps_s) + 1 for r in records if r.ok)
    return LoadResult(list(records), started, finished, time.thread_time() - cpu0, chunks)


async def _send_prefill_groups(target: CompletionsServer, groups: list[list[Prompt]], companion: Prompt | None,
                          companion_len: int) -> list[RequestRecord]:
    """Each group's prompts sent together for one output token (prefill only), one group after another; with a
    `companion`, one sequence decodes beside them throughout (re-sent when it ends, cancelled after the last group;
    given up when the server refuses it), the first group sent once its first token came (a fixed pause let a busy
    server take the groups before the companion, which then decoded beside none of them)."""
    records: list[RequestRecord] = []
    decoding = asyncio.Event()
    async with target.session(aiohttp.TCPConnector(limit=0)) as session:
        async def decode_beside(prompt: Prompt) -> None:
            while (await one_request(session, target, prompt, companion_len, decoding)).ok:
                pass

        beside = asyncio.create_task(decode_beside(companion)) if companion is not None else None
        try:
            if beside is not None:  # its prefill done (or refused): the groups' steps hold one decode each
                waiting = asyncio.create_task(decoding.wait())
                await asyncio.wait([beside, waiting], return_when=asyncio.FIRST_COMPLETED)
                waiting.cancel()
            for group in groups:
                records += await asyncio.gather(*(one_request(session, target, p, 1) for p in group))
        finally:
            if beside is not None:
                beside.cancel()
                await asyncio.gather(beside, return_exceptions=True)
    return records


def _run(coro: Coroutine[Any, Any, T], timeout_s: float) -> T:
    """Run a coroutine on a fresh event loop in a worker thread (works inside a kernel's running loop)."""
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, asyncio.wait_for(coro, timeout_s)).result(timeout_s + 10)


def tokenize(target: CompletionsServer, text: str = SEED_TEXT * 8) -> list[int]:
    """Token ids of `text` by the server's own tokenizer (POST /tokenize, no special tokens)."""
    return _run(_tokenize(target, text), 60)


def text_prompts(target: CompletionsServer, pool: list[int], count: int, length: int, seed: int) -> list[Prompt]:
    """`count` prompts of exactly `length` tokens by the server's tokenizer, from random ids of `pool`."""
    return _run(_text_prompts(target, make_prompts(pool, count, length, seed), pool, seed), 60 + count)


def metrics_page(target: CompletionsServer) -> str:
    """The server's Prometheus page (GET /metrics): its counters summed over labels (benchstats.prometheus_totals)
    for the cross-check, per label where one matters (specmetrics: speculative decoding's draft positions)."""
    return _run(_metrics_page(target), 60)


def served_models(target: CompletionsServer) -> list[str]:
    """Model ids the server lists (GET /v1/models)."""
    return _run(_models(target), 60)


def run_load(target: CompletionsServer, prompts: list[Prompt], output_len: int, concurrency: int,
             timeout_s: float, start_at: float | None = None) -> LoadResult:
    """Send every prompt, at most `concurrency` in flight (a request goes only when an earlier one has ended);
    the whole batch is bounded by `timeout_s`."""
    return _run(_load(target, prompts, output_len, concurrency, start_at), timeout_s)


def send_prefill_groups(target: CompletionsServer, groups: list[list[Prompt]], timeout_s: float,
                   companion: Prompt | None = None, companion_len: int = 2) -> list[RequestRecord]:
    """Prefill-only groups (see _send_prefill_groups), bounded by `timeout_s`: what they return is not measured."""
    return _run(_send_prefill_groups(target, groups, companion, companion_len), timeout_s)


def run_load_on_engine(target: dict[str, Any], prompts: list[Prompt], output_len: int, concurrency: int,
                       timeout_s: float, start_at: float) -> dict[str, Any]:
    """run_load for an ipyparallel engine: plain data in and out."""
    return asdict(run_load(CompletionsServer(**target), prompts, output_len, concurrency, timeout_s, start_at))
