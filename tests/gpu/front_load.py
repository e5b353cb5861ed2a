"""A bounded streaming load through the front while a redeploy runs (tests/gpu/front.sh second).

  front_load.py BASE_URL MODEL OUT_PREFIX [--concurrency 8] [--max-s 540] [--hold-s 300]

CONCURRENCY workers each send chat completions (stream, ignore_eos, 64..128 output tokens) one after another until
SIGTERM (each finishes the request it has in flight) or MAX_S. Every request is one of:
  ok       status 200 and the stream ended with `data: [DONE]`
  refused  no connection (httpx.ConnectError): what a client sees without a front while no server listens
  failed   a status other than 200, a stream cut before [DONE], a stream that carried an error object or ended
           without a finish_reason (vLLM ends a stream its engine died under with an error chunk, then [DONE]), or no
           answer within HOLD_S + 60 s
Writes OUT_PREFIX.jsonl (one line per request: start, first token, end in s since the load began, outcome, tokens,
status, error) and OUT_PREFIX.json (the counts, the longest stretch with no completion finished, the slowest TTFT);
prints the summary. A first request decides chat or plain completions (a model without a chat template)."""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import signal
import time

import httpx

PROMPT = "Write a long story about a lighthouse keeper who counts ships. Number every sentence."


async def one(client: httpx.AsyncClient, url: str, body: dict, t0: float) -> dict:
    rec: dict = {"start": round(time.monotonic() - t0, 3), "first": None, "end": None, "tokens": 0, "status": None,
                 "outcome": "failed", "error": None}
    try:
        async with client.stream("POST", url, json=body) as resp:
            rec["status"] = resp.status_code
            if resp.status_code != 200:
                rec["error"] = (await resp.aread()).decode(errors="replace")[:300]
            else:
                done, finish, problem = False, None, None
                async for line in resp.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    data = line[6:].strip()
                    if data == "[DONE]":
                        done = True
                        break
                    try:
                        chunk = json.loads(data)
                    except ValueError:
                        continue
                    if isinstance(chunk, dict) and chunk.get("error") is not None and problem is None:
                        problem = f"error in the stream: {json.dumps(chunk['error'])[:200]}"
                    for choice in chunk.get("choices") or []:
                        finish = choice.get("finish_reason") or finish
                        text = (choice.get("delta") or {}).get("content") if "delta" in choice else choice.get("text")
                        if text:
                            if rec["first"] is None:
                                rec["first"] = round(time.monotonic() - t0, 3)
                            rec["tokens"] += 1
                rec["finish"] = finish
                if not done:
                    rec["error"] = problem or "stream ended without [DONE]"
                elif problem or finish is None:
                    rec["error"] = problem or "[DONE] without a finish_reason"
                else:
                    rec["outcome"] = "ok"
    except httpx.ConnectError as exc:
        rec["outcome"], rec["error"] = "refused", repr(exc)[:200]
    except httpx.HTTPError as exc:
        rec["error"] = repr(exc)[:200]
    rec["end"] = round(time.monotonic() - t0, 3)
    return rec


def body_for(mode: str, model: str, n: int) -> dict:
    if mode == "chat":
        return {"model": model, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": n, "stream": True,
                "ignore_eos": True, "temperature": 0.0}
    return {"model": model, "prompt": PROMPT, "max_tokens": n, "stream": True, "ignore_eos": True, "temperature": 0.0}


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("base_url")
    ap.add_argument("model")
    ap.add_argument("out")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--max-s", type=float, default=540)
    ap.add_argument("--hold-s", type=float, default=300)
    a = ap.parse_args()
    base = a.base_url.rstrip("/")
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    loop.add_signal_handler(signal.SIGINT, stop.set)
    timeout = httpx.Timeout(a.hold_s + 60, connect=5.0)
    limits = httpx.Limits(max_connections=a.concurrency * 2, max_keepalive_connections=a.concurrency * 2)
    records: list[dict] = []
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        t0 = time.monotonic()
        mode = "chat"
        probe = await one(client, f"{base}/v1/chat/completions", body_for("chat", a.model, 16), t0)
        if probe["outcome"] != "ok":
            print(f"chat probe: {probe['status']} {probe['error']}; using /v1/completions", flush=True)
            mode = "completions"
        print(f"mode {mode}; probe {probe}", flush=True)
        url = f"{base}/v1/chat/completions" if mode == "chat" else f"{base}/v1/completions"
        rng = random.Random(0)
        t0, t0_epoch = time.monotonic(), time.time()
        print(f"load t0 epoch {t0_epoch:.1f}", flush=True)

        async def worker(w: int) -> None:
            while not stop.is_set() and time.monotonic() - t0 < a.max_s:
                rec = await one(client, url, body_for(mode, a.model, rng.randint(64, 128)), t0)
                rec["worker"] = w
                records.append(rec)
                if rec["outcome"] != "ok":
                    print(f"{rec['end']:8.1f} s worker {w}: {rec['outcome']} {rec['status']} {rec['error']}",
                          flush=True)
                    await asyncio.sleep(0.5)  # no busy loop while nothing listens

        await asyncio.gather(*(worker(w) for w in range(a.concurrency)))
        t_end = time.monotonic() - t0
    with open(a.out + ".jsonl", "w") as f:
        for r in sorted(records, key=lambda r: r["start"]):
            f.write(json.dumps(r) + "\n")
    counts = {k: sum(r["outcome"] == k for r in records) for k in ("ok", "refused", "failed")}
    ends = sorted(r["end"] for r in records if r["outcome"] == "ok")
    marks = [0.0, *ends, t_end]
    gaps = [(b - a_, a_, b) for a_, b in zip(marks, marks[1:], strict=False)]
    worst = max(gaps) if gaps else (t_end, 0.0, t_end)
    ttfts = sorted(((r["first"] - r["start"]), r["start"]) for r in records if r["first"] is not None)
    held = [r for r in records if r["outcome"] == "ok" and r["first"] is not None and r["first"] - r["start"] > 5]
    summary = {"t0_epoch": round(t0_epoch, 1), "mode": mode, "concurrency": a.concurrency, "duration_s": round(t_end, 1), "requests": len(records),
               **counts, "longest_no_completion_s": round(worst[0], 1),
               "longest_no_completion_from_to_s": [round(worst[1], 1), round(worst[2], 1)],
               "held_ok_ttft_over_5s": len(held), "max_ttft_s": round(ttfts[-1][0], 1) if ttfts else None,
               "max_ttft_started_at_s": round(ttfts[-1][1], 1) if ttfts else None,
               "median_ttft_s": round(ttfts[len(ttfts) // 2][0], 3) if ttfts else None,
               "tokens_ok": sum(r["tokens"] for r in records if r["outcome"] == "ok")}
    with open(a.out + ".json", "w") as f:
        json.dump(summary, f, indent=1)
    print("LOAD SUMMARY " + json.dumps(summary), flush=True)


if __name__ == "__main__":
    asyncio.run(main())
