"""benchmark.ab: image on the lab (issue 57 items 1-2): the full run's plan under a cluster name and ports of its own
(as test_lab_ab_layout.py, beside the full run's deployment), run from 03 on the full run's hand-offs. On a first run
of such a cluster nothing serves on it, so the baseline is runtime.installed_image:

- in `make test`, one A/B: the installed image is the full run's (the entrypoint-shaped 0.32.0) and the only
  candidate the lab's planted slower twin (sparkbook-lab/vllm-cpu:0.32.0-slow: each engine step sleeps as long
  again); it answers the same but is slower beyond the noise, so the baseline serves again (04 and 05 as the kept
  arm) and `sparkbook up` after it serves the kept image;
- in `make test-all` (slow), the other verdict: the slow twin installed, the entrypoint image the candidate, which is
  faster and stays, and then, on that cluster, the slow twin refused against what serves now (the baseline read from
  the cluster's last deployment).

The A/B on the CPU (04 to 06 per arm, a 05 start per arm) takes about 5 minutes beyond the full run. The modules'
containers are removed after them.
"""
from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from sparkbook.core.cluster.topology import container_name, container_names, front_place
from sparkbook.core.values.evidence import read_events
from sparkbook.core.values.params import Params, load_params
from sparkbook.lab.cluster import lab_nodes
from sparkbook.lab.imagebuild import OPENAI, SLOW, ensure_images, image_id, load_images
from sparkbook.runbook import driver, operate
from sparkbook.runbook.driver import RunOptions
from sparkbook.runbook.manifest import Manifest

pytestmark = pytest.mark.lab
CLUSTER = "lab-ab-image"
SERVE = {"port": 8300, "replica_port": 8301, "master_port": 29801, "api_key_env": None, "front": "auto"}
SWEEP = {"concurrency": [2], "num_prompts": 6, "repeats": 2, "warmup_requests": 1, "depths": [], "soak_s": 0,
         "ab": "image"}  # the planted image is 0.4x: two repeats of a few prompts tell it beyond their band
ARMS = ["03-image-selection.ipynb", "04-ray-cluster.ab-baseline.ipynb", "05-serve.ab-baseline.ipynb",
        "06-benchmark.ab-baseline.ipynb", "04-ray-cluster.ipynb", "05-serve.ipynb", "06-benchmark.ipynb"]

Run = tuple[Path, Manifest]


def _params(first_params: str, tmp: pytest.TempPathFactory, images: list[str], installed: str) -> Path:
    data: dict[str, Any] = yaml.safe_load(Path(first_params).read_text())
    data.update(cluster=CLUSTER, secrets=[])
    data["serve"].update(SERVE)
    data["ray"] = {**data.get("ray", {}), "port": 6579}  # the full run's Ray holds 6379 beside it
    data["benchmark"].update(SWEEP)
    data["runtime"].update(images=images, installed_image=installed, image_policy="newest")
    path = tmp.mktemp("image-ab-params") / f"{CLUSTER}.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def _teardown(node_shells, params: Params) -> None:
    for node, names in container_names(params).items():  # the front's own place on the head too
        node_shells[node].run(["docker", "rm", "-f", *names], check=False)


def _planted() -> None:
    """The slower twin built with the lab's images (cached after the first time) and loaded on the head on demand
    (03 copies it to the worker as a layer delta)."""
    ensure_images()
    load_images(lab_nodes(2)[0].docker_host, [SLOW], print)


@pytest.fixture(scope="module")
def refused(full_run, node_shells, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, Params, Run]]:
    """One A/B: the slow twin against the installed entrypoint image, on a first run of the cluster."""
    first_dir, first = full_run
    outputs = tmp_path_factory.mktemp("image-ab-outputs")
    _planted()
    path = _params(first.params_file, tmp_path_factory, [SLOW], installed=OPENAI)
    run = driver.execute(path, RunOptions(out_root=outputs, seed=first_dir, start="03"), say=print)
    params = load_params(path)
    yield outputs, params, run
    _teardown(node_shells, params)


@pytest.fixture(scope="module")
def kept_then_refused(full_run, node_shells, tmp_path_factory: pytest.TempPathFactory
                      ) -> Iterator[tuple[Run, Run]]:
    """The entrypoint image against the installed slow twin, then the slow twin against what serves after it."""
    first_dir, first = full_run
    outputs = tmp_path_factory.mktemp("image-ab-kept-outputs")
    _planted()
    kept_new = _params(first.params_file, tmp_path_factory, [OPENAI], installed=SLOW)
    keep = driver.execute(kept_new, RunOptions(out_root=outputs, seed=first_dir, start="03"), say=print)
    refuse_slow = _params(first.params_file, tmp_path_factory, [SLOW], installed=SLOW)
    refuse = driver.execute(refuse_slow, RunOptions(out_root=outputs, start="03"), say=print)
    yield keep, refuse
    _teardown(node_shells, load_params(refuse_slow))


def _state(run_dir: Path) -> dict[str, Any]:
    return json.loads((run_dir / "state.json").read_text())


def _ran(manifest: Manifest) -> list[tuple[str, str]]:
    return [(nb.name, nb.status) for nb in manifest.notebooks if not nb.status.startswith("skipped")]


def _head_image(node_shells, params: Params) -> str:
    _, out, _ = node_shells["lab-0"].run(["docker", "inspect", "--format", "{{.Image}}",
                                          container_name(params, "lab-0")])
    return out.strip()


def _refusal(node_shells, params: Params, run: Run, baseline_because: str) -> None:
    """The slow twin refused against the image that serves: the kept arm serves the baseline again."""
    run_dir, manifest = run
    assert _ran(manifest) == [(name, "ok") for name in ARMS] + [
        ("04-ray-cluster.ab-kept.ipynb", "ok"), ("05-serve.ab-kept.ipynb", "ok")], _ran(manifest)
    state = _state(run_dir)
    assert state["ab_baseline"]["image"]["ref"] == OPENAI and baseline_because in state["ab_baseline"]["reason"]
    verdict = state["ab"]
    assert verdict["kept"] == "baseline" and "slower beyond the noise" in verdict["reason"], verdict["reason"]
    assert f"03's choice {SLOW} gives" in verdict["reason"] and verdict["ratios"][0]["verdict"] == "worse"
    assert verdict["agreement"]["candidate"] >= 0.9, "the twin answers the same: only its speed refuses it"
    assert state["image"]["ref"] == OPENAI, "the run's image is the one serving: up, watch and a rollback keep it"
    assert _head_image(node_shells, params) == image_id(OPENAI)
    models = httpx.get(f"{state['endpoint']['base_url']}/v1/models", timeout=10).json()["data"]
    assert [m["id"] for m in models] == [params.model.served_name]
    page = (run_dir / "index.html").read_text()
    assert "serving after the A/B" in page and "slower beyond the noise" in page


def test_a_slower_image_is_refused_and_the_baseline_serves_again(refused, node_shells) -> None:
    _, params, run = refused
    _refusal(node_shells, params, run, "runtime.installed_image")
    (distribution,) = [e["data"] for e in read_events(run[0], "distribution") if e["data"]["image"] == SLOW]
    copies = distribution["copies"]  # 03 put the planted twin on the worker: only the layers it lacks, on the fabric
    assert copies or "lab-1" in distribution["skipped"], distribution  # held already: a lab set up before
    for copy in copies:
        assert copy["mode"].startswith("delta: ") and copy["route"].startswith("fabric "), copy
        assert copy["bytes"] < 50_000_000, copy  # the twin's own layer; the shared 0.32.0 layers stay home
    # each arm after the first replaced the node places of a live server behind the front (a new image): 04 drained
    # the head's server first, and the front in its own place outlived them, holding what arrived meanwhile
    drained = [e["data"] for e in read_events(run[0], "server_drained")]
    assert len(drained) == 2 and all(any("serve-" in log for log in d["signalled"]) for d in drained), drained
    held = [e["data"] for e in read_events(run[0], "front_held")]
    assert [h["way"] for h in held] == ["new node places behind the front"] * 2, held
    assert all(h["refused"] == 0 for h in held), held
    started = {name: node_shells["lab-0"].run(["docker", "inspect", "-f", "{{.State.StartedAt}}", name])[1].strip()
               for name in (front_place(params, "").name, container_name(params, "lab-0"))}
    front, head = started.values()
    assert front < head, f"the front's place started before the kept arm's node place: {started}"


def test_up_after_the_refusal_serves_the_kept_image(refused, node_shells) -> None:
    outputs, params, (refused_dir, _) = refused
    run_dir, manifest, deployment = operate.up(Path(Manifest.read(refused_dir).params_file), outputs, say=print)
    assert deployment.run_dir == refused_dir and deployment.image.ref == OPENAI
    assert [nb.name for nb in manifest.notebooks if nb.status == "ok"] == ["04-ray-cluster.ipynb",
                                                                          "05-serve.ab-kept.ipynb"]
    assert _state(run_dir)["image"]["ref"] == OPENAI and _head_image(node_shells, params) == image_id(OPENAI)


@pytest.mark.slow  # about 5 min in CI; make test keeps the refusal, its kept arm and `up` (above)
def test_a_faster_image_stays_and_a_slower_one_is_refused_against_what_serves(kept_then_refused,
                                                                              node_shells) -> None:
    (run_dir, manifest), refuse = kept_then_refused
    assert _ran(manifest) == [(name, "ok") for name in ARMS], _ran(manifest)
    state = _state(run_dir)
    assert state["ab_baseline"]["image"]["ref"] == SLOW and "runtime.installed_image" in state["ab_baseline"]["reason"]
    verdict = state["ab"]
    assert verdict["ab"] == "image" and verdict["kept"] == "candidate", verdict["reason"]
    assert verdict["ratios"][0]["ratio"] > 1.5, "the planted image takes each step twice over"
    assert verdict["agreement"]["candidate"] >= 0.9 and verdict["agreement"]["baseline"] == 1.0, verdict
    assert state["image"]["ref"] == OPENAI
    _refusal(node_shells, load_params(Manifest.read(refuse[0]).params_file), refuse, "serves now")
