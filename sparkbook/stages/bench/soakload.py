"""The soak's load: `concurrency` streams, each sending one request after another of `context` fresh random prompt
tokens (sent as token ids, so no prefix is cached and no tokenizer round trip is paid per request) until the soak's
end; a stop ends them at once, requests in flight cancelled. Every request is bounded by the client's timeout and
the whole load by `bound_s`."""
from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import aiohttp

from ...core.analysis.benchstats import RequestRecord
from .client import CompletionsServer, make_prompts, one_request

STOP_POLL_S = 0.5
FAILED_PAUSE_S = 1.0  # a stream's pause after a failed request


async def _streams(target: CompletionsServer, pool: list[int], concurrency: int, context: int, output_len: int,
                   until: float, stop: threading.Event, records: list[RequestRecord]) -> None:
    async with target.session(aiohttp.TCPConnector(limit=0)) as session:
        async def stream(index: int) -> None:
            sent = 0
            while time.time() < until and not stop.is_set():
                prompt = make_prompts(pool, 1, context, seed=index * 1_000_003 + sent)[0]
                records.append(record := await one_request(session, target, prompt, output_len))
                sent += 1
                if not record.ok:  # a dead server refuses at once: pause rather than send hundreds of requests a second
                    await asyncio.sleep(FAILED_PAUSE_S)

        streams = [asyncio.create_task(stream(i)) for i in range(concurrency)]
        while not all(s.done() for s in streams):
            if stop.is_set():
                for s in streams:
                    s.cancel()
            await asyncio.wait(streams, timeout=STOP_POLL_S)
        await asyncio.gather(*streams, return_exceptions=True)


def start(target: CompletionsServer, pool: list[int], concurrency: int, context: int, output_len: int,
          until: float, bound_s: float, stop: threading.Event,
          records: list[RequestRecord]) -> tuple[ThreadPoolExecutor, Future[None]]:
    """The load on its own thread (it appends each ended request to `records`); the caller samples meanwhile and
    joins the future; `stop` ends it early."""
    worker = ThreadPoolExecutor(1, thread_name_prefix="soak-load")
    coro = _streams(target, pool, concurrency, context, output_len, until, stop, records)
    return worker, worker.submit(asyncio.run, asyncio.wait_for(coro, bound_s))
