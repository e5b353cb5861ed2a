"""benchmark.ab: image (issue 57 items 1-2): what the params need, the baseline 03 names (or why none), the verdict
that reads answers and speed, and the driver running 04 to 06 in each arm with each arm's image, skipping the
baseline arm where there is no baseline, and `up` serving the image the A/B kept."""
from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from stubnotebooks import write_notebook
from test_images import candidate

from sparkbook.core.cluster.context import Context
from sparkbook.core.values.handoff import AbAnswers, AbRatio, ImageChoice
from sparkbook.core.values.params import ParamsError, load_params
from sparkbook.runbook import arms, driver
from sparkbook.runbook.driver import RunOptions
from sparkbook.stages.bench import ab
from sparkbook.stages.images import abbase
from sparkbook.stages.images.choice import LOADS, NOT_REGISTERED

IMAGES = ("vllm:0.32.0", "vllm:0.34.0")


def _problems(write_params: Callable[..., Path], base: dict[str, Any]) -> dict[str, str]:
    with pytest.raises(ParamsError) as exc:
        load_params(write_params(base))
    return {p.field: p.message for p in exc.value.problems}


def test_the_image_ab_needs_the_answer_check_and_repeats(write_params, base):
    base["benchmark"] = {"ab": "image", "repeats": 2}
    base["serve"]["quality"] = {"enabled": False}
    assert "set serve.quality.enabled: true" in _problems(write_params, base)["benchmark.ab"]
    base["benchmark"]["repeats"], base["serve"]["quality"] = 1, {"enabled": True}
    assert "set benchmark.repeats: 2 or more" in _problems(write_params, base)["benchmark.ab"]
    base["benchmark"]["repeats"] = 2
    params = load_params(write_params(base))
    assert params.ab_baseline() is params, "the same plan: only the image differs, and 03 names it"
    assert ab.contest(params).second == "candidate" and ab.contest(params).decide_highest


def _row(ratio: float, verdict: str, noise: float | None = 4.0) -> AbRatio:
    return AbRatio(max_concurrency=4, baseline_tok_s=100.0, second_tok_s=100.0 * ratio, ratio=ratio,
                   noise_pct=noise, verdict=verdict)


def _verdict(row: AbRatio, base: float | None, cand: float | None, floor: float = 0.9):
    contest = ab.Contest("image", "candidate", ("baseline image", "03's choice"), ("now", "choice"), "03's choice",
                         "", "until the params change", "Which image?", decide_highest=True)
    answers = AbAnswers(agreement={"baseline": base, "candidate": cand})
    return ab.image_verdict([row], None, contest, answers, floor, IMAGES)


def test_a_new_image_within_the_noise_that_answers_as_well_stays():
    v = _verdict(_row(0.98, "within noise"), 1.0, 0.97)
    assert v.kept == "candidate" and v.agreement == {"baseline": 1.0, "candidate": 0.97}
    assert "vllm:0.34.0 gives 98.0 against 100.0 output tok/s of vllm:0.32.0 = 0.98x, noise band ±4.0 %" in v.reason
    assert "answers agree 97% against the baseline's 100% (needed: 90%)" in v.reason and "upgrade stays" in v.reason


@pytest.mark.parametrize(("row", "cand", "why"), [
    (_row(0.5, "worse"), 1.0, "slower beyond the noise"),
    (_row(1.02, "within noise"), 0.5, "answers agree less than the baseline's"),
    (_row(1.3, "better"), None, "answers agree less than the baseline's"),
    (_row(1.0, "no noise estimate", None), 1.0, "not shown to be as fast"),
])
def test_a_slower_or_differently_answering_image_gives_way_to_the_baseline(row, cand, why):
    v = _verdict(row, 1.0, cand)
    assert v.kept == "baseline" and why in v.reason and "serves the baseline image again" in v.reason


def test_a_baseline_below_the_floor_sets_the_bar_no_higher_than_itself():
    assert _verdict(_row(1.0, "within noise"), 0.8, 0.85).kept == "candidate"
    assert _verdict(_row(1.0, "within noise"), 0.8, 0.75).kept == "baseline"


def _choice(ref: str, image_id: str) -> ImageChoice:
    return ImageChoice(ref=ref, id=image_id, vllm_version="0.34.0", ray_version=None, nodes={})


def _no_probe(ref: str) -> abbase.Evaluated:
    raise AssertionError(f"{ref} is among the candidates: no probe of its own")


@pytest.mark.parametrize(("serving", "installed", "candidates", "why"), [
    (None, None, [], "nothing serves on this cluster yet and there is no runtime.installed_image"),
    (None, "vllm:0.34.0", [candidate("vllm:0.34.0", "0.34.0", LOADS)], "is the image that runtime.installed_image"),
    (None, "vllm:0.32.0", [candidate("vllm:0.32.0", "0.32.0", NOT_REGISTERED)], "does not load the model"),
    (_choice("vllm:0.32.0", "sha256:" + "9" * 64), None, [candidate("vllm:0.32.0", "0.32.0", LOADS)],
     "vllm:0.32.0 now names sha256:000000000000, not the sha256:999999999999 that served"),
])
def test_no_baseline_means_no_ab_and_the_decision_says_why(lab, tmp_path, serving, installed, candidates, why):
    ctx = Context(lab, None, None, tmp_path)  # type: ignore[arg-type]  # none of these cases reaches a node
    chosen = _choice("vllm:0.34.0", "sha256:" + "0" * 64)
    out = abbase.baseline(ctx, chosen, serving, installed, candidates, _no_probe)
    assert out.handoff.image is None and why in out.handoff.reason, out.handoff.reason
    assert out.decision.choice == "none" and "vllm:0.34.0 serves as without benchmark.ab" in out.decision.reason


# --- the driver: 04 to 06 in each arm, each with its image ----------------------------------------------------------
PARAMETERS = ('params_file = ""\nrun_dir = ""\nab_arm = None\nkeep = "candidate"\n'
              'baseline = "vllm:0.32.0"')


@pytest.fixture
def image_notebooks(tmp_path: Path) -> Path:
    """03 that chooses vllm:0.34.0 and names `baseline` (or none); 04 and 05 that note the image their arm's context
    hands them; 06 whose A/B keeps `keep`."""
    folder = tmp_path / "notebooks"
    folder.mkdir()
    opened = ('import json, sparkbook\nfrom sparkbook.core.values.handoff import AbBaseline, AbVerdict, ImageChoice\n'
              'run = sparkbook.open_run(params_file, run_dir, stage="{stage}", ab_arm=ab_arm)\n')
    note = ('with (run.run_dir / "images.jsonl").open("a") as fh:\n'
            '    fh.write(json.dumps([run.stage, ab_arm, run.context().handoffs.need(ImageChoice).ref]) + "\\n")\n')
    chosen = 'ImageChoice(ref={ref!r}, id="sha256:{n}", vllm_version="{v}", ray_version=None, nodes={{}})'
    write_notebook(folder, "03-images.ipynb", PARAMETERS, opened.format(stage="03-images") + (
        f'run.remember({chosen.format(ref="vllm:0.34.0", n="4" * 64, v="0.34.0")})\n'
        f'image = {chosen.format(ref="vllm:0.32.0", n="2" * 64, v="0.32.0")} if baseline else None\n'
        'run.remember(AbBaseline(image=image, reason="planted" if baseline else "no A/B of images: planted"))\n'))
    write_notebook(folder, "04-ray.ipynb", PARAMETERS, opened.format(stage="04-ray") + note)
    write_notebook(folder, "05-serve.ipynb", PARAMETERS, opened.format(stage="05-serve") + note)
    write_notebook(folder, "06-benchmark.ipynb", PARAMETERS, opened.format(stage="06-benchmark") + (
        'if ab_arm not in (None, "baseline"):\n'
        '    run.remember(AbVerdict(ab="image", kept=keep, reason="planted", decided_at=1, crossing=None, '
        'ratios=[]))\n'))
    return folder


@pytest.fixture
def image_params(base: dict[str, Any], write_params: Callable[..., Path], tmp_path: Path) -> Path:
    for node in base["nodes"]:
        node["transport"] = "local"
        node["state_dir"] = str(tmp_path / "state" / node["name"])  # the run lock, in the head's state dir
    base["benchmark"] = {"ab": "image", "repeats": 2}
    return write_params(base)


def _images(run_dir: Path) -> list[list[str | None]]:
    return [json.loads(line) for line in (run_dir / "images.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("keep", ["candidate", "baseline"])
def test_each_arm_runs_04_to_06_with_its_image_and_the_kept_image_stays(image_notebooks, image_params, tmp_path,
                                                                         keep):
    said: list[str] = []
    run_dir, manifest = driver.execute(image_params, RunOptions(out_root=tmp_path / "out", folder=image_notebooks,
                                                                parameters={"keep": keep}), say=said.append)
    assert manifest.status == "ok", manifest
    kept = keep == "baseline"
    assert [nb.name for nb in manifest.notebooks] == [
        "03-images.ipynb", "04-ray.ab-baseline.ipynb", "05-serve.ab-baseline.ipynb", "06-benchmark.ab-baseline.ipynb",
        "04-ray.ipynb", "05-serve.ipynb", "06-benchmark.ipynb"] + (
        ["04-ray.ab-kept.ipynb", "05-serve.ab-kept.ipynb"] if kept else [])
    arms_ = [["04-ray.ab-baseline", "baseline", "vllm:0.32.0"], ["05-serve.ab-baseline", "baseline", "vllm:0.32.0"],
             ["04-ray", "candidate", "vllm:0.34.0"], ["05-serve", "candidate", "vllm:0.34.0"]]
    assert _images(run_dir) == arms_ + ([["04-ray.ab-kept", "kept", "vllm:0.32.0"],
                                         ["05-serve.ab-kept", "kept", "vllm:0.32.0"]] if kept else [])
    state = json.loads((run_dir / "state.json").read_text())
    assert state["image"]["ref"] == ("vllm:0.32.0" if kept else "vllm:0.34.0"), "what serves is the run's image"
    assert any("04-ray.ab-kept.ipynb and 05-serve.ab-kept.ipynb serve it again" in line for line in said) == kept
    up_dir, up = driver.execute(image_params, RunOptions(out_root=tmp_path / "out", folder=image_notebooks,
                                                         seed=run_dir, start="04", upto="05"))
    assert [nb.name for nb in up.notebooks if nb.status == "ok"] == \
        ["04-ray.ipynb", "05-serve.ab-kept.ipynb" if kept else "05-serve.ipynb"]
    assert {ref for _, _, ref in _images(up_dir)} == {"vllm:0.32.0" if kept else "vllm:0.34.0"}, \
        "`up` serves the image the A/B kept"


def test_without_a_baseline_the_arms_are_skipped_and_the_choice_serves(image_notebooks, image_params, tmp_path):
    said: list[str] = []
    run_dir, manifest = driver.execute(image_params, RunOptions(out_root=tmp_path / "out", folder=image_notebooks,
                                                                parameters={"baseline": ""}), say=said.append)
    status = {nb.name: nb.status for nb in manifest.notebooks}
    assert [s for n, s in status.items() if ".ab-" in n] == ["skipped: no A/B of images: planted"] * 3
    assert _images(run_dir) == [["04-ray", None, "vllm:0.34.0"], ["05-serve", None, "vllm:0.34.0"]]
    assert manifest.status == "partial" and status["06-benchmark.ipynb"] == "ok"


def test_the_image_ab_puts_04_in_its_arms_and_only_there(image_params):
    params = load_params(image_params)
    names = ["03-images.ipynb", "04-ray.ipynb", "05-serve.ipynb", "06-benchmark.ipynb"]
    assert arms.with_arms(names, params)[1:4] == ["04-ray.ab-baseline.ipynb", "05-serve.ab-baseline.ipynb",
                                                  "06-benchmark.ab-baseline.ipynb"]
    assert arms.with_arms(names[2:], params) == names[2:], "no 04 among them: no image A/B"
    assert arms.known("04-ray.ab-kept.ipynb", names) and not arms.known("03-images.ab-kept.ipynb", names)
    data = yaml.safe_load(image_params.read_text())
    data["serve"]["speculative"], data["benchmark"] = {"method": "ngram", "num_speculative_tokens": 3}, \
        {"ab": "speculative"}
    image_params.write_text(yaml.safe_dump(data))
    assert "04-ray.ab-baseline.ipynb" not in arms.with_arms(names, load_params(image_params))


def test_the_baseline_is_the_image_of_the_newest_run_that_served(lab, tmp_path):
    """Run.serving_image: the newest earlier run whose 05 ended ok, by its sealed record; a run whose 05 failed, one
    this controller did not seal and a later run are passed over."""
    from rundirs import make_run

    from sparkbook.runbook.session import Run

    cluster = tmp_path / "lab"
    make_run(cluster, "20261201T100000Z", image="vllm:old", image_id="sha256:" + "a" * 64)
    make_run(cluster, "20261201T110000Z", image="vllm:served", image_id="sha256:" + "b" * 64)
    make_run(cluster, "20261201T120000Z", image="vllm:failed", statuses=["ok"] * 4 + ["failed", "pending"])
    foreign = make_run(cluster, "20261201T130000Z", image="vllm:foreign")
    (foreign / "state.json").write_text((foreign / "state.json").read_text().replace("foreign", "planted"))
    make_run(cluster, "20261201T150000Z", image="vllm:later")
    now = cluster / "20261201T140000Z"
    served = Run(tmp_path / "lab.yaml", lab, now, "03-image-selection").serving_image()
    assert served is not None and (served.ref, served.id) == ("vllm:served", "sha256:" + "b" * 64)
    assert Run(tmp_path / "lab.yaml", lab, cluster / "20261201T090000Z", "03-image-selection").serving_image() is None
