"""Where the old deployment's image comes from when params leave it out (01's inventory), and what a candidate's
name meant at the last run of the cluster (a moving tag is a warning)."""
from __future__ import annotations

import json
from pathlib import Path

from sparkbook.core.analysis.hostfacts import Memory
from sparkbook.core.cluster.runtime_docker import LABEL
from sparkbook.core.values import seal, state
from sparkbook.core.values.handoff import ImageChoice
from sparkbook.core.values.rundir import STATE
from sparkbook.records.earlier import probed_before
from sparkbook.stages.cleanup.inventory import Container, Inventory, old_deployment
from sparkbook.stages.images.tags import TagHistory, tag_history


def inv(node: str, containers: list[Container]) -> Inventory:
    return Inventory(node, containers, "Docker 28", [], "systemd", [], "no GPU", [], Memory(100 << 30, 10 << 30))


def test_the_old_deployments_images_are_the_running_containers_not_sparkbooks_own():
    head = inv("spark-1a32", [Container("vllm_node", "4f1c", "vllm-node-20260122-whl-tf5", "running", []),
                              Container("tei-embed", "77aa", "tei:1.8", "running", []),
                              Container("sparkbook-duo-spark-1a32", "9a9a", "vllm-qwen:latest", "running", [],
                                        labels={LABEL: "sparkbook-duo-spark-1a32"}),
                              Container("old-exited", "1111", "busybox", "exited", [])])
    worker = inv("spark-5be3", [Container("vllm_node", "9e8d", "vllm-node-20260122-whl-tf5", "running", [])])
    found = old_deployment([head, worker])
    assert found.images == {"vllm-node-20260122-whl-tf5": ["spark-1a32/vllm_node", "spark-5be3/vllm_node"],
                            "tei:1.8": ["spark-1a32/tei-embed"]}
    assert list(found.images)[0] == "vllm-node-20260122-whl-tf5"  # the most used first


def run_dir(root: Path, run_id: str, probed: dict[str, str | None]) -> Path:
    """A run dir whose 03 recorded `probed` (sealed, as the session writes it); none: 03 did not run there."""
    d = root / run_id
    d.mkdir()
    if probed:
        ref = next(iter(probed))
        state.store(d, ImageChoice(ref=ref, id=probed[ref], vllm_version="0.32.0", ray_version=None, nodes={},
                                   candidates=probed), lambda data: data)
    return d


def test_an_unsealed_record_names_no_earlier_image(tmp_path):
    planted = run_dir(tmp_path, "20261120T100000Z", {"a:1": "sha256:1"})
    seal.sig_file(planted / STATE).unlink()
    (planted / "events.jsonl").write_text(json.dumps({"kind": "image_probe", "data": {"facts": {
        "image": "a:1", "image_id": "sha256:1"}}}) + "\n")  # events are no record of what a name meant
    now = tmp_path / "20261121T100000Z"
    now.mkdir()
    assert probed_before(now, ["a:1"]) == {}


def test_a_tag_that_names_another_image_than_at_the_last_run_is_a_warning(tmp_path):
    run_dir(tmp_path, "20261120T100000Z", {"hal/vllm:latest": "sha256:0160", "vllm-node:latest": "sha256:aaaa"})
    run_dir(tmp_path, "20261125T100000Z", {"hal/vllm:latest": "sha256:0170"})
    later = run_dir(tmp_path, "20261130T100000Z", {})  # no probes: 03 failed before them
    now = tmp_path / "20261202T100000Z"
    now.mkdir()
    run_dir(tmp_path, "20261203T100000Z", {"hal/vllm:latest": "sha256:0999"})  # after this run: not read
    ids = {"hal/vllm:latest": "sha256:0999", "vllm-node:latest": "sha256:aaaa", "new/img:1": "sha256:bbbb"}
    history = tag_history(ids, probed_before(now, ids))
    moved = history["hal/vllm:latest"]
    assert moved.moved and moved.earlier_run == "20261125T100000Z" and moved.earlier_id == "sha256:0170"
    assert moved.cell() == "MOVED: was sha256:0170 in run 20261125T100000Z"
    assert "the tag moved; pin it by digest" in moved.warning()
    assert history["vllm-node:latest"].cell() == "same ID as run 20261120T100000Z"
    assert history["vllm-node:latest"].warning() is None
    assert history["new/img:1"].cell() == "first probe" and later.is_dir()


def test_a_digest_pin_cannot_move():
    pinned = TagHistory("hal/vllm@sha256:" + "0" * 64, "sha256:0170", None, None)
    assert pinned.cell() == "pinned by digest" and not pinned.moved and pinned.warning() is None


def test_an_interactive_dir_compares_with_the_newest_run(tmp_path):
    run_dir(tmp_path, "20261120T100000Z", {"a:1": "sha256:1"})
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    assert tag_history({"a:1": "sha256:2"}, probed_before(scratch, ["a:1"]))["a:1"].moved
