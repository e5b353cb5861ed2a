"""06's soak as pure logic: the kernel log's Xid and OOM lines, memory PSI, the probe's sections, the verdict's rules
and their order, throughput windows and the worst one, the params that refuse a soak beyond the served context."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from sparkbook.core.analysis.benchstats import RequestRecord
from sparkbook.core.values.params import ParamsError, load_params
from sparkbook.stages.bench import nodewatch, soak
from sparkbook.stages.bench.nodewatch import NodeSample
from sparkbook.stages.bench.soak import ServerSample

# recorded kernel logs (dmesg --time-format iso), one GB10 Xid and one OOM kill among ordinary lines
DMESG = """\
2026-03-02T10:11:01,123456+00:00 usb 1-1: new high-speed USB device number 3 using xhci_hcd
2026-03-02T10:14:07,000101+00:00 NVRM: Xid (PCI:000f:01:00): 79, pid=4242, name=VLLM::EngineCor, GPU has fallen off the bus.
2026-03-02T10:14:07,000200+00:00 NVRM: GPU at PCI:000f:01:00: GPU-1d2c
2026-03-02T10:20:33,551000+00:00 python3 invoked oom-killer: gfp_mask=0x140cca(GFP_HIGHUSER_MOVABLE|__GFP_COMP), order=0
2026-03-02T10:20:33,551900+00:00 oom-kill:constraint=CONSTRAINT_NONE,nodemask=(null),task=VLLM::Worker_TP,pid=5150
2026-03-02T10:20:33,552000+00:00 Out of memory: Killed process 5150 (VLLM::Worker_TP) total-vm:130210260kB, anon-rss:9
"""
MEMINFO = "MemTotal:       128000000 kB\nMemAvailable:    2097152 kB\nSwapTotal:       1048576 kB\nSwapFree:         524288 kB\n"
PSI = "some avg10=12.50 avg60=3.00 avg300=0.80 total=123\nfull avg10=4.25 avg60=1.00 avg300=0.20 total=45\n"


def test_kernel_lines_are_classified_xid_with_its_code_and_every_oom_kill_line() -> None:
    events = [e for line in DMESG.splitlines() if (e := nodewatch.kernel_event(line))]
    assert [(e.kind, e.xid) for e in events] == [("Xid", 79), ("OOM kill", None), ("OOM kill", None),
                                                 ("OOM kill", None)]
    assert "GPU has fallen off the bus" in events[0].line
    assert nodewatch.kernel_event("NVRM: GPU at PCI:000f:01:00: GPU-1d2c") is None


def test_psi_reads_avg10_of_some_and_full_and_nothing_where_the_kernel_has_none() -> None:
    assert nodewatch.psi(PSI) == {"some": 12.5, "full": 4.25}
    assert nodewatch.psi("cat: /proc/pressure/memory: No such file or directory") == {}


def _probe(kernel: str, psi: str = PSI, gpu: str | None = None) -> str:
    return MEMINFO + "@@psi\n" + psi + "@@kernel\n" + kernel + ("@@gpu\n" + gpu if gpu is not None else "")


def test_a_sample_judges_only_kernel_lines_new_since_the_one_before() -> None:
    lines = DMESG.splitlines()
    first = nodewatch.read_sample("spark-a", 0.0, _probe("\n".join(lines[:1])), None, False)
    assert first.kernel_events == [] and first.mem_available_gib == 2.0 and first.swap_used_gib == 0.5
    assert (first.psi_some, first.psi_full) == (12.5, 4.25) and nodewatch.NO_GPUS in first.notes
    baseline = nodewatch.read_sample("spark-a", 0.0, _probe(DMESG), None, False)
    assert baseline.kernel_events == [], "the first sample is the baseline: what the kernel said before the soak"
    later = nodewatch.read_sample("spark-a", 5.0, _probe(DMESG), lines[:3], False)
    assert [e.kind for e in later.kernel_events] == ["OOM kill"] * 3


def test_a_node_that_cannot_tell_says_so() -> None:
    got = nodewatch.read_sample("lab-0", 0.0, _probe("@@unreadable dmesg: read kernel buffer failed: Operation not "
                                                     "permitted; journalctl: No journal files were found.\n",
                                                     psi="cat: /proc/pressure/memory: No such file\n"),
                                [], True)
    assert any(n.startswith("kernel log not readable (dmesg: read kernel buffer failed") for n in got.notes)
    assert any(n.startswith("no memory PSI") for n in got.notes) and got.psi_some is None
    assert any("nvidia-smi gave no GPU" in n for n in got.notes)
    gpu = nodewatch.read_sample("spark-a", 0.0, _probe("", gpu="0, 2405 MHz, 71, 95.50 W\n"), [], True)
    assert [(g.sm_mhz, g.temperature_c, g.power_w) for g in gpu.gpus] == [(2405.0, 71.0, 95.5)] and not gpu.notes


def _node(name: str, at: float, **kw: object) -> NodeSample:
    return NodeSample(name, at, **kw)  # type: ignore[arg-type]


def _ok(n: int, failed: int = 0) -> list[RequestRecord]:
    return [RequestRecord(True, float(i), 0.1, 1.0, [0.1], [1], 10, 2) for i in range(n)] + \
        [RequestRecord(False, 1.0, error="HTTP 500: boom") for _ in range(failed)]


def test_the_verdict_names_the_kernel_first_then_a_dead_engine_then_the_error_rate() -> None:
    up = [ServerSample(t, True) for t in (0.0, 5.0)]
    xid = nodewatch.kernel_event(DMESG.splitlines()[1])
    nodes = [_node("spark-b", 5.0, kernel_events=[xid])]
    found = soak.verdict(up, nodes, _ok(5, 5), 0.01, "spark-a")
    assert found and (found.rule, found.node, found.at) == ("Xid", "spark-b", 5.0) and "Xid 79" in found.message
    assert found.lines == [xid.line] and "spark-b at 1970-01-01T00:00:05+00:00" in found.text()
    assert soak.verdict(up, [], _ok(20), 0.01, "spark-a") is None
    rate = soak.verdict(up, [], _ok(20, 1), 0.01, "spark-a")
    assert rate and rate.rule == "error rate" and "1 of 21 requests failed" in rate.message
    assert rate.lines == ["HTTP 500: boom"]
    assert soak.verdict(up, [], _ok(20, 1), 0.05, "spark-a") is None
    assert soak.verdict(up, [], _ok(3, 1), 0.01, "spark-a") is None, "mid-soak: too few ended to judge"
    assert soak.verdict(up, [], _ok(3, 1), 0.01, "spark-a", final=True) is not None


def test_a_dead_engine_is_two_unanswered_samples_or_a_serving_process_gone_twice() -> None:
    once = [ServerSample(0.0, True), ServerSample(5.0, False, "ConnectError: refused")]
    assert soak.verdict(once, [], _ok(2, 30), 0.01, "spark-a") is None, \
        "one unanswered sample: not yet dead, and requests failing against it are not judged as an error rate"
    twice = [*once, ServerSample(10.0, False, "ConnectError: refused")]
    dead = soak.verdict(twice, [], _ok(2, 30), 0.01, "spark-a")
    assert dead and (dead.rule, dead.node, dead.at) == ("engine dead", "spark-a", 5.0)
    assert "stopped answering (ConnectError: refused)" in dead.message
    up = [ServerSample(t, True) for t in (0.0, 5.0)]
    gone = [_node("spark-b", 0.0, serving=True), _node("spark-b", 5.0, serving=False), _node("spark-b", 10, serving=False)]
    found = soak.verdict(up, gone, [], 0.01, "spark-a")
    assert found and (found.rule, found.node, found.at) == ("engine dead", "spark-b", 5.0)
    frozen = [_node("spark-b", t, unreachable="timed out") for t in (0.0, 5.0)]
    found = soak.verdict(up, frozen, [], 0.01, "spark-a")
    assert found and found.rule == "node unreachable" and found.node == "spark-b"


def test_a_request_answered_with_vllms_engine_dead_error_is_the_engine_s_death_not_an_error_rate() -> None:
    """Lab: the engine core killed mid-soak, 2 of 16 requests answered it while /health still answered."""
    up = [ServerSample(t, True) for t in (0.0, 5.0)]
    died = RequestRecord(False, 4.0, e2el_s=0.5, error='HTTP 500: {"error":{"message":"EngineCore encountered an '
                                                      'issue. See stack trace (above) for the root cause.",'
                                                      '"type":"InternalServerError"}}')
    later = RequestRecord(False, 1.0, e2el_s=4.0, error=died.error)
    found = soak.verdict(up, [], [*_ok(14), later, died], 0.01, "spark-a")
    assert found and (found.rule, found.node, found.at) == ("engine dead", "spark-a", 4.5), \
        "at the first request that answered it (found at the sample after it)"
    assert "2 request(s)" in found.message and "EngineDeadError" in found.message and found.lines == [died.error]
    assert soak.verdict(up, [], [*_ok(1), died], 0.01, "spark-a") is not None, "judged at once, however few ended"


def test_server_sample_reads_vllms_queue_and_error_counters() -> None:
    page = """# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 4.0
vllm:num_requests_waiting{engine="0",model_name="m"} 2.0
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.75
# TYPE vllm:request_success_total counter
vllm:request_success_total{engine="0",finished_reason="stop",model_name="m"} 10.0
vllm:request_success_total{engine="0",finished_reason="abort",model_name="m"} 3.0
# TYPE vllm:num_preemptions_total counter
vllm:num_preemptions_total{engine="0",model_name="m"} 1.0
# TYPE http_requests_total counter
http_requests_total{handler="/v1/completions",method="POST",status="2xx"} 40.0
http_requests_total{handler="/v1/completions",method="POST",status="5xx"} 2.0
"""
    s = soak.server_sample(1.0, page)
    assert (s.running, s.waiting, s.kv_usage, s.aborted, s.errors_5xx, s.preemptions) == (4, 2, 0.75, 3, 2, 1)


def _streamed(sent_at: float, tokens_per_s: float, seconds: float) -> RequestRecord:
    """A request streaming one token per chunk at `tokens_per_s` for `seconds` after a 0.5 s TTFT."""
    n = int(tokens_per_s * seconds)
    return RequestRecord(True, sent_at, 0.5, 0.5 + (n - 1) / tokens_per_s, [1 / tokens_per_s] * (n - 1), [1] * (n - 1),
                         100, n)


def test_windows_count_streamed_tokens_by_their_chunk_times_and_the_worst_is_against_the_median() -> None:
    records = [_streamed(0.0, 10, 30), _streamed(0.0, 10, 30), _streamed(30.0, 2, 30)]
    found = soak.windows(records, end=61.0, length=10.0)
    assert [w.start_s for w in found] == [0, 10, 20, 30, 40, 50], "full windows from the first token; 0.5 s dropped"
    assert {w.length_s for w in found} == {10}
    last = soak.windows(records, end=56.5, length=10.0)[-1]
    assert (last.start_s, last.length_s) == (50, 6), "a last window of over half a length is kept at its own span"
    assert last.tok_s == pytest.approx(2, abs=0.4), "rated over its span, not over a full window"
    assert [w.tok_s for w in found] == pytest.approx([20, 20, 20, 2, 2, 2], abs=0.2)
    assert [(w.ended_ok, w.ended_failed) for w in found][2:4] == [(2, 0), (0, 0)]
    low, median = soak.worst(found)
    assert low is not None and low.start_s == 30 and median == pytest.approx(11, abs=0.2)
    assert soak.worst([]) == (None, None) and soak.windows([], 10.0, 5.0) == []
    assert soak.window_length(1200) == 60 and soak.window_length(20) == 5


def test_params_refuse_a_soak_beyond_the_served_context(tmp_path: Path) -> None:
    text = (Path(__file__).parents[2] / "params" / "lab.yaml").read_text()
    path = tmp_path / "p.yaml"
    path.write_text(text.replace("benchmark:\n", "benchmark:\n  soak_s: 20\n  soak_context: 2000\n", 1))
    with pytest.raises(ParamsError, match="soak_context: 2000 \\+ soak_output_len 128 is more than serve.max_model_len"):
        load_params(path)
    path.write_text(text.replace("benchmark:\n", "benchmark:\n  soak_s: 20\n  soak_context: 1500\n", 1))
    p = load_params(path)
    assert p.benchmark.soak_wait_s == 320 and p.benchmark.soak_concurrency == 4
    assert load_params(Path(__file__).parents[2] / "params" / "spark-duo.yaml").benchmark.soak_s == 1200


def test_the_run_page_shows_the_soak_figure_only_where_the_run_soaked(tmp_path: Path) -> None:
    from rundirs import make_run

    from sparkbook.records import archive, pages

    run_dir = make_run(tmp_path / "lab", "20261206T010000Z")
    assert "<h2>Soak</h2>" not in pages.run_page(archive.read_run(run_dir))
    (run_dir / "bench" / "soak.png").write_bytes(b"\x89PNG")
    (run_dir / "bench" / "soak.json").write_text("{}")
    page = pages.run_page(archive.read_run(run_dir))
    assert '<a href="bench/soak.png">the soak over time</a>' in page and '<img src="bench/soak.png"' in page
    assert '<a href="bench/soak.json">' in page


def test_the_soak_figure_draws_every_series_and_marks_the_failure(tmp_path: Path) -> None:
    from sparkbook.core.values.params import BenchmarkSettings
    from sparkbook.stages.bench import soakplot
    from sparkbook.stages.bench.clocks import GpuSample

    r = soak.SoakResult(BenchmarkSettings(soak_s=40, soak_sample_s=2), started_at=1000.0, ended_at=1030.0)
    r.records = [_streamed(1000.0 + i, 10, 3) for i in range(25)]
    r.nodes = [_node("lab-0", 1000 + 2 * k, mem_available_gib=10.0, notes=[nodewatch.NO_GPUS]) for k in range(15)]
    r.nodes += [_node("spark-b", 1000 + 2 * k, mem_available_gib=5.0, swap_used_gib=0.1, psi_some=1.0,
                      psi_full=0.5, gpus=[GpuSample("spark-b", 0, 2400, 70, 90)]) for k in range(15)]
    r.server = [ServerSample(1000 + 2 * k, True, None, 2, 0) for k in range(14)] + [ServerSample(1030, False, "x")]
    r.windows = soak.windows(r.records, r.ended_at, soak.window_length(40))
    r.failure = soak.Failure("engine dead", "lab-0", 1028.0, "the server stopped answering")
    fig = soakplot.soak_figure(r)
    fig.savefig(tmp_path / "soak.png")
    axes = fig.get_axes()
    assert [a.get_title() for a in axes[:5]] == ["Throughput", "Memory", "Memory pressure (PSI)",
                                                 "Server queue (/metrics)", "GPU clocks, temperature, power"]
    assert all(any(line.get_color() == "red" for line in a.get_lines()) for a in axes[:5]), "the failure's line"
    assert r.report().worst_tok_s is not None and (tmp_path / "soak.png").stat().st_size > 10000


def test_the_answers_after_a_held_soak_are_reported_with_each_prompt_s_share_and_what_failed() -> None:
    """06 asks 05's checks again once the soak held: the report and its hand-off say which reference, each prompt's
    share of identical top-1 tokens and the known answers' skip, and a changed answer is the failure's text."""
    from sparkbook.core.analysis.quality import Agreement, Reference
    from sparkbook.core.cluster.qualityapi import QualityReport
    from sparkbook.core.values.params import BenchmarkSettings

    ref = Reference("k1", "20261206T010000Z", "2026-12-06T01:00:00+00:00", "img", [])
    same = [Agreement("short", 32, 32, None, 0.0, None), Agreement("filler, 900 tokens", 32, 32, None, 0.01, 3)]
    r = soak.SoakResult(BenchmarkSettings(soak_s=40))
    assert r.report().answers is None, "the soak failed (or never asked) before the checks: nothing said of them"
    r.answers_note = "not asked: 05 checked no answers (serve.quality.enabled is false)"
    assert r.report().answers == r.answers_note
    r.answers = QualityReport("k1", 2048, "dummy weights", [], ref, same, [], 4.2)
    assert r.report().answers == ("held; top-1 tokens identical to the reference's: short 100%, filler, 900 tokens "
                                  "100%; known answers skipped (dummy weights) (4 s)")
    r.answers = QualityReport("k1", 2048, "dummy weights", [], ref, [Agreement("short", 32, 5, 5, 7.5, 5)], [], 3.0)
    r.answers_problem = r.answers.problem(0.9)
    assert r.answers_problem is not None and "short" in r.answers_problem
    text = r.report().answers or ""
    assert text.startswith(f"failed: {r.answers_problem}") and "short 16%" in text


def test_the_series_is_saved_whole_at_every_sample_so_a_cut_run_keeps_it(tmp_path: Path) -> None:
    """A soak cut short (the device's 10-minute call ended one 70 s in) left nothing when the series was written
    only at the end; now each sample rewrites bench/soak.json whole (a temporary file renamed)."""
    from sparkbook.core.values.params import BenchmarkSettings

    r = soak.SoakResult(BenchmarkSettings(soak_s=300), started_at=1000.0, ended_at=1010.0)
    r.records = [_streamed(1000.0 + i, 10, 3) for i in range(5)]
    bench = tmp_path / "bench"
    assert soak._save(bench, r) == "bench/soak.json"
    r.records.append(_streamed(1008.0, 10, 3))
    r.ended_at = 1012.0
    soak._save(bench, r)
    data = json.loads((bench / "soak.json").read_text())
    assert data["report"]["ran_s"] == 12.0 and data["report"]["requests_ok"] == 6 and len(data["requests"]) == 6
    assert [p.name for p in bench.iterdir()] == ["soak.json"], "no temporary file left"


def test_a_user_process_named_like_an_xid_that_segfaults_is_no_kernel_event() -> None:
    """Issue 56: the kernel prints a crashing process's name (15 characters at most) at the start of its line; a
    process named `NVRM: Xid (): 7` (or `oom-kill:`) that segfaults must not end the soak as an Xid (an OOM kill)."""
    planted = ["2026-03-02T10:15:00,000000+00:00 NVRM: Xid (): 7[4242]: segfault at 0 ip 000055d5c0de sp 00007ffc "
               "error 4 in python3.11[55d5c0de0000+1000]",
               "2026-03-02T10:15:00,000000+00:00 oom-kill:[4243]: segfault at 0 ip 0 sp 0 error 4",
               "2026-03-02T10:15:00+0000 spark-b kernel: traps: NVRM: Xid (): 7[4244] general protection fault"]
    assert [nodewatch.kernel_event(line) for line in planted] == [None, None, None]
    real = ("2026-03-02T10:14:07+0000 spark-b kernel: NVRM: Xid (PCI:000f:01:00): 79, pid=4242, "
            "name=VLLM::EngineCor, GPU has fallen off the bus.")
    event = nodewatch.kernel_event(real)
    assert event is not None and (event.kind, event.xid) == ("Xid", 79), "journalctl -k's form is read too"
