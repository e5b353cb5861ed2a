"""sparkbook.api without the command line (issue 54): `plan` and `status` return typed values and write nothing to
stdout or stderr, on params of a cluster on this machine (local transport; nothing is started)."""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from restoring import local_params

from sparkbook import api
from sparkbook.core.values import state
from sparkbook.core.values.handoff import Endpoint, ImageChoice
from sparkbook.core.values.stagelist import STAGES
from sparkbook.runbook.manifest import Manifest, NotebookRun


@pytest.fixture
def local(base: dict[str, Any], write_params: Callable[..., Path], tmp_path: Path) -> Path:
    return local_params(base, write_params, tmp_path)


def _deployed(outputs: Path) -> Path:
    """A run of cluster `unit` whose 05 ended ok, its endpoint where nothing listens."""
    run_dir = outputs / "unit" / "20261203T000000Z"
    run_dir.mkdir(parents=True)
    Manifest("unit", run_dir.name, "/p.yaml", {}, "t", status="ok",
             notebooks=[NotebookRun("05-serve.ipynb", "ok")]).write(run_dir)
    state.store(run_dir, ImageChoice(ref="example/vllm:0.17", id="sha256:1", vllm_version="0.25.0", ray_version=None,
                                     nodes={}), lambda x: x)
    state.store(run_dir, Endpoint(base_url="http://127.0.0.1:9/v1", model="m", executor="mp",
                                  commands={"a": ["vllm", "serve"]}, env={}, logs={}, ready_s=1.0, attempts=1,
                                  reused=False), lambda x: x)
    return run_dir


def test_plan_returns_every_stage_and_prints_nothing(local: Path, tmp_path: Path,
                                                              capfd: pytest.CaptureFixture[str]) -> None:
    planned = api.plan(local, tmp_path / "outputs")
    assert capfd.readouterr() == ("", ""), "the api prints nothing; the command line renders"
    assert isinstance(planned, api.PlanResult)
    assert [p.stage for p in planned.stages] == list(STAGES)
    cleanup, diagnosis = planned.stages[:2]
    assert cleanup.why is None and cleanup.shown[0].title.startswith("Cleanup plan"), "01 reads this machine"
    assert diagnosis.failed is not None and "is not in /srv/models" in diagnosis.failed, "02 says what it lacks"
    assert planned.stages[3].unknown is not None and "03-image-selection" in planned.stages[3].unknown, \
        "what only 03 makes is not known, and says so"
    assert not planned.showed_what_it_could, "a preview failed (02): the plan exits 1"
    assert not (tmp_path / "outputs").exists(), "a plan writes nothing"


def test_status_returns_each_node_and_the_endpoint_and_prints_nothing(local: Path, tmp_path: Path,
                                                                      capfd: pytest.CaptureFixture[str]) -> None:
    run_dir = _deployed(tmp_path / "outputs")
    st = api.status(local, tmp_path / "outputs")
    assert capfd.readouterr() == ("", ""), "the api prints nothing; the command line renders"
    assert isinstance(st, api.Status) and st.deployment.run_dir == run_dir
    assert [n.node for n in st.nodes] == ["a", "b"]
    assert st.health is not None and not st.serving, "nothing listens where the endpoint was"


def test_status_with_nothing_deployed_raises_the_root_with_its_kind(local: Path, tmp_path: Path,
                                                                    capfd: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(api.NothingDeployed) as caught:
        api.status(local, tmp_path / "outputs")
    assert isinstance(caught.value, api.SparkbookError) and caught.value.exit_kind == "failed"
    assert caught.value.remediation and "sparkbook run" in caught.value.remediation
    assert capfd.readouterr() == ("", "")
