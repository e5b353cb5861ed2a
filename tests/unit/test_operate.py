"""The operator commands' reading of the record, on the committed lab records: which run's deployment `up`,
`status`, `logs` and `stop` act on, its plan fingerprint, and the notebooks `up` runs."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from sparkbook import cli
from sparkbook.core.params import load_params
from sparkbook.runbook import driver, operate

EXAMPLES = Path(__file__).resolve().parents[2] / "outputs" / "examples"
LAB = Path(__file__).resolve().parents[2] / "params" / "lab.yaml"


def test_the_last_good_deployment_skips_a_run_whose_05_failed() -> None:
    found = operate.deployments(EXAMPLES / "lab")
    assert found and all(d.run_id != "20261201T200508Z" for d in found), "that run's new server died at 05"
    d = operate.last_good(load_params(LAB), EXAMPLES)
    assert d.run_id == "20261201T195946Z" and d.endpoint.model == "hyv4-tiny"
    assert d.image.ref == "sparkbook-lab/vllm-cpu:0.32.0" and len(d.plan_hash) == 12
    assert d.started_by() == d.run_id, "it started its own server (not reused)"


def test_the_plan_hash_follows_the_argv_and_env_names_not_values() -> None:
    d = operate.last_good(load_params(LAB), EXAMPLES)
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
    shutil.copytree(EXAMPLES / "lab" / "20261201T200508Z", tmp_path / "lab" / "20261201T200508Z")
    for command in (["status"], ["logs"], ["stop"], ["up"]):
        assert cli.main([*command, str(LAB), "--outputs", str(tmp_path)]) == 1
        err = capsys.readouterr().err
        assert "no run under" in err and "deployed a server" in err and "Traceback" not in err, err
