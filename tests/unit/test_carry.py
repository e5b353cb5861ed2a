"""`--from NN` in a new run (issue 40, item 3): each hand-off the notebooks read and none writes first comes from the
cluster's newest run that recorded it; one a notebook needs and no run has refuses the run, naming the hand-off and
the notebook that makes it; one it falls back without is only said to be missing."""
from __future__ import annotations

from pathlib import Path

import pytest

from sparkbook.core.values import state
from sparkbook.core.values.handoff import Endpoint, ImageChoice, RayCluster
from sparkbook.core.values.rundir import MANIFEST
from sparkbook.runbook.carry import NothingToCarry, carry, wanted


def _run(cluster: Path, run_id: str, *values) -> Path:
    d = cluster / run_id
    d.mkdir(parents=True)
    (d / MANIFEST).write_text("{}")
    for v in values:
        state.store(d, v, lambda x: x)
    return d


def _image(ref: str) -> ImageChoice:
    return ImageChoice(ref=ref, id="sha256:1", vllm_version="0.32.0", ray_version="2.60", nodes={})


RAY = RayCluster(address="10.0.0.1:6379", containers={"a": "c"}, reused=False, container_ids={}, nodes=[])


def test_each_hand_off_comes_from_the_newest_run_that_recorded_it(tmp_path: Path) -> None:
    _run(tmp_path, "20261201T000000Z", _image("old:1"), RAY)
    _run(tmp_path, "20261202T000000Z", _image("new:1"))  # newer, but without a RayCluster
    _run(tmp_path, "20261203T000000Z")  # newest, recorded nothing
    got = carry(tmp_path, ["04-ray-cluster.ipynb"])
    assert [(type(v).__name__, run) for v, run in got.values] == [("ImageChoice", "20261202T000000Z")]
    assert got.values[0][0].ref == "new:1"
    assert wanted(["04-ray-cluster.ipynb", "05-serve.ipynb"])[0][0] == "ImageChoice"
    assert "RayCluster" not in [w for w, _ in wanted(["04-ray-cluster.ipynb", "05-serve.ipynb"])], "04 writes it"


def test_a_needed_hand_off_no_run_recorded_refuses_naming_it_and_its_notebook(tmp_path: Path) -> None:
    _run(tmp_path, "20261201T000000Z", _image("img:1"), RAY)
    with pytest.raises(NothingToCarry, match="05-serve needs ModelFacts") as err:
        carry(tmp_path, ["05-serve.ipynb", "06-benchmark.ipynb"])
    assert "02-diagnosis" in str(err.value)


def test_one_a_notebook_falls_back_without_is_listed_as_missing(tmp_path: Path) -> None:
    _run(tmp_path, "20261201T000000Z", Endpoint(base_url="http://h:8000", model="m", executor="mp", commands={},
                                                 env={}, logs={}, ready_s=1.0, attempts=1, reused=False))
    got = carry(tmp_path, ["03-image-selection.ipynb"])
    assert got.values == [] and got.missing == ["ModelFacts", "Diagnosis"]
    assert got.lines() == ["ModelFacts: no run recorded it; its notebook goes on without it",
                           "Diagnosis: no run recorded it; its notebook goes on without it"]
    assert carry(tmp_path / "no-such-cluster", ["03-image-selection.ipynb"]).missing == ["ModelFacts", "Diagnosis"]
