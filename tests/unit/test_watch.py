"""`sparkbook watch`'s pure logic: the back-off schedule, the give-up rule and its line, the record's format, the
facts a failure is classified with, an operator's stop respected; the loop on a committed lab record whose
endpoint refuses connections (no node is touched). The lab proof is tests/lab/test_watch.py."""
from __future__ import annotations

import dataclasses
import http.server
import json
import os
import shutil
import socket
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import yaml
from rundirs import reseal

from sparkbook import cli
from sparkbook.cli import exits
from sparkbook.core.cluster.nodes import NodeError
from sparkbook.core.cluster.runtime import Place
from sparkbook.core.values import seal
from sparkbook.core.values.evidence import now, read_events
from sparkbook.core.values.fanout import FanOut, Outcome
from sparkbook.core.values.params import ParamsError, WatchSettings, load_params
from sparkbook.records import pages, watchlog
from sparkbook.records.watchlog import WatchEvent
from sparkbook.runbook import lock, operate, watch, watchlock
from sparkbook.runbook.operate import NodeStatus
from sparkbook.runbook.restarts import Restarts, backoff_s
from sparkbook.runbook.session import open_run
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
    assert watch.stopped(d, None) is None
    _stop(run_dir, "2026-12-06T01:00:00+00:00")
    stop = watch.stopped(d, None)
    assert stop and stop.at == "2026-12-06T01:00:00+00:00", "never seen serving since: it is stopped"
    assert watch.stopped(d, "2026-12-06T01:05:00+00:00") is None, "it served after that stop: a later failure"


class _HalfReachable:
    """A runtime whose lab-1 cannot be reached (its SSH times out): the stop ends lab-0's server alone."""

    def alive(self, node: object, place: object) -> bool:
        return True

    def kill(self, node: SimpleNamespace, place: object, spawned: object) -> None:
        if node.name == "lab-1":
            raise NodeError("lab-1", "ssh: connect to host 10.200.0.11 port 22: Connection timed out")

    def stop(self, node: object, place: object) -> bool:
        return True


class _Cluster:
    def __init__(self, names: list[str]):
        self.nodes = {n: SimpleNamespace(name=n) for n in names}

    def fan_out(self, step: Callable[[Any], Any], timeout: float = 0) -> FanOut[Any]:
        outcomes: FanOut[Any] = FanOut()
        for name, node in self.nodes.items():
            try:
                outcomes[name] = Outcome(name, value=step(node))
            except NodeError as exc:
                outcomes[name] = Outcome(name, error=exc)
        return outcomes


def test_a_partial_stop_is_recorded_one_line_and_the_watch_leaves_it_stopped(tmp_path: Path) -> None:
    """Planted: lab-1 unreachable during `sparkbook stop`. The stop ends lab-0's server, records both (a partial
    stop), fails with one line naming both; the watch then finds the deployment dark and restarts nothing, a check
    that answered after the stop included (what the stop could not reach was meant to stop too)."""
    params, run_dir = _deployed(tmp_path)
    session = open_run(params, run_dir, stage="operator")
    d = operate.last_good(session.params, tmp_path / "outputs")
    ctx = SimpleNamespace(cluster=_Cluster(["lab-0", "lab-1"]), head=SimpleNamespace(name="lab-0"),
                          places={n: Place(n, f"sparkbook-{n}") for n in ("lab-0", "lab-1")}, runtime=_HalfReachable())
    session.context = lambda ref: ctx  # type: ignore[method-assign]
    with pytest.raises(operate.StopIncomplete) as err:
        operate.stop(session, d, keep_ray=False)
    code, text = exits.failure(err.value)
    assert code == exits.EXIT_FAILED and "\n" not in text and "stopped on lab-0" in text, text
    assert "not reached: lab-1" in text and "Connection timed out" in text and "sparkbook stop` again" in text
    [event] = read_events(run_dir, "operator_stop")
    assert event["data"]["partial"] is True and list(event["data"]["unreached"]) == ["lab-1"], event
    assert [n["node"] for n in event["data"]["nodes"]] == ["lab-0"]
    lines: list[str] = []
    w = watch.Watch(params, tmp_path / "outputs", say=lines.append)
    w.last_ok = now()  # it answered after the stop: a whole stop would no longer hold, a partial one does
    assert w.run(checks=3) == 3
    events = watchlog.read(tmp_path / "outputs" / "lab")
    assert [e.kind for e in events] == ["started", "check_failed", "paused", "ended"], lines
    assert "partly stopped by `sparkbook stop`" in events[2].text and "not reached: lab-1" in events[2].text
    assert not w.restarts.at, "nothing restarted"


# --- the run lock, judged as `run` judges it ------------------------------------------------------------
def _planted_lock(*, dead_here: bool, hours: float) -> lock.Holder:
    """A holder.json as it would stand on the head: a run of this controller whose PID is gone (`dead_here`), or
    one from another machine (its PID cannot be checked here), started `hours` ago."""
    import subprocess
    from datetime import UTC, datetime, timedelta

    gone = subprocess.Popen(["true"])
    gone.wait()
    return lock.Holder("20261101T000000Z", "controller" if dead_here else "elsewhere",
                       lock._host_id() if dead_here else "another-boot another-ns", gone.pid, 1, "ops",
                       (datetime.now(UTC) - timedelta(hours=hours)).isoformat(timespec="seconds"), "p.yaml")


def _restarting(monkeypatch: pytest.MonkeyPatch, holder: lock.Holder | None) -> list[Path]:
    """The watch's remote steps replaced: the head's lock reads `holder`, the cause is known, `up` is recorded."""
    ups: list[Path] = []

    def up(params_file: Path, outputs: Path, say: object) -> tuple[Path, SimpleNamespace, None]:
        ups.append(params_file)
        return outputs / "lab" / "20270101T000000Z", SimpleNamespace(notebooks=[]), None

    monkeypatch.setattr(watch.Watch, "_lock_holder", lambda self, session: holder)
    monkeypatch.setattr(watch, "diagnose", lambda session, d, since_s: classify({"lab-0": "Killed"}, {}))
    monkeypatch.setattr(operate, "up", up)
    return ups


def test_a_stale_lock_of_a_dead_holder_no_longer_keeps_the_deployment_dark(tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Planted: an 864-hour-old lock whose holder (a run of this controller) is gone. Before, the watch deferred to it
    at every check: 0 restarts, no give-up. Now it says the lock is stale and restarts, as `run` takes it over."""
    params, _ = _deployed(tmp_path)
    ups = _restarting(monkeypatch, _planted_lock(dead_here=True, hours=864))
    w = watch.Watch(params, tmp_path / "outputs", say=lambda line: None)
    w.run(checks=2)
    kinds = [e.kind for e in watchlog.read(tmp_path / "outputs" / "lab")]
    assert "deferred" not in kinds and ups == [params], kinds
    stale = next(e for e in watchlog.read(tmp_path / "outputs" / "lab") if e.kind == "stale_lock")
    assert "is stale (pid " in stale.text and "not running" in stale.text and "takes it over" in stale.text


def test_a_lock_stale_only_by_age_ends_the_watch_loudly_naming_unlock(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """An 864-hour-old lock from another machine: `run` refuses it (clear it deliberately), so the watch cannot
    restart through it either; it gives up with one line naming the lock and `sparkbook unlock`."""
    params, _ = _deployed(tmp_path)
    ups = _restarting(monkeypatch, _planted_lock(dead_here=False, hours=864))
    w = watch.Watch(params, tmp_path / "outputs", say=lambda line: None)
    with pytest.raises(watch.WatchGaveUp) as err:
        w.run(checks=3)
    code, text = exits.failure(err.value)
    assert code == exits.EXIT_GAVE_UP and "\n" not in text and "STALE" in text and "864.0 h old" in text, text
    assert f"sparkbook unlock {params}" in text and not ups
    assert watchlog.read(tmp_path / "outputs" / "lab")[-1].kind == "gave_up"


def test_a_live_holder_of_the_lock_is_waited_for(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    params, _ = _deployed(tmp_path)
    ups = _restarting(monkeypatch, _planted_lock(dead_here=False, hours=0.1))
    watch.Watch(params, tmp_path / "outputs", say=lambda line: None).run(checks=3)
    assert "deferred" in [e.kind for e in watchlog.read(tmp_path / "outputs" / "lab")] and not ups


# --- the restart budget on disk, one watch per cluster ------------------------------------------------------
def _with_watch(params: Path, **settings: object) -> Path:
    data = yaml.safe_load(params.read_text())
    data["watch"].update(settings)
    params.write_text(yaml.safe_dump(data))
    return params


def test_a_restarted_watch_goes_on_with_the_clusters_restart_budget(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A watch that systemd restarts (a new process: a new Watch) once started a fresh budget in memory, so a
    deployment that dies at every start was restarted for ever. The budget is on disk per cluster now: the restarted
    watch finds the window's one restart spent and gives up instead of restarting again."""
    params, _ = _deployed(tmp_path)
    _with_watch(params, max_restarts=1, restart_window_s=3600)
    ups = _restarting(monkeypatch, None)  # no run holds the lock
    first = watch.Watch(params, tmp_path / "outputs", say=lambda line: None)
    first.run(checks=2)
    assert ups == [params] and len(first.restarts.at) == 1
    budget = json.loads((tmp_path / "outputs" / "lab" / "watch-restarts.json").read_text())
    assert len(budget["restarts"]) == 1, budget
    again = watch.Watch(params, tmp_path / "outputs", say=lambda line: None)  # systemd's restart of the watch
    with pytest.raises(watch.WatchGaveUp, match="1 restart"):
        again.run(checks=2)
    assert ups == [params], "the restarted watch made no second restart in the window"


@pytest.mark.parametrize("planted", ["not json", '{"restarts": "all spent"}', "symlink"])
def test_a_restart_budget_the_watch_did_not_write_is_one_line_and_exit_2(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], planted: str) -> None:
    params, _ = _deployed(tmp_path)
    budget = tmp_path / "outputs" / "lab" / "watch-restarts.json"
    if planted == "symlink":
        (tmp_path / "elsewhere.json").write_text('{"restarts": []}')
        budget.symlink_to(tmp_path / "elsewhere.json")
    else:
        budget.write_text(planted)
    assert cli.main(["watch", str(params), "--outputs", str(tmp_path / "outputs"), "--checks", "1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"refused: {budget} is not the watch's restart budget"), err
    assert "Traceback" not in err and not watchlog.read(tmp_path / "outputs" / "lab"), "nothing was watched"


def test_a_second_watch_of_the_cluster_is_refused_naming_the_first(tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    params, run_dir = _deployed(tmp_path)
    _stop(run_dir, now())  # paused: a watch that runs touches nothing
    cluster_dir = tmp_path / "outputs" / "lab"
    with watchlock.held(cluster_dir, params, say=lambda line: None) as first:
        assert cli.main(["watch", str(params), "--outputs", str(tmp_path / "outputs"), "--checks", "1"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "refused: cluster lab is watched already by " in err, err
        assert f"pid {first.pid} on host {first.host}" in err and "watch.lock" in err
        assert not watchlog.read(cluster_dir), "the second watch recorded nothing"
    assert cli.main(["watch", str(params), "--outputs", str(tmp_path / "outputs"), "--checks", "1"]) == 0, \
        "released when the first ends"


def test_a_dead_watchs_lock_is_taken_over_saying_whose_it_was(tmp_path: Path) -> None:
    """A watch killed with SIGKILL leaves its pid in the file but not its flock: the next watch takes over."""
    cluster_dir = tmp_path / "lab"
    cluster_dir.mkdir()
    dead = _planted_lock(dead_here=True, hours=2)
    watchlock.path(cluster_dir).write_text(json.dumps(dataclasses.asdict(dead)))
    lines: list[str] = []
    with watchlock.held(cluster_dir, tmp_path / "p.yaml", say=lines.append) as me:
        assert me.pid == os.getpid()
        assert json.loads(watchlock.path(cluster_dir).read_text())["pid"] == os.getpid()
    assert lines == [f"watch lock: the last watch of cluster lab (pid {dead.pid} on host controller, since "
                     f"{dead.started}) has ended; taken over"], lines
    assert watchlock.path(cluster_dir).read_text() == "", "released: it says nobody watches"


def test_a_link_planted_as_the_watch_lock_is_refused(tmp_path: Path) -> None:
    cluster_dir = tmp_path / "lab"
    cluster_dir.mkdir()
    victim = tmp_path / "victim"
    victim.write_text("kept")
    watchlock.path(cluster_dir).symlink_to(victim)
    with pytest.raises(watchlock.WatchRunning, match="cannot open the watch lock"):
        with watchlock.held(cluster_dir, tmp_path / "p.yaml", say=lambda line: None):
            pass
    assert victim.read_text() == "kept"


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
