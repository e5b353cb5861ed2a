"""Issue 43, item 3 (the restore plan): an old process whose command line carried a secret is recorded with that
secret's variable NAME, never its value; `sparkbook restore` reads the value from the controller's environment
(refusing, one line and exit 2, where it is not set), finds the process by the rest of its command line, and skips,
saying why, one whose secret sparkbook does not know instead of relaunching `[REDACTED]`."""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from restoring import Launcher, kept, local_params, restorable_run

from sparkbook import cli
from sparkbook.cli import exits
from sparkbook.core.analysis.hostfacts import Memory
from sparkbook.core.cluster.context import Context
from sparkbook.core.cluster.nodes import Cluster
from sparkbook.core.cluster.runtimes import runtime_for
from sparkbook.core.values.params import CleanupTargets, Params, load_params
from sparkbook.core.values.redact import Redactor
from sparkbook.stages.cleanup import restore
from sparkbook.stages.cleanup.inventory import Inventory, Process
from sparkbook.stages.cleanup.planning import plan
from sparkbook.stages.cleanup.relaunch import SecretRef
from sparkbook.stages.cleanup.restore import Seen, judge, restore_files

TOKEN = "hf_abcdefghijklmnopqrstuvwxyz"
UNKNOWN = "sk-abcdefghijklmnopqrstuvwxyz0123"
MEM = Memory(100 << 30, 50 << 30)
# the planted old process: a python that writes the argv it was launched with into its working directory
DUMP = "import json, sys; open('argv.json', 'w').write(json.dumps(sys.argv[1:]))"
TARGETS = CleanupTargets(processes=["python*"])


def old_process(pid: int, *flags: str, cwd: str = "/srv") -> Process:
    argv = [sys.executable, "-c", DUMP, "serve", "/models/x", *flags, "--port", "8000"]
    return Process(pid, "python3", " ".join(argv), [pid], cwd, argv, (0, 0, []))


def node_a(*processes: Process) -> Inventory:
    """Node a as 01's inventory sees it, reached as root (uid 0)."""
    return Inventory("a", [], "Docker 28", [], "systemd", list(processes), "no GPU", [], MEM,
                     commands={p.pid: p.args for p in processes}, session_uid=0)


@pytest.fixture
def local(base: dict[str, Any], write_params: Callable[..., Path], tmp_path: Path,
          monkeypatch: pytest.MonkeyPatch) -> Path:
    """Params of a cluster on this machine naming HF_TOKEN under `secrets`, which the environment holds."""
    base["secrets"] = ["HF_TOKEN"]
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    return local_params(base, write_params, tmp_path)


def written(params_file: Path, run_dir: Path, *processes: Process) -> tuple[Params, list[restore.Step]]:
    """01's restore plan of these processes on node a, which the run dir's scrub leaves as it is."""
    params = load_params(params_file)
    cluster = Cluster(params)
    ctx = Context(params, cluster, runtime_for(params), run_dir)
    files = restore_files(ctx, Path("params.yaml"), plan([node_a(*processes)], TARGETS, params.secret_values()))
    scrub = Redactor.from_env(params.secrets)
    for name, text in files.files().items():
        assert scrub.text(text) == text, f"the run dir's scrub would change {name}"
    return params, kept(files, params, run_dir)


def test_the_plan_and_restore_sh_hold_the_secrets_name_never_its_value(local: Path, tmp_path: Path) -> None:
    _, (step,) = written(local, tmp_path, old_process(40, "--hf-token", TOKEN))
    plan_text, script = (tmp_path / "restore-plan.json").read_text(), (tmp_path / "restore.sh").read_text()
    assert TOKEN not in plan_text + script and "[REDACTED]" not in plan_text + script
    (recorded,) = json.loads(plan_text)["steps"]
    assert recorded["launch"]["argv"][4:8] == ["/models/x", "--hf-token", {"template": "${HF_TOKEN}"}, "--port"]
    assert recorded["cannot_restore"] is None
    assert '--hf-token "${HF_TOKEN}" --port 8000' in step.restore  # type: ignore[operator]
    assert '[ -n "${HF_TOKEN-}" ] || {' in script, "restore.sh stops before acting where it is not exported"
    assert """printf '%s\\n' "$HF_TOKEN" | sh -c 'IFS= read -r HF_TOKEN && cd /srv && """ in script


def test_restore_launches_the_old_argv_with_the_value_from_the_environment(local: Path, tmp_path: Path) -> None:
    params, steps = written(local, tmp_path, old_process(40, "--hf-token", TOKEN, cwd=str(tmp_path)))
    node = Launcher("a")
    secrets = restore.secret_values(steps, params.secrets, params.secret_values())
    (action,) = restore.bring_back(SimpleNamespace(nodes={"a": node}), steps, [], secrets)  # type: ignore[arg-type]
    assert action.ok and TOKEN not in action.command
    (command,), (fed,) = node.ran, node.stdin
    assert TOKEN not in " ".join(command) and fed == f"{TOKEN}\n".encode(), "the value goes on stdin"
    # what the node's shell launches from that command, fed that stdin, in an environment without HF_TOKEN
    env = {k: v for k, v in os.environ.items() if k != "HF_TOKEN"}
    subprocess.run(command, input=fed, env=env, check=True, timeout=10)
    argv_file = tmp_path / "argv.json"
    deadline = time.monotonic() + 10
    while not argv_file.is_file() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert json.loads(argv_file.read_text()) == ["serve", "/models/x", "--hf-token", TOKEN, "--port", "8000"]


def test_the_process_is_found_again_by_its_command_line_whatever_the_secrets_value(local: Path,
                                                                                    tmp_path: Path) -> None:
    _, steps = written(local, tmp_path, old_process(40, "--hf-token", TOKEN))
    for running, value in ((True, TOKEN), (True, "hf_another_value_of_the_token"), (False, None)):
        again = old_process(90, "--hf-token", value) if value else old_process(90, "--hf-token")
        assert restore.already_running(steps, {"a": node_a(again)}) == (steps if running else [])
        ps = SimpleNamespace(name="a", run=lambda argv, timeout=0, line=again.args: SimpleNamespace(
            stdout=f"  90 2048 {line}\n"))
        assert restore.observe(ps, steps[0]).running is running  # type: ignore[arg-type]


def test_restore_refuses_in_one_line_naming_the_variable_where_it_is_not_set(
        local: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    run_dir = restorable_run(tmp_path, local)
    written(local, run_dir, old_process(40, "--hf-token", TOKEN))
    monkeypatch.delenv("HF_TOKEN")
    acted: list[str] = []
    monkeypatch.setattr(restore, "_inventories", lambda cluster, targets: {"a": node_a(), "b": node_a()})
    monkeypatch.setattr(restore, "bring_back", lambda *a: acted.append("restore") or [])
    assert cli.main(["restore", str(run_dir)]) == exits.EXIT_INVALID
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("refused (restore): nothing was restored: a/python3[40] needs HF_TOKEN, which is not set")
    assert "export each variable" in line and acted == []


def test_a_secret_sparkbook_does_not_know_is_a_warning_and_restore_skips_its_target(
        local: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    unknown = old_process(41, "--api-key", UNKNOWN)
    why = "its command line carried a secret sparkbook does not know (argv[6]); add its variable to params.secrets"
    p = plan([node_a(unknown)], TARGETS, load_params(local).secret_values())
    assert p.targets[0].restore is None and p.rows()[0]["restore"].startswith(f"(none: {why}")  # type: ignore[union-attr]
    assert p.warnings == [f"a/python3[41] cannot be restored: {p.targets[0].cannot_restore}"]
    run_dir = restorable_run(tmp_path, local)
    _, (step,) = written(local, run_dir, unknown)
    assert step.cannot_restore is not None and step.cannot_restore.startswith(why)
    assert f"# a python3[41]: {why}" in (run_dir / "restore.sh").read_text()
    launched: list[str] = []
    monkeypatch.setattr(restore, "_inventories", lambda cluster, targets: {"a": node_a(), "b": node_a()})
    monkeypatch.setattr(restore, "_restore_one", lambda *a: launched.append("launch") or "launched")
    monkeypatch.setattr(restore, "verify_restore", lambda cluster, steps: [
        judge(s, Seen("not running", False, None, "", 0.0)) for s in steps])
    assert cli.main(["restore", str(run_dir)]) == exits.EXIT_FAILED
    out = capsys.readouterr().out
    assert f"FAILED  -  skipped: {why}" in out and f"not restored: {why}" in out and launched == []


# issue 56, deliver 3: a secret inside an argv element, the files' mode, verification, and the plan's own record
PASSWORD = "pa55-w0rd-of-the-proxy"


@pytest.fixture
def two_secrets(base: dict[str, Any], write_params: Callable[..., Path], tmp_path: Path,
                monkeypatch: pytest.MonkeyPatch) -> Path:
    base["secrets"] = ["HF_TOKEN", "PROXY_PASSWORD"]
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    monkeypatch.setenv("PROXY_PASSWORD", PASSWORD)
    return local_params(base, write_params, tmp_path)


def test_a_secret_inside_an_argv_element_is_its_variable_in_the_plan_and_the_value_again_at_relaunch(
        two_secrets: Path, tmp_path: Path) -> None:
    url = f"http://u:{PASSWORD}@proxy:3128/$HOME"  # a `$` of its own, which must stay a `$`
    params, (step,) = written(two_secrets, tmp_path, old_process(40, "--proxy", url, f"--hf-token={TOKEN}",
                                                                  cwd=str(tmp_path)))
    plan_text, script = (tmp_path / "restore-plan.json").read_text(), (tmp_path / "restore.sh").read_text()
    assert PASSWORD not in plan_text + script and TOKEN not in plan_text + script
    assert "[REDACTED]" not in plan_text + script, "the scrub found nothing to mask: a relaunch would be faithful"
    argv = json.loads(plan_text)["steps"][0]["launch"]["argv"]
    assert {"template": "http://u:${PROXY_PASSWORD}@proxy:3128/$$HOME"} in argv
    assert {"template": "--hf-token=${HF_TOKEN}"} in argv
    for name in ("restore-plan.json", "restore.sh"):
        assert (tmp_path / name).stat().st_mode & 0o777 == 0o600, f"{name} holds command lines: the owner's alone"
    node = Launcher("a")
    secrets = restore.secret_values(steps := [step], params.secrets, params.secret_values())
    restore.bring_back(SimpleNamespace(nodes={"a": node}), steps, [], secrets)  # type: ignore[arg-type]
    (command,), (fed,) = node.ran, node.stdin
    env = {k: v for k, v in os.environ.items() if k not in ("HF_TOKEN", "PROXY_PASSWORD")}
    subprocess.run(command, input=fed, env=env, check=True, timeout=10)
    argv_file = tmp_path / "argv.json"
    deadline = time.monotonic() + 10
    while not argv_file.is_file() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert json.loads(argv_file.read_text()) == ["serve", "/models/x", "--proxy", url, f"--hf-token={TOKEN}",
                                                 "--port", "8000"]


def test_an_argv_made_only_of_a_secret_reference_identifies_no_process() -> None:
    planted = restore.Step("a", "process", "x[1]", None, launch=restore.Relaunch("/", [SecretRef("${HF_TOKEN}")]))
    anything = node_a(Process(1, "systemd", "/sbin/init"), Process(7, "sshd", "sshd: /usr/sbin/sshd -D"))
    assert restore.already_running([planted], {"a": anything}) == []
    assert not restore.Relaunch("/", []).identifies("") and not restore.Relaunch("/", [""]).identifies("")
    ps = SimpleNamespace(name="a", run=lambda argv, timeout=0: SimpleNamespace(stdout="  1 100 /sbin/init\n"))
    assert restore.observe(ps, planted).running is False  # type: ignore[arg-type]


def test_restore_runs_the_relaunch_its_launch_record_makes_never_a_planted_restore_string(
        local: Path, tmp_path: Path) -> None:
    _, (step,) = written(local, tmp_path, old_process(40, "--hf-token", TOKEN))
    planted = dataclasses.replace(step, restore="touch /tmp/owned-by-the-plan")
    node = Launcher("a")
    (action,) = restore.bring_back(SimpleNamespace(nodes={"a": node}), [planted], [],  # type: ignore[arg-type]
                                   {"HF_TOKEN": TOKEN})
    assert action.ok and node.ran == [["sh", "-c", step.launch.command()]]  # type: ignore[union-attr]
    assert "owned-by-the-plan" not in action.command + " ".join(node.ran[0])


def test_restore_finds_a_relaunched_process_the_params_no_longer_allow_list(local: Path, tmp_path: Path) -> None:
    """Idempotent by the plan's own record: the inventory's allow-list (cleanup.processes) may have changed since
    01; the process 01 stopped, running again, is found among all the node's processes."""
    _, steps = written(local, tmp_path, old_process(40, "--hf-token", TOKEN))
    again = old_process(90, "--hf-token", TOKEN)
    not_allow_listed = Inventory("a", [], "Docker 28", [], "systemd", [], "no GPU", [], MEM,
                                 commands={1: "/sbin/init", 90: again.args})
    assert restore.already_running(steps, {"a": not_allow_listed}) == steps
    node = Launcher("a")
    (action,) = restore.bring_back(SimpleNamespace(nodes={"a": node}), steps,  # type: ignore[arg-type]
                                   restore.already_running(steps, {"a": not_allow_listed}), {})
    assert action.detail == "already running: verified, not launched again" and node.ran == []
