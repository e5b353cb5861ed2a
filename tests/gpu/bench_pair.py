"""Side-by-side load for the runbook's server and the plain command (tests/gpu/compare_plain.sh).

  bench_pair.py env PARAMS                      `export K=V` lines of the params' runtime.env (for the plain command)
  bench_pair.py bench LABEL BASE_URL MODEL OUT  C=1 and C=16 through sparkbook.stages.bench.sweep, warm-up at the measured concurrency
  bench_pair.py table OUT_DIR                   the two JSON files side by side, with the ratio runbook / plain
  bench_pair.py agree BASE_URL MODEL TOKENIZER OUT ROUNDS  sparkbook's client and `vllm bench serve` alternating on
                                                one server at C=1 and C=8, ROUNDS times; medians side by side (issue 6)
Same load for both: the params' input_len / output_len, PAIR_PROMPTS prompts per point (default 32), the sweep's
warm-up before each point (distinct prompts, C in flight, staggered lengths: benchstats.warmup_lengths).
"""
from __future__ import annotations

import json
import shlex
import statistics
import subprocess
import sys
from pathlib import Path

import yaml

from sparkbook.core.values.params import BenchmarkSettings
from sparkbook.stages.bench.client import TEMPERATURE, CompletionsServer
from sparkbook.stages.bench.sweep import local_runner, sweep

KEYS = ("output_throughput", "median_ttft_ms", "median_tpot_ms", "p99_tpot_ms", "failed")


def vllm_bench_argv(target: CompletionsServer, plan: BenchmarkSettings, concurrency: int, tokenizer: str, result_dir: str,
                    result_filename: str) -> list[str]:
    """`vllm bench serve` with the sweep's lengths, sampling, warm-ups and percentiles: the reference to agree with."""
    return ["vllm", "bench", "serve", "--backend", "vllm", "--base-url", target.base_url, "--model", target.model,
            "--tokenizer", tokenizer, "--dataset-name", "random", "--random-input-len", str(plan.input_len),
            "--random-output-len", str(plan.output_len), "--ignore-eos", "--temperature", str(TEMPERATURE),
            "--max-concurrency", str(concurrency),
            "--num-prompts", str(plan.num_prompts), "--num-warmups", str(plan.warmup_requests),
            "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99",
            "--save-result", "--result-dir", result_dir, "--result-filename", result_filename]


def env(params_file: str) -> None:
    p = yaml.safe_load(open(params_file))
    for k, v in {**p["runtime"].get("env", {}), **p.get("serve", {}).get("env", {})}.items():
        print(f"export {k}={shlex.quote(str(v))}")


def bench(label: str, base_url: str, model: str, out: str, prompts: int, input_len: int, output_len: int) -> None:
    plan = BenchmarkSettings(input_len=input_len, output_len=output_len, num_prompts=prompts, concurrency=[1, 16],
                         warmup_requests=2)
    target = CompletionsServer(base_url, model)
    points = sweep(target, plan, local_runner(target),
                   on_point=lambda p: print(f"{label} C={p.result.max_concurrency}: "
                                            f"{p.result.output_throughput:.1f} tok/s", flush=True))
    rows = {str(p.result.max_concurrency): {k: getattr(p.result, k) for k in KEYS} for p in points}
    Path(out).write_text(json.dumps({"label": label, "base_url": base_url, "plan": plan.model_dump(),
                                     "points": rows}, indent=1))


def table(out_dir: str) -> None:
    a = json.loads((Path(out_dir) / "pair-runbook.json").read_text())["points"]
    b = json.loads((Path(out_dir) / "pair-plain.json").read_text())["points"]
    print("| C | runbook tok/s | plain tok/s | ratio | runbook TTFT p50 ms | plain TTFT p50 ms | runbook TPOT p50 ms | plain TPOT p50 ms |")
    print("|---|---|---|---|---|---|---|---|")
    for c in a:
        ra, rb = a[c], b.get(c, {})
        ratio = ra["output_throughput"] / rb["output_throughput"] if rb.get("output_throughput") else float("nan")
        print(f"| {c} | {ra['output_throughput']:.1f} | {rb.get('output_throughput', 0):.1f} | {ratio:.3f} | "
              f"{ra['median_ttft_ms']:.1f} | {rb.get('median_ttft_ms', 0):.1f} | {ra['median_tpot_ms']:.2f} | "
              f"{rb.get('median_tpot_ms', 0):.2f} |")


AGREE = ("output_throughput", "median_ttft_ms", "median_tpot_ms")


def agree(base_url: str, model: str, tokenizer: str, out: str, rounds: int) -> None:
    """Alternate the two clients on one server; each round: sparkbook C=1 and C=8, then vllm bench C=1 and C=8."""
    plan = BenchmarkSettings(input_len=64, output_len=128, num_prompts=32, concurrency=[1, 8], warmup_requests=2)
    target, folder = CompletionsServer(base_url, model), Path(out)
    runs: dict[str, dict[int, list[dict]]] = {"sparkbook": {1: [], 8: []}, "vllm": {1: [], 8: []}}
    for r in range(rounds):
        for point in sweep(target, plan, local_runner(target)):
            runs["sparkbook"][point.result.max_concurrency].append(point.result.to_json())
        for c in (1, 8):
            name = f"vllm-r{r}-c{c}.json"
            argv = vllm_bench_argv(target, plan, c, tokenizer, str(folder), name)
            subprocess.run([sys.executable, "-m", "vllm.entrypoints.cli.main", *argv[1:]], check=True,
                           capture_output=True, timeout=300)
            runs["vllm"][c].append(json.loads((folder / name).read_text()))
        print(f"round {r}: " + "; ".join(f"{who} C={c} {runs[who][c][-1]['output_throughput']:.1f} tok/s"
                                         for who in runs for c in (1, 8)), flush=True)
    (folder / "agreement-runs.json").write_text(json.dumps(
        {who: {c: [{k: x[k] for k in AGREE} for x in v] for c, v in by_c.items()} for who, by_c in runs.items()},
        indent=1))
    print("| C | metric | sparkbook median | vllm bench median | diff % | sparkbook runs | vllm bench runs |")
    print("|---|---|---|---|---|---|---|")
    for c in (1, 8):
        for k in AGREE:
            ours, ref = ([x[k] for x in runs[who][c]] for who in ("sparkbook", "vllm"))
            a, b = statistics.median(ours), statistics.median(ref)
            print(f"| {c} | {k} | {a:.2f} | {b:.2f} | {100 * (a - b) / b:+.1f} | "
                  f"{', '.join(f'{x:.1f}' for x in ours)} | {', '.join(f'{x:.1f}' for x in ref)} |")


if __name__ == "__main__":
    cmd, args = sys.argv[1], sys.argv[2:]
    if cmd == "env":
        env(*args)
    elif cmd == "bench":
        label, url, model, out = args[:4]
        bench(label, url, model, out, *(int(x) for x in args[4:7]))
    elif cmd == "agree":
        agree(*args[:4], int(args[4]))
    else:
        table(*args)
