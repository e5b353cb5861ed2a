"""02-diagnosis on the active lab (SPARKBOOK_LAB_ID): it passes on the healthy lab (the installed image not knowing
the model is 03's to resolve), stops on a planted blocker (a worker's fabric IP not on its netdev) with the node and
the remedy, and goes on past it with proceed_despite_blockers, recorded as a decision."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

import sparkbook.lab as sblab
from sparkbook.runbook import driver
from sparkbook.runbook.driver import RunOptions
from sparkbook.runbook.manifest import NotebookRun

pytestmark = pytest.mark.lab


def run_02(params: Path, out: Path, **parameters) -> NotebookRun:
    _, manifest = driver.execute(params, RunOptions(out_root=out, only="02", parameters=parameters))
    return next(n for n in manifest.notebooks if n.name.startswith("02"))


@pytest.fixture(scope="module")
def planted(lab, tmp_path_factory) -> Path:
    """The lab's params with lab-1's fabric_netdev set to lo: its fabric IP is on eth0, not there."""
    data = yaml.safe_load(sblab.params_file(2).read_text())
    data["nodes"][1]["fabric_netdev"] = "lo"
    path = tmp_path_factory.mktemp("blocker-params") / "lab.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def test_healthy_lab_passes_02(lab, tmp_path):
    nb = run_02(sblab.params_file(2), tmp_path)
    assert nb.status == "ok", nb.exception
    assert nb.decisions == []


def test_planted_blocker_stops_02(planted, tmp_path):
    nb = run_02(planted, tmp_path)
    print(json.dumps(nb.exception, indent=1))
    assert nb.status == "failed"
    text = json.dumps(nb.exception)
    assert "Blocked" in text and "lab-1:" in text and "is not on lo" in text
    assert "put fabric_ip on fabric_netdev" in text and "proceed_despite_blockers=true" in text
    assert "does not register" not in text  # 03's to resolve, not listed as a reason to stop


def test_override_goes_on_and_is_recorded(planted, tmp_path):
    nb = run_02(planted, tmp_path, proceed_despite_blockers=True)
    assert nb.status == "ok", nb.exception
    (decision,) = nb.decisions
    print(json.dumps(decision, indent=1))
    assert decision["choice"] == "go on" and any("is not on lo" in e for e in decision["evidence"])
