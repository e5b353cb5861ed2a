"""Issue 18 item 5 on one server: the spread of 06's C=16 output tok/s over three repeats, old sweep against new.

  bench_repeats.py one before|after BASE_URL MODEL OUT_JSON   one measurement: `before` = three runs of the sweep of
        commit c2073fa at C=16 (PYTHONPATH puts that package first), each with its own warm-up (max(2, C) requests at
        C, as params/h200-duo*.yaml asked); `after` = this tree's sweep:
        one point, its warm-up (prefill groups of 1..C alone and beside a decode, then a full batch), 3 repeats
  bench_repeats.py drive ROUNDS BASE_URL MODEL OLD_PKG OUT   alternate after/before ROUNDS times (each in its own
        process; KINDS="after" runs the new sweep alone), then the table; writes OUT/repeats.json, prints markdown
The load is 06's on the H200 record (params/h200-duo-mp.yaml): 64 tokens in, 256 out, 64 prompts per run, C=16.
Every request's wall-clock send time and TTFT is kept, so a stall can be matched with the server's compile times.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

LOAD = {"input_len": 64, "output_len": 256, "num_prompts": 64, "concurrency": [16], "warmup_requests": 2}
REPEATS = 3
FIELDS = ("output_throughput", "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms")


def _requests(records: list) -> list[dict]:
    return [{"sent_at": r.sent_at, "ttft_s": r.ttft_s, "ok": r.ok} for r in records]


def one(kind: str, base_url: str, model: str, out: str) -> None:
    from sparkbook.core.values.params import BenchmarkSettings
    from sparkbook.stages.bench.client import CompletionsServer
    from sparkbook.stages.bench.sweep import local_runner, sweep

    target, runs = CompletionsServer(base_url, model), []
    started = time.time()
    if kind == "before":  # the old plan field: warm up with max(warmup_requests, C) requests at C
        plan = BenchmarkSettings(**LOAD, warmup_at_concurrency=True)
        for _ in range(REPEATS):
            (point,) = sweep(target, plan, local_runner(target))
            runs.append({**{k: point.result.figure(k) for k in FIELDS}, "requests": _requests(point.records)})
        stalls: list = []
    else:
        plan = BenchmarkSettings(**LOAD, repeats=REPEATS)
        (point,) = sweep(target, plan, local_runner(target))
        n = plan.num_prompts
        runs = [{**{k: rep[k] for k in FIELDS}, "requests": _requests(point.records[i * n:(i + 1) * n])}
                for i, rep in enumerate(point.repeats)]
        stalls = [s.__dict__ for s in point.stalls]
    Path(out).write_text(json.dumps({"kind": kind, "started": started, "finished": time.time(), "runs": runs,
                                     "stalls_found_by_sweep": stalls}, indent=1))


def _stall(requests: list[dict], factor: float = 10.0) -> list[dict]:
    """Requests whose TTFT exceeds factor x the run's median (the new sweep's stall rule, applied to both)."""
    ttfts = [r["ttft_s"] for r in requests if r["ok"]]
    median = statistics.median(ttfts)
    t0 = min(r["sent_at"] for r in requests)
    return [{"index": i, "ttft_ms": round(1000 * r["ttft_s"], 1), "sent_after_s": round(r["sent_at"] - t0, 3),
             "sent_at": r["sent_at"]} for i, r in enumerate(requests) if r["ok"] and r["ttft_s"] > factor * median]


def drive(rounds: int, base_url: str, model: str, old_pkg: str, out: str) -> None:
    folder, repo = Path(out), Path(__file__).resolve().parents[2]
    site = os.environ.get("SITE", "/tmp/site")
    results = []
    for r in range(rounds):
        for kind in os.environ.get("KINDS", "after before").split():  # the new sweep first on a fresh server
            path = folder / f"{kind}-r{r}.json"
            pythonpath = f"{old_pkg if kind == 'before' else repo}:{site}"
            subprocess.run([sys.executable, __file__, "one", kind, base_url, model, str(path)], check=True,
                           timeout=400, env={**os.environ, "PYTHONPATH": pythonpath})
            data = json.loads(path.read_text())
            data["round"] = r
            for run in data["runs"]:
                run["stalled_requests"] = _stall(run.pop("requests"))
            results.append(data)
            tputs = [x["output_throughput"] for x in data["runs"]]
            print(f"round {r} {kind}: " + ", ".join(f"{t:.1f}" for t in tputs) + " tok/s; stalled requests per run: "
                  + ", ".join(str(len(x["stalled_requests"])) for x in data["runs"]), flush=True)
    (folder / "repeats.json").write_text(json.dumps({"load": LOAD, "repeats": REPEATS, "results": results},
                                                    indent=1))
    print("\n| round | code | C=16 output tok/s (3 runs) | median | min-max % of median | stdev % | "
          "TTFT p50 ms | TTFT p99 ms | runs with a stall (p99 > 10x p50) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for d in results:
        t = [x["output_throughput"] for x in d["runs"]]
        med = statistics.median(t)
        print(f"| {d['round']} | {d['kind']} | {', '.join(f'{x:.1f}' for x in t)} | {med:.1f} | "
              f"{100 * (max(t) - min(t)) / med:.1f} | {100 * statistics.stdev(t) / med:.1f} | "
              f"{', '.join(format(x['median_ttft_ms'], '.0f') for x in d['runs'])} | "
              f"{', '.join(format(x['p99_ttft_ms'], '.0f') for x in d['runs'])} | "
              f"{sum(1 for x in d['runs'] if x['p99_ttft_ms'] > 10 * x['median_ttft_ms'])} |")


if __name__ == "__main__":
    cmd, args = sys.argv[1], sys.argv[2:]
    if cmd == "one":
        one(*args)
    else:
        drive(int(args[0]), *args[1:])
