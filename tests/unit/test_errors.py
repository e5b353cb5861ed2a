"""One exception root: every exception class of the package is a SparkbookError, and `cli.main` maps each exit kind
to its exit code and one line on stderr, without a traceback."""
from __future__ import annotations

import dataclasses
import importlib
import inspect
import pkgutil
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import sparkbook
from sparkbook import api, cli
from sparkbook.cli import exits
from sparkbook.core.cluster.nodes import Cluster, Unreachable
from sparkbook.core.values.errors import SparkbookError
from sparkbook.core.values.params import load_params
from sparkbook.core.values.state import MissingState
from sparkbook.runbook import lock


def package_exceptions() -> list[type[BaseException]]:
    """Every exception class defined in sparkbook, but the lab (its own root, turned into one by the cli)."""
    found = []
    for info in pkgutil.walk_packages(sparkbook.__path__, "sparkbook."):
        if info.name.startswith("sparkbook.lab"):
            continue
        module = importlib.import_module(info.name)
        found += [c for _, c in inspect.getmembers(module, inspect.isclass)
                  if issubclass(c, BaseException) and c.__module__ == info.name]
    return found


def test_every_exception_class_of_the_package_is_a_sparkbook_error() -> None:
    classes = package_exceptions()
    assert {"NodeError", "ParamsError", "LockHeld", "GateFailed", "ServeError", "ServerGone"} <= \
        {c.__name__ for c in classes}
    assert [c.__qualname__ for c in classes if not issubclass(c, SparkbookError)] == []


def test_remediation_is_a_field_and_ends_the_message() -> None:
    exc = Unreachable("lab-1", "cannot reach root@10.0.0.2:22", remediation="start its sshd")
    assert str(exc) == "lab-1: cannot reach root@10.0.0.2:22: start its sshd"
    assert (exc.node, exc.reason, exc.remediation, exc.stage) == ("lab-1", "cannot reach root@10.0.0.2:22",
                                                                   "start its sshd", None)
    with pytest.raises(MissingState) as caught:
        raise MissingState("'image' is not in state.json", remediation="run 03 first")
    assert str(caught.value) == "'image' is not in state.json: run 03 first"


def main(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    code = cli.main(argv)
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return code, err


def test_invalid_params_exit_2_naming_every_problem(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("- not\n- a mapping\n")
    assert main(["check", str(bad)], capsys) == (
        exits.EXIT_INVALID, f"invalid params (1 problem(s)):\n  {bad}:1: (file): expected a mapping of settings at "
                          "the top level\n")
    code, err = main(["run", str(tmp_path / "missing.yaml"), "--outputs", str(tmp_path / "o")], capsys)
    assert code == exits.EXIT_INVALID and "missing.yaml: (file): file not found" in err
    assert not (tmp_path / "o").exists()


def test_invalid_run_request_exit_2_in_one_line(base: dict[str, Any], write_params: Callable[..., Path],
                                                tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, err = main(["run", str(write_params(base)), "-p", "confirm_cleanpu=true", "--outputs",
                      str(tmp_path / "o")], capsys)
    assert code == exits.EXIT_INVALID and err.startswith("error: unknown parameter(s) ['confirm_cleanpu']")
    assert err.count("\n") == 1
    code, err = main(["restore", str(tmp_path / "no-run")], capsys)
    assert (code, err) == (exits.EXIT_INVALID,
                           f"error: {tmp_path / 'no-run' / 'restore-plan.json'} not found: 01-cleanup "
                           "writes it after it stops something\n")


def test_a_held_lock_exits_3_with_its_remediation(base: dict[str, Any], write_params: Callable[..., Path],
                                                  tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for node in base["nodes"]:
        node["transport"] = "local"
    for node in base["nodes"]:  # the run lock, in the head's state dir: this test's own
        node["state_dir"] = str(tmp_path / "state" / node["name"])
    params_file = write_params(base)
    params = load_params(params_file)
    cluster = Cluster(params)
    sleeper = subprocess.Popen(["sleep", "300"])
    try:
        lock.acquire(params, cluster.head, dataclasses.replace(lock.me("run-a", str(params_file)), pid=sleeper.pid,
                                                               pid_started=lock._start_ticks(sleeper.pid)),
                     params_file=str(params_file))
        code, err = main(["unlock", str(params_file)], capsys)
    finally:
        sleeper.kill()
        sleeper.wait()
        cluster.close()
    assert code == exits.EXIT_LOCKED and err.startswith("refused: ") and err.count("\n") == 1
    assert err.endswith(f"still running on this host: stop it first (kill {sleeper.pid}), or pass --force\n")


@pytest.mark.parametrize("raised, code, line", [
    (Unreachable("b", "cannot reach root@127.0.0.1:22 within 10 s: timed out"), exits.EXIT_NODE,
     "node unusable: b: cannot reach root@127.0.0.1:22 within 10 s: timed out"),
    (SparkbookError("no node has the model's config.json", stage="02-diagnosis", remediation="set model.path"),
     exits.EXIT_FAILED, "error (02-diagnosis): no node has the model's config.json: set model.path"),
    (KeyboardInterrupt(), exits.EXIT_INTERRUPTED, "interrupted"),
])
def test_each_other_kind_has_its_exit_code_and_one_line(raised: BaseException, code: int, line: str, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    def fail(args: object) -> int:
        raise raised

    monkeypatch.setattr(api, "check", fail)
    assert main(["check", str(tmp_path / "any.yaml")], capsys) == (code, line + "\n")
