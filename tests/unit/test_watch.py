"""`sparkbook watch`'s pure logic: the back-off schedule, the give-up rule and its line, the record's format, the
facts a failure is classified with, an operator's stop respected; the loop on a committed lab record whose
endpoint refuses connections (no node is touched). The lab proof is tests/lab/test_watch.py."""
from __future__ import annotations

import http.server
import json
import shutil
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import yaml
from rundirs import reseal

from sparkbook import cli
from sparkbook.cli import exits
from sparkbook.core.values import seal
from sparkbook.core.values.evidence import now
from sparkbook.core.values.params import ParamsError, WatchSettings, load_params
from sparkbook.records import pages, watchlog
from sparkbook.records.watchlog import WatchEvent
from sparkbook.runbook import operate, watch
from sparkbook.runbook.operate import NodeStatus
from sparkbook.runbook.restarts import Restarts, backoff_s
from sparkbook.stages.serve.failures import classify

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "outputs" / "examples"
LAB = REPO / "params" / "lab.yaml"
RUN = "20261201T195946Z"  # the committed lab run whose 05 ended ok: the cluster's deployment


# --- the back-off schedule and the give-up rule ---------------------------------------------------
def test_backoff_none_first_then_doubling_up_to_the_cap() -> None:
    s = WatchSettings(backoff_s=30, backoff_max_s=100)
    assert [backoff_s(s, n) for n in range(5)] == [0.0, 30, 60, 100, 100]


def test_restarts_within_the_window_are_bounded_then_the_window_forgets_them() -> None:
    r = Restarts(WatchSettings(max_restarts=3, restart_window_s=600, backoff_s=10, backoff_max_s=600))
    waits = []
    for t in (0.0, 5.0, 20.0):
        waits.append(r.next_wait(t))
        assert r.made(t) == len(waits)
    assert waits == [0.0, 10, 20]
    assert r.next_wait(30.0) is None, "three restarts in the window: the next failure gives up"
    assert r.next_wait(602.0) == 20, "the first restart left the window: one more, after the back-off of the third"
    assert r.next_wait(700.0) == 0.0, "all of them left it: a fresh failure restarts at once"


def test_a_restart_refused_by_the_lock_is_not_counted() -> None:
    r = Restarts(WatchSettings(max_restarts=1))
    r.made(0.0)
    r.withdraw()
    assert r.next_wait(1.0) == 0.0


def test_max_restarts_0_gives_up_at_the_first_failure() -> None:
    assert Restarts(WatchSettings(max_restarts=0)).next_wait(0.0) is None


def test_watch_settings_are_validated_naming_the_file_and_field(tmp_path: Path) -> None:
    data = yaml.safe_load(LAB.read_text())
    bad = tmp_path / "bad.yaml"
    for watch_section, said in (({"interval_s": 0}, "watch.interval_s: Input should be greater than 0"),
                                ({"backoff_s": 60, "backoff_max_s": 10}, "backoff_max_s: 10 is below backoff_s (60)")):
        bad.write_text(yaml.safe_dump({**data, "watch": watch_section}))
        with pytest.raises(ParamsError) as err:
            load_params(bad)
        assert said in str(err.value) and str(bad) in str(err.value), err.value
    assert load_params(LAB).watch == WatchSettings(), "no watch section: the defaults"


# --- the record --------------------------------------------------------------------------------------
def test_the_record_is_one_json_object_a_line_read_back_past_a_torn_line(tmp_path: Path) -> None:
    back = WatchEvent(at="2026-12-06T01:00:00+00:00", kind="back", run=RUN, text="answers again after 95 s",
                      up_run="20261206T010000Z", seconds_without_service=95.0)
    watchlog.append(tmp_path, WatchEvent(at="2026-12-06T00:58:00+00:00", kind="cause", run=RUN, text="worker died",
                                         cause="worker died", node="lab-0", evidence="EngineCore died"))
    watchlog.append(tmp_path, back)
    with watchlog.path(tmp_path).open("a") as fh:
        fh.write('{"at": "2026-12-06T01:01:00+00:00", "kind": "res')  # a watch killed mid-write
    lines = watchlog.path(tmp_path).read_text().splitlines()
    assert json.loads(lines[1]) == {"at": "2026-12-06T01:00:00+00:00", "kind": "back", "run": RUN,
                                    "text": "answers again after 95 s", "up_run": "20261206T010000Z",
                                    "seconds_without_service": 95.0}, "fields that are None are left out"
    events = watchlog.read(tmp_path)
    assert [e.kind for e in events] == ["cause", "back"] and events[1] == back
    assert back.line() == "2026-12-06T01:00:00+00:00 back           answers again after 95 s"
    with pytest.raises(ValueError):
        WatchEvent(at="t", kind="rebooted", run=None, text="")  # type: ignore[arg-type]


def test_the_clusters_page_shows_the_watch_newest_first(tmp_path: Path) -> None:
    events = [WatchEvent(at=f"2026-12-06T01:0{i}:00+00:00", kind=k, run=RUN, text=f"event {i}")
              for i, k in enumerate(("started", "check_failed", "back"))]
    page = pages.cluster_page("lab", [], events)
    assert "<h2>Watch</h2>" in page and page.index("event 2") < page.index("event 0") and "watch.jsonl" in page
    assert "<h2>Watch</h2>" not in pages.cluster_page("lab", [], [])


# --- the cause ------------------------------------------------------------------------------------
def test_what_is_seen_gone_names_each_node_and_the_engine_death_is_the_classifiers_worker_died() -> None:
    nodes = [NodeStatus("lab-0", "running 0123456789ab", "not used", "running", 60.0),
             NodeStatus("lab-1", "running 0123456789ab", "not used", "not running", 60.0),
             NodeStatus("lab-2", "exited", "not running", "not running", None),
             NodeStatus("lab-3", "unreachable: timed out", "unknown", "unknown", None)]
    seen = watch.observed(nodes, ["lab-0", "lab-1"])
    assert seen == {"lab-1": watch.PROCESS_GONE, "lab-2": "its container is exited",
                    "lab-3": "unreachable: timed out"}
    log = ("INFO 12-06 01:02:03 [api_server.py:1] Started server process\n"
           "ERROR 12-06 01:09:00 [core_client.py:564] Engine core proc EngineCore_DP0 died unexpectedly, "
           "shutting down client.\n")
    died = classify({"lab-0": log}, {})
    assert died.cause == "worker died" and died.node == "lab-0" and "EngineCore_DP0 died unexpectedly" in died.evidence
    died_now = classify({"lab-0": "WARNING 12-06 01:46:52 [core_client.py:818] [shutdown] MPClient: engine core exited "
                                  "unexpectedly; starting cleanup"}, {})  # the lab's vLLM 0.32, its engine killed
    assert died_now.cause == "worker died" and "engine core exited unexpectedly" in died_now.evidence
    gone = classify({"lab-0": ""}, {"lab-0": watch.PROCESS_GONE})
    assert gone.cause == "worker died" and gone.evidence == watch.PROCESS_GONE
    assert watch.with_log_line(gone, {"lab-0": ""}, {"lab-0": watch.PROCESS_GONE}) == gone
    both = watch.with_log_line(classify({"lab-0": log}, seen), {"lab-0": log}, seen)
    assert both.cause == "worker died" and both.node == "lab-1", "the fact seen ranks above a consequence in a log"
    on_0 = watch.with_log_line(classify({"lab-0": log}, {"lab-0": watch.PROCESS_GONE}), {"lab-0": log},
                               {"lab-0": watch.PROCESS_GONE})
    assert on_0.evidence.startswith(watch.PROCESS_GONE + "; its log: ") and "EngineCore_DP0 died" in on_0.evidence


# --- the loop, on a committed record (no node touched) -------------------------------------------------
def _deployed(tmp_path: Path) -> tuple[Path, Path]:
    """The committed lab deployment under tmp outputs, its endpoint moved to a port on this machine that refuses
    connections, with params whose head is this machine."""
    src, dst = EXAMPLES / "lab" / RUN, tmp_path / "outputs" / "lab" / RUN
    dst.mkdir(parents=True)
    for name in ("manifest.json", "state.json", "events.jsonl"):
        shutil.copy(src / name, dst / name)
    with socket.socket() as s:  # bound, never listening: a connection is refused at once
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    state = json.loads((dst / "state.json").read_text())
    state["endpoint"].update(base_url=f"http://127.0.0.1:{port}", addresses={})
    seal.write(dst / "state.json", json.dumps(state))  # as this controller's runbook would have written them
    reseal(dst / "manifest.json")
    data = yaml.safe_load(LAB.read_text())
    data["watch"] = {"interval_s": 0.05, "failures_to_restart": 2}
    data["nodes"][0]["host"] = "127.0.0.1"  # the endpoint on this machine is on a node of the params
    params = tmp_path / "lab.yaml"
    params.write_text(yaml.safe_dump(data))
    return params, dst


def _stop(run_dir: Path, at: str) -> None:
    with (run_dir / "events.jsonl").open("a") as fh:
        fh.write(json.dumps({"at": at, "stage": "operator", "kind": "operator_stop", "data": {"at": at}}) + "\n")


@contextmanager
def _router(answer: bool) -> Iterator[str]:
    """A router on localhost: /health 200, and a one-token completion where `answer` (vllm-router routes around a
    dead replica, so its own checks stay green)."""

    class Router(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802
            self.send_response(200 if self.path == "/health" else 404)
            self.end_headers()

        def do_POST(self) -> None:  # noqa: N802
            body = json.dumps({"choices": [{"text": "x"}] if answer else []}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Router)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()


def _serving(run_dir: Path, **endpoint: object) -> operate.Deployment:
    state = json.loads((run_dir / "state.json").read_text())
    state["endpoint"].update(endpoint)
    seal.write(run_dir / "state.json", json.dumps(state))
    return operate.last_good(load_params(run_dir.parents[2] / "lab.yaml"), run_dir.parents[1])


def test_a_dead_replica_behind_a_green_router_fails_the_check_naming_its_node(tmp_path: Path) -> None:
    _, run_dir = _deployed(tmp_path)
    refused = json.loads((run_dir / "state.json").read_text())["endpoint"]["base_url"]
    with _router(answer=True) as url:
        failed = watch.check(_serving(run_dir, base_url=url + "/v1", replicas={"lab-0": url, "lab-1": refused}), 5)
        assert failed and failed.startswith(f"the replica on lab-1 ({refused}) /health: ConnectError"), failed
        assert "lab-0" not in failed
        assert watch.check(_serving(run_dir, replicas={"lab-0": url, "lab-1": url}), 5) is None
    with _router(answer=False) as url:
        assert watch.check(_serving(run_dir, base_url=url, replicas={}), 5) == "completion: HTTP 200 without a choice"


def test_an_operators_stop_is_never_undone_and_the_record_says_so_once(tmp_path: Path) -> None:
    params, run_dir = _deployed(tmp_path)
    _stop(run_dir, now())
    lines: list[str] = []
    w = watch.Watch(params, tmp_path / "outputs", say=lines.append)
    assert w.run(checks=4) == 4
    events = watchlog.read(tmp_path / "outputs" / "lab")
    assert [e.kind for e in events] == ["started", "check_failed", "paused", "ended"], lines
    assert "stopped by `sparkbook stop`" in events[2].text and "sparkbook up" in events[2].text
    assert "Watch" in (tmp_path / "outputs" / "lab" / "index.html").read_text()
    assert not w.restarts.at, "nothing restarted"


def test_a_stop_before_the_last_answer_is_not_the_failures_reason(tmp_path: Path) -> None:
    params, run_dir = _deployed(tmp_path)
    d = operate.last_good(load_params(params), tmp_path / "outputs")
    assert watch.stopped_at(d, None) is None
    _stop(run_dir, "2026-12-06T01:00:00+00:00")
    assert watch.stopped_at(d, None) == "2026-12-06T01:00:00+00:00", "never seen serving since: it is stopped"
    assert watch.stopped_at(d, "2026-12-06T01:05:00+00:00") is None, "it served after that stop: a later failure"


def test_giving_up_is_one_line_naming_the_cluster_the_cause_and_what_to_do(tmp_path: Path) -> None:
    params, _ = _deployed(tmp_path)
    w = watch.Watch(params, tmp_path / "outputs", say=lambda line: None)
    d = operate.last_good(w.params, w.outputs)
    cause = classify({"lab-0": "Engine core proc EngineCore_DP0 died unexpectedly, shutting down client."}, {})
    with pytest.raises(watch.WatchGaveUp) as err:
        w._give_up(d, cause)
    code, text = exits.failure(err.value)
    assert code == exits.EXIT_GAVE_UP and "\n" not in text, text
    assert text.startswith("WATCH GAVE UP: cluster lab: the deployment of run " + RUN)
    assert "worker died on lab-0" in text and "sparkbook up" in text and "watch.jsonl" in text
    assert watchlog.read(w.cluster_dir)[-1].kind == "gave_up"


def test_watch_with_nothing_deployed_is_one_line_and_exit_1(tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["watch", str(LAB), "--outputs", str(tmp_path), "--checks", "1"]) == exits.EXIT_FAILED
    err = capsys.readouterr().err
    assert "no run under" in err and "Traceback" not in err and not watchlog.read(tmp_path / "lab"), err


def test_sigterm_ends_the_watch_recorded_with_exit_0(tmp_path: Path) -> None:
    """systemd's stop: the watch (its own process, as the unit runs it) records its end and exits 0."""
    import signal
    import subprocess
    import sys
    import time

    params, run_dir = _deployed(tmp_path)
    _stop(run_dir, now())  # paused: it checks on and acts on nothing
    proc = subprocess.Popen([str(Path(sys.executable).parent / "sparkbook"), "watch", str(params), "--outputs",
                             str(tmp_path / "outputs")], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    end = time.monotonic() + 60
    while "paused" not in [e.kind for e in watchlog.read(tmp_path / "outputs" / "lab")] and time.monotonic() < end:
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0 and "Traceback" not in out, out
    last = watchlog.read(tmp_path / "outputs" / "lab")[-1]
    assert last.kind == "ended" and last.text.startswith("watch ended by SIGTERM after "), last
