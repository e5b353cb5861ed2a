"""The operator's commands refuse what would act on the wrong thing, before any node is touched (issue 43): the driver's
own parameters given with -p (item 5), malformed inputs as one line and exit 2, never a traceback, and a rejected
`secrets` entry never echoed (item 9); restore, stop and up under the run lock (item 7); restore idempotent (item 7)
and systemd's escapes kept whole (item 10)."""
from __future__ import annotations

import dataclasses
import shlex
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from restoring import Launcher, local_params, restorable_run

from sparkbook import cli
from sparkbook.cli import exits
from sparkbook.core.analysis.hostfacts import Memory
from sparkbook.core.cluster.nodes import Cluster
from sparkbook.core.cluster.nodestate import lock_path
from sparkbook.core.values import seal, state
from sparkbook.core.values.handoff import Endpoint, ImageChoice
from sparkbook.core.values.params import CleanupTargets, load_params
from sparkbook.runbook import driver, lock, operate
from sparkbook.runbook.manifest import Manifest, NotebookRun
from sparkbook.stages.cleanup import act, restore
from sparkbook.stages.cleanup.inventory import Container, Inventory, Process, Unit
from sparkbook.stages.cleanup.planning import Plan, plan
from sparkbook.stages.cleanup.relaunch import Relaunch
from sparkbook.stages.cleanup.restore import Step

TOKEN = "hf_" + "Q" * 30  # token-shaped: what a careless paste puts where a name belongs
MEM = Memory(100 << 30, 50 << 30)
UNIT = "vllm@model\\x2dname.service"  # systemd's escape of `-` in an instance name


def _one_line(err: str) -> str:
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    return err


@pytest.fixture
def no_remote(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any connection to a node fails the test: these refusals come before the first one."""
    def connect(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("a node was contacted")

    monkeypatch.setattr(driver, "Cluster", connect)
    monkeypatch.setattr(lock, "acquire", connect)


@pytest.fixture
def unreachable(base: dict[str, Any], write_params: Callable[..., Path]) -> Path:
    """Params naming hosts nothing answers (TEST-NET-1)."""
    for i, node in enumerate(base["nodes"]):
        node["host"] = f"192.0.2.{i + 1}"
    return write_params(base)


@pytest.mark.parametrize("given", ["params_file=/other.yaml", "run_dir=/etc", "ab_arm=baseline"])
def test_the_drivers_own_parameters_are_refused_before_anything_is_touched(
        given: str, unreachable: Path, no_remote: None, capsys: pytest.CaptureFixture[str]) -> None:
    t0 = time.monotonic()
    assert cli.main(["run", str(unreachable), "-p", given]) == exits.EXIT_INVALID
    err = _one_line(capsys.readouterr().err)
    assert f"-p {given.split('=')[0]}: set by the driver itself" in err and time.monotonic() - t0 < 5


def test_a_notebook_parameter_is_still_passed_on(unreachable: Path, no_remote: None,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """confirm_cleanup passes the check; the run then reaches the cluster (here the fixture's refusal)."""
    with pytest.raises(AssertionError, match="a node was contacted"):
        cli.main(["run", str(unreachable), "-p", "confirm_cleanup=true"])


def test_a_binary_params_file_is_one_problem_and_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    binary = tmp_path / "params.yaml"
    binary.write_bytes(b"\x89PNG\r\n\x1a\n\xff\xfe\x00")
    for command in (["check", str(binary)], ["run", str(binary)], ["plan", str(binary)]):
        assert cli.main(command) == exits.EXIT_INVALID
        err = capsys.readouterr().err
        assert "Traceback" not in err and f"{binary}: (file): not UTF-8 text" in err, err


def test_resume_of_a_dir_that_is_no_run_dir_is_one_line(unreachable: Path, tmp_path: Path, no_remote: None,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "notes").mkdir()
    assert cli.main(["run", str(unreachable), "--resume", str(tmp_path / "notes")]) == exits.EXIT_INVALID
    assert "--resume" in (err := _one_line(capsys.readouterr().err)) and "no run dir (it holds no manifest.json)" in err
    (tmp_path / "torn").mkdir()
    seal.write(tmp_path / "torn" / "manifest.json", '{"cluster": "unit"}')  # sealed, yet no manifest
    assert cli.main(["run", str(unreachable), "--resume", str(tmp_path / "torn")]) == exits.EXIT_INVALID
    assert "manifest.json: not a manifest sparkbook reads (KeyError)" in _one_line(capsys.readouterr().err)


@pytest.mark.parametrize("text, where", [
    ("{not json", "(file): Invalid JSON"),  # JSONDecodeError
    ('{"params_file": "params.yaml"}', "steps: Field required"),  # KeyError
    ('{"params_file": "params.yaml", "steps": [{"node": "a"}]}', "steps.0.kind: Field required"),  # TypeError
    ('{"params_file": "params.yaml", "steps": 5}', "steps: Input should be a valid array"),
    ('{"params_file": "p", "steps": [{"node": "a", "kind": "vm", "name": "x", "restore": null}]}', "steps.0.kind"),
])
def test_a_malformed_restore_plan_is_one_line_and_exit_2(text: str, where: str, tmp_path: Path, no_remote: None,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    seal.write(tmp_path / "restore-plan.json", text.replace("x", f"x --hf-token {TOKEN}"))  # the runbook's, yet torn
    assert cli.main(["restore", str(tmp_path)]) == exits.EXIT_INVALID
    err = _one_line(capsys.readouterr().err)
    assert err.startswith("invalid restore plan (restore): ") and where in err and "restore.sh" in err
    assert TOKEN not in err


@pytest.mark.parametrize("entry, said", [(f"HF_TOKEN={TOKEN}", "give the variable's name (HF_TOKEN)"),
                                         (TOKEN, "looks like a token"),
                                         ("MY PASSWORD hunter2", "not an environment variable name")])
def test_a_rejected_secrets_entry_is_named_by_index_never_echoed(
        entry: str, said: str, base: dict[str, Any], write_params: Callable[..., Path],
        capsys: pytest.CaptureFixture[str]) -> None:
    base["secrets"] = ["SPARKBOOK_TEST_TOKEN", entry]
    assert cli.main(["check", str(write_params(base))]) == exits.EXIT_INVALID
    err = capsys.readouterr().err
    assert "secrets[1]" in err and said in err and "Traceback" not in err
    assert TOKEN not in err and "hunter2" not in err and entry not in err


def test_a_token_shaped_value_is_not_echoed_by_any_field_check(base: dict[str, Any], write_params: Callable[..., Path],
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    base["ray"] = {"env": {"HF_TOKEN": f"{TOKEN};"}}
    assert cli.main(["check", str(write_params(base))]) == exits.EXIT_INVALID
    err = capsys.readouterr().err
    assert "ray.env.HF_TOKEN" in err and "not shown: it looks like a token" in err and TOKEN not in err


# the run lock: restore, restore --stop-new, stop and up refuse while another holds it
@pytest.fixture
def local(base: dict[str, Any], write_params: Callable[..., Path], tmp_path: Path) -> Path:
    return local_params(base, write_params, tmp_path)


@pytest.fixture
def held_by_another(local: Path) -> Iterator[lock.Holder]:
    """The lock held by a live process of another run (`sparkbook run` in progress)."""
    params = load_params(local)
    proc = subprocess.Popen(["sleep", "300"])
    holder = dataclasses.replace(lock.me("20261204T010000Z", local), pid=proc.pid,
                                 pid_started=lock._start_ticks(proc.pid))
    cluster = Cluster(params)
    try:
        lock.acquire(params, cluster.head, holder, params_file=str(local))
        yield holder
    finally:
        cluster.close()
        proc.kill()
        proc.wait()


def _refused_naming(holder: lock.Holder, err: str) -> None:
    assert err.startswith("refused: the cluster is locked by run 20261204T010000Z") and f"pid {holder.pid}" in err


@pytest.mark.parametrize("stop_new", [[], ["--stop-new"]])
def test_restore_refuses_while_a_run_holds_the_lock(stop_new: list[str], held_by_another: lock.Holder, local: Path,
                                                    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    acted: list[str] = []
    monkeypatch.setattr(restore, "restore_deployment", lambda *a: acted.append("restore") or iter([]))
    assert cli.main(["restore", str(restorable_run(tmp_path, local)), *stop_new]) == exits.EXIT_LOCKED
    _refused_naming(held_by_another, _one_line(capsys.readouterr().err))
    assert acted == [], "nothing was restored"


def test_restore_takes_the_lock_and_releases_it(local: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    seen: list[lock.Holder | None] = []

    def restoring(ctx: Any, *args: Any) -> Iterator[restore.RestoreEvent]:
        seen.append(lock.read(ctx.cluster.head, lock_path(ctx.cluster.head)))
        yield restore.RestoreEvent("restore_outcome", restore.RestoreOutcome("restored"))

    monkeypatch.setattr(restore, "restore_deployment", restoring)
    run_dir = restorable_run(tmp_path, local)
    assert cli.main(["restore", str(run_dir)]) == 0
    assert seen[0] is not None and seen[0].run_id == f"restore-{run_dir.name}", "held while it restores"
    assert not (Path(load_params(local).head.state_dir or "/nonexistent") / "run.lock").exists(), "released after"


def _deployed(outputs: Path) -> Path:
    d = outputs / "unit" / "20261203T000000Z"
    d.mkdir(parents=True)
    Manifest("unit", d.name, "/p.yaml", {}, "t", status="ok",
             notebooks=[NotebookRun("05-serve.ipynb", "ok")]).write(d)
    state.store(d, ImageChoice(ref="example/vllm:0.17", id="sha256:1", vllm_version="0.25.0", ray_version=None,
                               nodes={}), lambda x: x)
    state.store(d, Endpoint(base_url="http://10.9.0.1:8000", model="m", executor="default", commands={"a": ["vllm"]},
                            env={}, logs={}, ready_s=1.0, attempts=1, reused=False), lambda x: x)
    return d


@pytest.mark.parametrize("command", [["stop"], ["stop", "--keep-ray"], ["up"]])
def test_stop_and_up_refuse_while_a_run_holds_the_lock(command: list[str], held_by_another: lock.Holder, local: Path,
                                                       tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    _deployed(tmp_path / "outputs")
    acted: list[str] = []
    monkeypatch.setattr(operate, "stop", lambda *a, **k: acted.append("stop") or [])
    monkeypatch.setattr(driver, "_run_notebooks", lambda *a, **k: acted.append("up"))
    assert cli.main([command[0], str(local), "--outputs", str(tmp_path / "outputs"), *command[1:]]) == exits.EXIT_LOCKED
    _refused_naming(held_by_another, _one_line(capsys.readouterr().err))
    assert acted == []


# restore is idempotent: what runs already is verified, never launched again
def test_a_second_restore_verifies_the_running_process_and_launches_only_what_is_gone() -> None:
    old, other = Relaunch("/", ["python3", "/srv/old.py"]), Relaunch("/", ["python3", "/srv/other.py"])
    steps = [Step("a", "process", "python3[40]", old.command(), launch=old),
             Step("a", "process", "python3[41]", other.command(), launch=other)]
    now = {"a": Inventory("a", [], "Docker 28", [], "systemd", [Process(90, "python3", "python3 /srv/old.py")],
                          "no GPU", [], MEM, commands={90: "python3 /srv/old.py"})}
    running = restore.already_running(steps, now)
    assert running == steps[:1], "the one relaunched by the first restore runs again: planted"
    node = Launcher("a")
    actions = restore.bring_back(SimpleNamespace(nodes={"a": node}), steps, running, {})  # type: ignore[arg-type]
    assert [(a.name, a.ok, a.detail) for a in actions] == [
        ("python3[40]", True, "already running: verified, not launched again"), ("python3[41]", True, "launched")]
    assert node.ran == [["sh", "-c", steps[1].restore]], "only the gone one was launched"


def test_a_running_unit_and_container_are_not_started_again() -> None:
    steps = [Step("a", "unit", "vllm.service", "systemctl start vllm.service"),
             Step("a", "container", "old-vllm", "docker start old-vllm")]
    now = {"a": Inventory("a", [Container("old-vllm", "c", "img", "running", [])], "Docker 28",
                          [Unit("vllm.service", "active", [])], "systemd", [], "no GPU", [], MEM)}
    assert restore.already_running(steps, now) == steps
    stopped = {"a": Inventory("a", [Container("old-vllm", "c", "img", "exited", [])], "Docker 28",
                              [Unit("vllm.service", "inactive", [])], "systemd", [], "no GPU", [], MEM)}
    assert restore.already_running(steps, stopped) == []


# a unit name is an argument, never an option
def test_a_unit_named_like_an_option_reaches_systemctl_and_journalctl_after_the_end_of_options() -> None:
    """Planted: a unit `-Hroot@host.service` matched by a glob; without `--`, systemctl reads `-H root@host.service`
    and acts on another machine."""
    planted = "-Hroot@host.service"
    head = Inventory("a", [], "Docker 28", [Unit(planted, "active", [])], "systemd", [], "no GPU", [], MEM)
    target = plan([head], CleanupTargets(systemd_units=["*Hroot@host.service"])).targets[0]
    node = Launcher("a")
    act._stop_one(node, target)  # type: ignore[arg-type]
    restore._restore_one(node, Step("a", "unit", planted, target.restore), {})  # type: ignore[arg-type]
    restore.observe(node, Step("a", "unit", planted, target.restore))  # type: ignore[arg-type]
    assert node.ran[:2] == [["systemctl", "stop", "--", planted], ["systemctl", "start", "--", planted]]
    asked = [argv for argv in node.ran[2:] if argv[0] in ("systemctl", "journalctl")]
    assert len(asked) == 3, node.ran
    for argv in asked:
        assert planted not in argv or argv[argv.index(planted) - 1] == "--", argv
        assert f"--unit={planted}" in argv or planted in argv, argv


def test_a_unit_pattern_starting_with_a_dash_is_refused_naming_the_field() -> None:
    with pytest.raises(ValueError, match="starts with '-'"):
        CleanupTargets(systemd_units=["-Hroot@host.service"])
    assert CleanupTargets(systemd_units=["vllm-*.service"]).systemd_units == ["vllm-*.service"]


# systemd's escapes keep their backslash from the plan to the node
def test_an_escaped_unit_name_reaches_systemctl_whole_on_stop_restore_and_in_restore_sh(tmp_path: Path) -> None:
    units = [Unit(UNIT, "active", [], file_state="enabled"), Unit("vllm@other.service", "active", [])]
    head = Inventory("a", [], "Docker 28", units, "systemd", [], "no GPU", [], MEM)
    by_name = {t.name: t for t in plan([head], CleanupTargets(systemd_units=["vllm@*"])).targets}
    target = by_name[UNIT]
    node = Launcher("a")
    act._stop_one(node, target)  # type: ignore[arg-type]
    restore._restore_one(node, Step("a", "unit", UNIT, target.restore), {})  # type: ignore[arg-type]
    assert node.ran == [["systemctl", "disable", "--now", "--", UNIT], ["systemctl", "enable", "--now", "--", UNIT]]
    assert by_name["vllm@other.service"].stop == "systemctl stop -- vllm@other.service", "plain names stay plain"
    # restore.sh: `ssh ... 'COMMAND'` (a local node: `sh -c 'COMMAND'`), whose COMMAND the node's shell parses again
    ctx = SimpleNamespace(cluster=SimpleNamespace(nodes={"a": node}), run_dir=tmp_path,
                          params=SimpleNamespace(runtime=SimpleNamespace(kind="python")),
                          runtime=SimpleNamespace(own_place=False))  # a Python environment: no node containers
    files = restore.restore_files(ctx, tmp_path / "p.yaml", Plan([target]))  # type: ignore[arg-type]
    line = files.script.splitlines()[-1]
    assert shlex.split(shlex.split(line)[-1]) == ["systemctl", "enable", "--now", "--", UNIT], line
    assert files.plan.steps[0].restore == target.restore
