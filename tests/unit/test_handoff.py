"""Typed hand-offs through state.json: each model round-trips through remember/recall; a state.json of another
schema version, a value that fails its schema and a missing value each give a clear SparkbookError."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from sparkbook import open_run
from sparkbook.core.values import seal
from sparkbook.core.values.errors import SparkbookError
from sparkbook.core.values.evidence import Finding
from sparkbook.core.values.handoff import (
    Action,
    BenchmarkSummary,
    BenchPoint,
    Diagnosis,
    Endpoint,
    ImageChoice,
    JoinedNode,
    RayCluster,
    Stopped,
)
from sparkbook.core.values.imagefacts import RegistryProbe
from sparkbook.core.values.modelinfo import ModelFacts
from sparkbook.core.values.rundir import STATE
from sparkbook.core.values.state import VERSION, VERSION_KEY, Handoff, MissingState, StateError
from sparkbook.runbook.session import Run

IMAGE_ID = "sha256:fcd98530b53b"
IMAGE = ImageChoice(ref="sparkbook-lab/vllm-cpu:0.32.0", id=IMAGE_ID, vllm_version="0.32.0+cpu", ray_version="2.60.0",
                    nodes={"lab-0": IMAGE_ID, "lab-1": IMAGE_ID})
SAMPLES: list[Handoff] = [
    Stopped(stopped=[Action("lab-0", "old-vllm", "docker stop old-vllm", True, "stopped", 2.27)],
                   restore_plan="/runs/lab/1/restore-plan.json"),
    ModelFacts(architectures=["HYV4ForCausalLM"], model_type="hy_v4", dtype="bfloat16", quantization=None,
               bytes_per_param=2.0, total_params=1192960, active_params=1168384, weight_bytes=2535878,
               weight_source="safetensors files", num_layers=2, kv_bytes_per_token=2304, kv_latent=True,
               dir_on_nodes="/srv/models/hyv4-tiny"),
    Diagnosis(findings=[Finding("fact", "gpu", "lab-0: no GPU"), Finding("blocker", "image", "does not register")],
              question_for_03="Which candidate image's vLLM registers HYV4ForCausalLM?",
              installed_image=RegistryProbe("sparkbook-lab/vllm-cpu:0.28.0", "HYV4ForCausalLM", "0.28.0+cpu", False,
                                            None, None, None, None, False, 378, 1.06)),
    Diagnosis(findings=[], question_for_03="Does the runtime's vLLM register A?", installed_image=None),
    IMAGE,
    RayCluster(address="10.77.0.10:6379", containers={"lab-0": "sb-lab-0"}, reused=False,
               container_ids={"lab-0": "c0ffee"},
               nodes=[JoinedNode(name="lab-0", ip="10.77.0.10", resources={"CPU": 2.0, "memory": 1.7e10})]),
    Endpoint(base_url="http://10.77.0.10:8000", model="hyv4-tiny", executor="mp",
             commands={"lab-0": ["vllm", "serve", "/srv/models/hyv4-tiny"]}, env={"lab-0": {"VLLM_X": "0"}},
             logs={"lab-0": "/tmp/sparkbook/logs/serve-1.log"}, ready_s=69.8, attempts=1, reused=False),
    BenchmarkSummary(single_stream_output_tok_s=28.4, single_stream_median_tpot_ms=34.7,
                     single_stream_median_ttft_ms=None, peak_output_tok_s=222.7, peak_at_concurrency=8,
                     failed_requests=0, roofline_ceiling_tok_s=8558.8, roofline_percent=0.34, bench_dir="/r/bench",
                     compared_with=None, worse_than_earlier=["c=8 output_throughput -12.0%"],
                     points=[BenchPoint(max_concurrency=1, completed=16, failed=0, output_throughput=28.4,
                                        median_ttft_ms=49.1, p99_ttft_ms=87.4, median_tpot_ms=34.7, p99_tpot_ms=None)]),
]


@pytest.fixture
def run(write_params, base, tmp_path: Path) -> Run:
    return open_run(write_params(base), tmp_path / "run", stage="test")


def write_state(run: Run, data: object) -> None:
    """A state.json as this controller's runbook sealed it (another version's, or one that fails its schema)."""
    seal.write(run.run_dir / STATE, json.dumps(data))


@pytest.mark.parametrize("value", SAMPLES, ids=[f"{type(v).__name__}-{i}" for i, v in enumerate(SAMPLES)])
def test_each_hand_off_round_trips_through_state_json(run: Run, value: Handoff) -> None:
    assert run.remember(value) is value
    back = run.recall(type(value))
    assert back == value and type(back) is type(value)
    stored = json.loads((run.run_dir / STATE).read_text())
    assert stored[VERSION_KEY] == VERSION and stored[value.key] == value.model_dump(mode="json")


def test_every_hand_off_has_its_own_key_and_the_values_live_side_by_side(run: Run) -> None:
    kinds = {type(v) for v in SAMPLES}
    assert len({k.key for k in kinds}) == len(kinds) and all(k.notebook[:2].isdigit() for k in kinds)
    for value in SAMPLES:
        run.remember(value)
    latest = {type(v): v for v in SAMPLES}  # the second Diagnosis replaced the first
    assert all(run.recall(kind) == value for kind, value in latest.items())


def test_remember_redacts_secrets(run: Run, monkeypatch: pytest.MonkeyPatch, write_params, base) -> None:
    monkeypatch.setenv("SPARKBOOK_TEST_TOKEN", "hf_s3cretvalue1234")
    run = open_run(write_params(base), run.run_dir, stage="test")
    run.remember(SAMPLES[6].model_copy(update={"env": {"lab-0": {"HF_TOKEN": "hf_s3cretvalue1234"}}}))
    assert "hf_s3cretvalue1234" not in (run.run_dir / STATE).read_text()
    assert "hf_s3cretvalue1234" not in str(run.recall(Endpoint).env)


def test_a_missing_hand_off_is_one_exception_naming_it_and_the_notebook_that_makes_it(run: Run) -> None:
    run.remember(IMAGE)
    with pytest.raises(MissingState) as caught:
        run.recall(RayCluster)
    err = caught.value
    assert isinstance(err, SparkbookError) and not isinstance(err, KeyError), "no second exception to catch"
    assert str(err) == (f"'ray' is not in {run.run_dir / STATE}: run the notebook that sets it first "
                        "(04-ray-cluster)")
    assert err.stage == "test" and "04-ray-cluster" in err.remediation


def test_nothing_stored_yet_is_a_missing_value(run: Run) -> None:
    with pytest.raises(MissingState, match="03-image-selection"):
        run.recall(ImageChoice)


@pytest.mark.parametrize("version", [None, 1, 99])
def test_a_state_json_of_another_schema_version_is_refused_clearly(run: Run, version: int | None) -> None:
    old = {"image": IMAGE.model_dump(mode="json")} | ({VERSION_KEY: version} if version is not None else {})
    write_state(run, old)
    for act in (lambda: run.recall(ImageChoice), lambda: run.remember(IMAGE)):
        with pytest.raises(StateError) as caught:
            act()
        err = caught.value
        assert not isinstance(err, MissingState), "another version is not 'not set yet': no fallback may hide it"
        text = str(err)
        assert str(run.run_dir) in text and "'image'" in text and "03-image-selection" in text
        assert ("older sparkbook" if version is None else f"schema_version {version}") in text
        assert err.remediation and "new run dir" in err.remediation
    assert json.loads((run.run_dir / STATE).read_text()) == old, "the old state is left as it was"


def test_a_value_that_fails_its_schema_names_the_key_the_field_and_the_notebook(run: Run) -> None:
    image = IMAGE.model_dump(mode="json")
    del image["ref"]
    write_state(run, {VERSION_KEY: VERSION, "image": image | {"nodes": ["lab-0"]}})
    with pytest.raises(StateError) as caught:
        run.recall(ImageChoice)
    text, err = str(caught.value), caught.value
    assert str(run.run_dir) in text and "'image'" in text and "ref: Field required" in text and "nodes:" in text
    assert "run 03-image-selection" in text and not isinstance(err, MissingState) and err.__cause__ is None


def test_a_state_json_that_is_not_json_is_refused_clearly(run: Run) -> None:
    seal.write(run.run_dir / STATE, '{"image": ')
    with pytest.raises(StateError, match="is not JSON"):
        run.recall(ImageChoice)


@pytest.mark.parametrize("tamper", ["torn", "planted", "no seal"])
def test_a_state_json_the_runbook_did_not_seal_is_refused_before_any_value_is_read(run: Run, tamper: str) -> None:
    """A state.json changed after the runbook wrote it (torn by hand, planted by a colleague), or with no seal at
    all, gives no hand-off: neither to a notebook nor to a store that would seal it anew."""
    run.remember(IMAGE)
    path = run.run_dir / STATE
    if tamper == "torn":
        path.write_text(path.read_text()[:40])
    elif tamper == "planted":
        path.write_text(path.read_text().replace(IMAGE.ref, "evil/vllm:latest"))
    else:
        seal.sig_file(path).unlink()
    for act in (lambda: run.recall(ImageChoice), lambda: run.remember(IMAGE)):
        with pytest.raises(seal.SealError) as caught:
            act()
        assert str(path) in str(caught.value) and "not sealed" in str(caught.value)
        assert caught.value.exit_kind == "invalid"
    assert seal.problem(path) is not None, "the store refused: the tampered file was not sealed anew"


def test_01_and_02_build_their_hand_offs(tmp_path: Path) -> None:
    from sparkbook.stages.cleanup import act
    from sparkbook.stages.diagnose import checks

    actions = [Action("lab-0", "a", "docker stop a", True, "stopped", 1.0),
               Action("lab-1", "b", "docker stop b", False, "NotFound", 0.1)]
    out = act.outcome(actions, tmp_path / "restore-plan.json")
    assert out.stopped == actions[:1] and out.restore_plan == str(tmp_path / "restore-plan.json")
    probe = SAMPLES[2].installed_image
    d = checks.diagnosis([Finding("fact", "gpu", "x")], probe, "HYV4ForCausalLM", {})
    assert d.installed_image == probe and d.question_for_03 == checks.question_for_03(probe, "HYV4ForCausalLM")


NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"


@pytest.mark.parametrize("notebook", sorted(p.name for p in NOTEBOOKS.glob("*.ipynb")))
def test_a_notebook_falls_back_on_a_missing_hand_off_by_missing_state_alone(notebook: str) -> None:
    cells = json.loads((NOTEBOOKS / notebook).read_text())["cells"]
    source = "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")
    assert "except KeyError" not in source
    if "except " in source and "run.recall(" in source:
        assert "except MissingState" in source
