"""benchmark.ab: image on the lab (issue 57 items 1-2): the full run's plan under a cluster name and ports of its own
(as test_lab_ab_layout.py, beside the full run's deployment), run from 03 on the full run's hand-offs, twice:

- a first run of that cluster: nothing serves on it yet, so the baseline is runtime.installed_image, the lab's
  planted slower twin of 0.32.0 (sparkbook-lab/vllm-cpu:0.32.0-slow: each engine step sleeps as long again), and
  03's choice is the full run's image (the entrypoint-shaped 0.32.0): it answers the same and is faster, so it stays;
- a second run whose only candidate is the planted slower image: the baseline is now what serves (the first run's
  kept image), the candidate answers the same but is slower beyond the noise, so the baseline serves again
  (04 and 05 as the kept arm) and `sparkbook up` after it serves the kept image.

Two image A/Bs on the CPU (04 to 06 per arm, a 05 start per arm), about 9 minutes beyond the full run: in `make
test`, as the issue's own check. The module's containers are removed after it.
"""
from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from sparkbook.core.cluster.topology import container_name
from sparkbook.core.values.params import Params, load_params
from sparkbook.lab.cluster import lab_nodes
from sparkbook.lab.imagebuild import OPENAI, SLOW, ensure_images, image_id, load_images
from sparkbook.runbook import driver, operate
from sparkbook.runbook.driver import RunOptions
from sparkbook.runbook.manifest import Manifest

pytestmark = pytest.mark.lab
CLUSTER = "lab-ab-image"
SERVE = {"port": 8300, "replica_port": 8301, "master_port": 29801, "api_key_env": None}
SWEEP = {"concurrency": [2], "num_prompts": 6, "repeats": 2, "warmup_requests": 1, "depths": [], "soak_s": 0,
         "ab": "image"}  # the planted image is 0.4x: two repeats of a few prompts tell it beyond their band
ARMS = ["03-image-selection.ipynb", "04-ray-cluster.ab-baseline.ipynb", "05-serve.ab-baseline.ipynb",
        "06-benchmark.ab-baseline.ipynb", "04-ray-cluster.ipynb", "05-serve.ipynb", "06-benchmark.ipynb"]

Run = tuple[Path, Manifest]


def _params(first_params: str, tmp: pytest.TempPathFactory, images: list[str]) -> Path:
    data: dict[str, Any] = yaml.safe_load(Path(first_params).read_text())
    data.update(cluster=CLUSTER, secrets=[])
    data["serve"].update(SERVE)
    data["ray"] = {**data.get("ray", {}), "port": 6579}  # the full run's Ray holds 6379 beside it
    data["benchmark"].update(SWEEP)
    data["runtime"].update(images=images, installed_image=SLOW, image_policy="newest")
    path = tmp.mktemp("image-ab-params") / f"{CLUSTER}.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


@pytest.fixture(scope="module")
def image_runs(full_run, node_shells, tmp_path_factory: pytest.TempPathFactory
               ) -> Iterator[tuple[Path, Params, Run, Run]]:
    first_dir, first = full_run
    ensure_images()  # the planted image is built with the lab's (cached after the first time), loaded on demand
    load_images(lab_nodes(2)[0].docker_host, [SLOW], print)  # 03 copies it to the worker as a layer delta
    outputs = tmp_path_factory.mktemp("image-ab-outputs")
    kept_new = _params(first.params_file, tmp_path_factory, [OPENAI])
    keep = driver.execute(kept_new, RunOptions(out_root=outputs, seed=first_dir, start="03"), say=print)
    refuse_slow = _params(first.params_file, tmp_path_factory, [SLOW])
    refuse = driver.execute(refuse_slow, RunOptions(out_root=outputs, start="03"), say=print)
    params = load_params(refuse_slow)
    yield outputs, params, keep, refuse
    for spec in params.nodes:
        node_shells[spec.name].run(["docker", "rm", "-f", container_name(params, spec.name)], check=False)


def _state(run_dir: Path) -> dict[str, Any]:
    return json.loads((run_dir / "state.json").read_text())


def _ran(manifest: Manifest) -> list[tuple[str, str]]:
    return [(nb.name, nb.status) for nb in manifest.notebooks if not nb.status.startswith("skipped")]


def _head_image(node_shells, params: Params) -> str:
    _, out, _ = node_shells["lab-0"].run(["docker", "inspect", "--format", "{{.Image}}",
                                          container_name(params, "lab-0")])
    return out.strip()


def test_a_faster_image_that_answers_the_same_stays(image_runs) -> None:
    _, _, (run_dir, manifest), _ = image_runs
    assert _ran(manifest) == [(name, "ok") for name in ARMS], _ran(manifest)
    state = _state(run_dir)
    assert state["ab_baseline"]["image"]["ref"] == SLOW and "runtime.installed_image" in state["ab_baseline"]["reason"]
    verdict = state["ab"]
    assert verdict["ab"] == "image" and verdict["kept"] == "candidate", verdict["reason"]
    assert verdict["ratios"][0]["ratio"] > 1.5, "the planted image takes each step twice over"
    assert verdict["agreement"]["candidate"] >= 0.9 and verdict["agreement"]["baseline"] == 1.0, verdict
    assert state["image"]["ref"] == OPENAI


def test_a_slower_image_is_refused_and_the_baseline_serves_again(image_runs, node_shells) -> None:
    _, params, _, (run_dir, manifest) = image_runs
    assert _ran(manifest) == [(name, "ok") for name in ARMS] + [
        ("04-ray-cluster.ab-kept.ipynb", "ok"), ("05-serve.ab-kept.ipynb", "ok")], _ran(manifest)
    state = _state(run_dir)
    assert state["ab_baseline"]["image"]["ref"] == OPENAI and "serves now" in state["ab_baseline"]["reason"]
    verdict = state["ab"]
    assert verdict["kept"] == "baseline" and "slower beyond the noise" in verdict["reason"], verdict["reason"]
    assert f"03's choice {SLOW} gives" in verdict["reason"] and verdict["ratios"][0]["verdict"] == "worse"
    assert state["image"]["ref"] == OPENAI, "the run's image is the one serving: up, watch and a rollback keep it"
    assert _head_image(node_shells, params) == image_id(OPENAI)
    models = httpx.get(f"{state['endpoint']['base_url']}/v1/models", timeout=10).json()["data"]
    assert [m["id"] for m in models] == [params.model.served_name]
    page = (run_dir / "index.html").read_text()
    assert "serving after the A/B" in page and "slower beyond the noise" in page


def test_up_after_the_refusal_serves_the_kept_image(image_runs, node_shells) -> None:
    outputs, params, _, (refused_dir, _) = image_runs
    run_dir, manifest, deployment = operate.up(Path(Manifest.read(refused_dir).params_file), outputs, say=print)
    assert deployment.run_dir == refused_dir and deployment.image.ref == OPENAI
    assert [nb.name for nb in manifest.notebooks if nb.status == "ok"] == ["04-ray-cluster.ipynb",
                                                                          "05-serve.ab-kept.ipynb"]
    assert _state(run_dir)["image"]["ref"] == OPENAI and _head_image(node_shells, params) == image_id(OPENAI)

