"""Issue 18 item 5: warm-up with distinct prompts at the measured concurrency, repeats per point, their median and
spread, stalls (TTFT p99 > 10 x median) with the requests they hit, and admission never above the concurrency.

The sweep runs against a small in-process OpenAI-style server (aiohttp): one token per character, streamed
completions of `max_tokens` chunks, /metrics counters; it records every prompt it was sent and how many requests it
had in flight at most.
"""
from __future__ import annotations

import asyncio
import json
import threading
from pathlib import Path

import pytest
from aiohttp import web
from committed import examples

from sparkbook.core.analysis.benchstats import (
    RequestRecord,
    aggregate_repeats,
    compare,
    find_stall,
    median_ttft_ms,
    prefill_group_sizes,
    prompt_seed,
    repeat_spread,
    spread,
)
from sparkbook.core.values.benchbudget import point_timeout_s, warmup_count
from sparkbook.core.values.params import BenchmarkSettings, Params
from sparkbook.core.values.sweeppoint import SweepPoint, read_points, write_point
from sparkbook.stages.bench import client
from sparkbook.stages.bench.client import CompletionsServer, make_prompts, run_load
from sparkbook.stages.bench.sweep import local_runner, saved_points, sweep
from sparkbook.stages.bench.tables import stall_rows, table


class FakeServer:
    """A vLLM-like completions server on 127.0.0.1 in a thread of its own."""

    def __init__(self, step_s: float = 0.001, slow_first_chunk: dict[int, float] | None = None,
                 refuse: str | None = None, speculate: bool = False, usage_extra: int = 0):
        self.step_s, self.slow, self.refuse = step_s, slow_first_chunk or {}, refuse
        self.prompts: list[str] = []
        self.in_flight = self.max_in_flight = 0
        self.generated = self.prefilled = 0
        self.speculate, self.steps = speculate, 0  # two draft tokens a step, the first accepted: 2 tokens a step
        self.usage_extra = usage_extra  # completion_tokens in usage beyond what was streamed
        self.loop = asyncio.new_event_loop()
        self.port = 0

    async def _tokenize(self, request: web.Request) -> web.Response:
        return web.json_response({"tokens": [ord(c) for c in (await request.json())["prompt"]]})

    async def _detokenize(self, request: web.Request) -> web.Response:
        return web.json_response({"prompt": "".join(chr(t) for t in (await request.json())["tokens"])})

    async def _metrics(self, request: web.Request) -> web.Response:
        spec = ("# TYPE vllm:spec_decode_num_drafts counter\n"
                f'vllm:spec_decode_num_drafts_total{{engine="0"}} {self.steps}.0\n'
                "# TYPE vllm:spec_decode_num_draft_tokens counter\n"
                f'vllm:spec_decode_num_draft_tokens_total{{engine="0"}} {2 * self.steps}.0\n'
                "# TYPE vllm:spec_decode_num_accepted_tokens counter\n"
                f'vllm:spec_decode_num_accepted_tokens_total{{engine="0"}} {self.steps}.0\n'
                "# TYPE vllm:spec_decode_num_accepted_tokens_per_pos counter\n"
                f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{engine="0",position="0"}} {self.steps}.0\n'
                'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",position="1"} 0.0\n'
                ) if self.speculate else ""
        return web.Response(text=f"vllm:generation_tokens_total {self.generated}.0\n"
                                 f"vllm:prompt_tokens_total {self.prefilled}.0\n" + spec)

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        number = len(self.prompts)
        self.prompts.append(body["prompt"])
        if str(body["prompt"]) == self.refuse:
            return web.Response(status=400, text="maximum context length exceeded")
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:  # a request the client cancels (the warm-up's decoding companion) ends here too
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            await asyncio.sleep(self.slow.get(number, 0.0))
            for _ in range(body["max_tokens"]):
                await asyncio.sleep(self.step_s)
                chunk = {"choices": [{"text": "x", "token_ids": [120]}]}
                await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
            usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": body["max_tokens"] + self.usage_extra}
            await resp.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\ndata: [DONE]\n\n".encode())
            self.generated += body["max_tokens"]
            self.prefilled += len(body["prompt"])
            self.steps += (body["max_tokens"] + 1) // 2
            return resp
        finally:
            self.in_flight -= 1

    def __enter__(self) -> FakeServer:
        app = web.Application()
        app.router.add_post("/tokenize", self._tokenize)
        app.router.add_post("/detokenize", self._detokenize)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_post("/v1/completions", self._completions)
        self.runner = web.AppRunner(app)
        ready = threading.Event()

        async def start() -> None:
            await self.runner.setup()
            site = web.TCPSite(self.runner, "127.0.0.1", 0)
            await site.start()
            self.port = site._server.sockets[0].getsockname()[1]
            ready.set()

        self.thread = threading.Thread(target=lambda: (self.loop.run_until_complete(start()),
                                                       self.loop.run_forever()), daemon=True)
        self.thread.start()
        assert ready.wait(10)
        return self

    def __exit__(self, *exc: object) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)

    @property
    def target(self) -> CompletionsServer:
        return CompletionsServer(f"http://127.0.0.1:{self.port}", "fake")


def rec(ttft: float, sent: float = 0.0) -> RequestRecord:
    return RequestRecord(True, sent, ttft, ttft + 0.1, [0.1], [1], 8, 2)


def test_warmup_holds_every_prefill_group_and_a_full_batch():
    plan = BenchmarkSettings(output_len=256, warmup_requests=2)
    assert prefill_group_sizes(plan, 16) == list(range(1, 17)) and prefill_group_sizes(plan, 1) == [1]
    assert (warmup_count(plan, 16), warmup_count(plan, 1)) == (16, 2)
    assert warmup_count(BenchmarkSettings(warmup_requests=50), 4) == 50
    none = BenchmarkSettings(warmup_requests=0)
    assert prefill_group_sizes(none, 16) == [] and warmup_count(none, 16) == 0


def test_prompt_seeds_and_prompts_are_distinct_across_points_repeats_and_warmups():
    seeds = [prompt_seed(c, r) for c in (1, 2, 4, 8, 16, 64) for r in range(-1, 5)]
    assert len(set(seeds)) == len(seeds)
    prompts = [tuple(p[:16]) for s in seeds for p in make_prompts(list(range(100, 160)), 64, 64, s)]
    assert len(set(prompts)) == len(prompts), "a shared 16-token block would hit the prefix cache"


def test_spread_and_aggregation_of_repeats():
    s = spread([1043.0, 1157.0, 1216.0])
    assert (s.median, s.low, s.high) == (1157.0, 1043.0, 1216.0)
    assert s.stdev_pct == pytest.approx(100 * 87.94 / 1157, rel=1e-3)
    assert spread([5.0]).stdev_pct == 0.0
    reps = [SweepPoint(max_concurrency=16, completed=64, failed=0, duration=10.0, total_output_tokens=16384,
                       output_throughput=t, p99_ttft_ms=p, median_ttft_ms=None if p == 0 else 60.0)
            for t, p in ((1000.0, 100.0), (1200.0, 90.0), (1100.0, 0))]
    agg = aggregate_repeats(reps)
    assert (agg.completed, agg.duration, agg.total_output_tokens) == (192, 30.0, 3 * 16384)
    assert agg.output_throughput == 1100.0 and agg.p99_ttft_ms == 90.0
    assert agg.median_ttft_ms is None, "a repeat without the figure leaves the point without it"


def test_stall_is_p99_over_ten_times_the_median_and_names_its_requests():
    calm = [rec(0.06 + 0.001 * i, sent=i) for i in range(32)]
    assert find_stall(calm, 16, 0) is None
    stalled = list(calm)
    stalled[5], stalled[20] = rec(2.4, sent=100.5), rec(1.3, sent=120.0)
    stall = find_stall(stalled, 16, 2)
    assert stall is not None and (stall.max_concurrency, stall.repeat) == (16, 2)
    assert [q["index"] for q in stall.requests] == [5, 20]
    assert [q["ttft_ms"] for q in stall.requests] == [2400.0, 1300.0]
    assert stall.requests[0]["sent_at_s"] == 100.5 and stall.p99_ttft_ms > 10 * stall.median_ttft_ms
    one_slow = calm[:-1] + [rec(0.6, sent=40)]  # 10x the median, but p99 of 32 interpolates below it
    assert find_stall(one_slow, 16, 0) is None


def test_a_stall_that_holds_a_whole_wave_is_measured_against_the_calmest_repeat():
    """The H200 record (outputs/examples/h200-duo-mp/bench-repeats, session 1, the three repeats measured first on a fresh
    server): in repeat 1, 12 of 64 requests (one wave) waited 1.11 s for a fused-MoE kernel compile. That wave raised
    the repeat's own median TTFT to 112 ms, and p99 was 9.9x of it; against the calmest repeat's median it is 17x."""
    path = examples() / "h200-duo-mp/bench-repeats/session1-staggered-warmup/after-r0.json"
    repeats = [[RequestRecord(q["ok"], q["sent_at"], q["ttft_s"], q["ttft_s"] + 3.0, [], [], 64, 256)
                for q in run["requests"]] for run in json.loads(path.read_text())["runs"]]
    assert find_stall(repeats[1], 16, 1) is None, "its own median hides it"
    baseline = min(median_ttft_ms(r) for r in repeats)
    assert baseline == pytest.approx(63.9, abs=0.5)
    stall = find_stall(repeats[1], 16, 1, baseline)
    assert stall is not None and stall.baseline_ttft_ms == baseline and stall.median_ttft_ms > 100
    assert [q["index"] for q in stall.requests] == list(range(36, 48))
    assert {round(q["ttft_ms"], -1) for q in stall.requests} == {1110.0}
    sent = [q["sent_at_s"] for q in stall.requests]
    assert max(sent) - min(sent) < 0.01, "one wave, sent together"
    assert [find_stall(r, 16, i, baseline) for i, r in enumerate(repeats) if i != 1] == [None, None]


def test_compare_uses_the_repeats_spread_as_noise():
    def point(tputs: list[float]) -> SweepPoint:
        return SweepPoint.model_validate({"max_concurrency": 16, "completed": 192,
                                          "output_throughput": sorted(tputs)[1],
                                          "sparkbook": {"repeats": [{"output_throughput": t} for t in tputs]}})

    steady = point([1000.0, 1010.0, 990.0])
    assert repeat_spread(steady, "output_throughput").values == [1000.0, 1010.0, 990.0]
    (d,) = compare([point([930.0, 940.0, 935.0])], [steady], ["output_throughput"])
    assert d.worse and d.noise_pct == pytest.approx(2.0) and d.noise_from == "repeats", \
        "-6.5 % against repeats that span 2 %: worse"
    (d,) = compare([point([930.0, 1100.0, 800.0])], [point([1043.0, 1157.0, 1216.0])], ["output_throughput"])
    assert d.noise_pct > abs(d.change_pct) and d.verdict == "within noise", \
        "repeats that move 15-32 % cannot show a 20 % change"
    (d,) = compare([point([1100.0, 1110.0, 1105.0])], [steady], ["output_throughput"])
    assert d.verdict == "better", "+10.5 % against a 2 % band"


def test_point_timeout_counts_repeats():
    plan = BenchmarkSettings(input_len=64, output_len=256, num_prompts=64, warmup_requests=2)
    assert point_timeout_s(plan.model_copy(update={"repeats": 3}), 16) == pytest.approx(120 + (3 * 4 + 1) * 256 / 5)


def test_repeats_default_three_where_gpus_are_listed(tmp_path: Path):
    import yaml
    (tmp_path / "key").write_text("not a key\n")
    (tmp_path / "known_hosts").write_text("")
    for name, want in (("h200-duo.yaml", 3), ("lab.yaml", 1)):
        data = yaml.safe_load(Path("params", name).read_text())
        if "ssh" in data:  # the lab's key lives where `sparkbook lab up` puts it: this test needs no lab
            data["ssh"].update(key_file=str(tmp_path / "key"), known_hosts=str(tmp_path / "known_hosts"))
        assert Params.model_validate(data).benchmark.repeats == want
    data = yaml.safe_load(Path("params/h200-duo.yaml").read_text())
    data["benchmark"]["repeats"] = 5
    assert Params.model_validate(data).benchmark.repeats == 5


def test_admission_never_above_the_concurrency():
    with FakeServer(step_s=0.002) as server:
        result = run_load(server.target, [f"prompt {i}" for i in range(10)], 20, 3, 30)
        assert server.max_in_flight == 3 and [r.output_tokens for r in result.records] == [20] * 10
        server.max_in_flight = 0
        run_load(server.target, [f"again {i}" for i in range(7)], 10, 1, 30)
        assert server.max_in_flight == 1


def test_send_prefill_groups_beside_a_decoding_companion_and_without_one_it_refuses():
    groups = [[f"g{k}-{i}" for i in range(k)] for k in (1, 2, 3)]
    # each group request's prefill takes 0.3 s, as a real server's takes longer than opening three connections: with
    # 2 ms a group request could end before the next of its group arrived on a loaded machine (CI saw 3 in flight)
    with FakeServer(step_s=0.002, slow_first_chunk=dict.fromkeys(range(1, 7), 0.3)) as server:
        # the companion outlasts the groups (cancelled after the last), so the group of 3 has it beside it
        records = client.send_prefill_groups(server.target, groups, 30, companion="companion", companion_len=5000)
        assert [r.output_tokens for r in records] == [1] * 6 and server.max_in_flight == 4
        assert "companion" in server.prompts
    with FakeServer(refuse="refused") as server:
        records = client.send_prefill_groups(server.target, groups, 30, companion="refused", companion_len=30)
        assert all(r.ok for r in records) and server.prompts.count("refused") == 1, "no flood of refused requests"


def test_sweep_warms_up_distinct_prompts_then_repeats_with_fresh_ones(tmp_path: Path):
    plan = BenchmarkSettings(input_len=24, output_len=6, num_prompts=8, concurrency=[1, 4], warmup_requests=2,
                         repeats=3)
    slow = {1 + 2 + 8 + 8 + 3: 0.8}  # C=1: a prefill group of 1, 2 warm-ups, repeats 0 and 1; request 3 of repeat 2
    with FakeServer(slow_first_chunk=slow) as server:
        points = sweep(server.target, plan, local_runner(server.target))
        assert server.max_in_flight == 4, "warm-up and repeats never hold more than the point's concurrency"
    sent = [str(p) for p in server.prompts]
    companion = max(set(sent), key=sent.count)  # C=4's decoding sequence beside the prefill groups, re-sent
    once = [p for p in sent if p != companion]
    groups = 1 + (1 + 2 + 3 + 4) + (1 + 2 + 3)
    assert len(once) == groups + 2 + 3 * 8 + 4 + 3 * 8, "prefill groups, full warm-ups, repeats"
    assert len(set(once)) == len(once) and companion not in once, "every prompt distinct"
    assert all(len(p) == 24 for p in server.prompts)
    one, four = points
    assert len(one.repeats) == 3 and len(one.records) == 24 and one.result.completed == 24
    assert one.result.output_throughput == pytest.approx(sorted(r["output_throughput"] for r in one.repeats)[1])
    assert all(c.agrees for c in one.cross_checks + four.cross_checks), "the /metrics window: repeats, no warm-up"
    assert [(s.repeat, [q["index"] for q in s.requests]) for s in one.stalls] == [(2, [3])]
    assert four.stalls == [] and four.result.max_concurrency == 4
    for point in saved_points(points, server.target, plan, 1):  # as the session keeps them (run.keep_sweep)
        write_point(tmp_path, point)
    saved = read_points(tmp_path)
    files = [p.to_json() for p in saved]
    assert files[0]["num_warmups"] == 2 and files[1]["num_warmups"] == 4
    assert len(files[0]["sparkbook"]["repeats"]) == 3 and files[0]["sparkbook"]["stalls"][0]["repeat"] == 2
    rows = table(saved)
    assert rows[0]["repeats"] == 3 and rows[0]["stalled repeats"] == "2" and rows[1]["stalled repeats"] is None
    assert rows[0]["stdev %"] is not None and "-" in rows[0]["tok/s min-max"]
    (row,) = stall_rows(saved)
    assert (row["concurrency"], row["repeat"], row["requests hit"]) == (1, 2, 1)
    assert row["request index: TTFT ms"].startswith("3: ")
    assert saved[0].sparkbook.speculation is None and "mean accepted length" not in rows[0], "no speculation, no columns"


def test_a_speculating_servers_counters_over_each_point_are_saved_and_tabled(tmp_path: Path):
    """06 reads the speculative-decoding counters before and after each point's repeats (issue 32 item 2): the
    window holds the repeats' steps only, not the warm-up's, and the figures survive the point's file."""
    plan = BenchmarkSettings(input_len=16, output_len=6, num_prompts=4, concurrency=[1, 2], warmup_requests=1, repeats=2)
    with FakeServer(speculate=True, usage_extra=3) as server:
        points = sweep(server.target, plan, local_runner(server.target))
    for point in points:
        assert {r.output_tokens for r in point.records} == {6}, "the streamed tokens, not usage's 9"
        assert all(c.agrees for c in point.cross_checks), "the server's generation counter agrees with the stream"
        assert point.speculation is not None
        assert point.speculation.drafts == 2 * 4 * 3, "2 repeats x 4 prompts x 3 steps of 2 tokens, no warm-up"
        assert (point.speculation.draft_tokens, point.speculation.accepted_per_position) == (48, (24, 0))
    for point in saved_points(points, server.target, plan, 1):  # as the session keeps them (run.keep_sweep)
        write_point(tmp_path, point)
    saved = read_points(tmp_path)
    assert saved[0].sparkbook.speculation == points[0].speculation
    row = table(saved)[0]
    assert (row["mean accepted length"], row["draft acceptance %"], row["acceptance by position"]) == \
        (2.0, 50.0, "1.00, 0.00")
    assert saved[0].total_output_tokens == 48 and saved[0].sparkbook.speculation.accepted == 24
    assert row["decode steps/s"] == round(saved[0].output_throughput / 2, 1), "48 tokens in 24 steps"
    assert row["steps drafting %"] == 100.0, "every step drafted"


def test_the_throughput_plot_draws_the_repeats_min_max():
    from sparkbook.stages.bench.plot import throughput_figure
    points = [SweepPoint(max_concurrency=1, output_throughput=250.0),
              SweepPoint.model_validate({"max_concurrency": 16, "output_throughput": 1157.0, "sparkbook": {
                  "repeats": [{"output_throughput": t} for t in (1043.0, 1157.0, 1216.0)]}})]
    ax = throughput_figure(points).axes[0]
    (bars,) = [c for c in ax.containers if c.get_label().startswith("output tok/s (this run")]
    segments = bars.lines[2][0].get_segments()
    assert [tuple(s[:, 1]) for s in segments] == [(250.0, 250.0), (1043.0, 1216.0)]
