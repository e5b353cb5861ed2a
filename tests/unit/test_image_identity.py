"""Images named by ID and digest as well as tag (issue 57, item 4): a pin by digest in params, a malformed one refused
in one line naming the field; the image IDs 03 records in the sealed state, read back by the next run's 02, which
finds a tag that names another image now; repo digests as Docker reports them."""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from sparkbook.core.cluster.context import Context
from sparkbook.core.cluster.nodes import Result
from sparkbook.core.cluster.runtime_docker import DockerImages
from sparkbook.core.values import rundir, seal, state
from sparkbook.core.values.handoff import ImageChoice
from sparkbook.core.values.params import ParamsError, load_params
from sparkbook.records.earlier import images_before
from sparkbook.stages.diagnose import imageids

PIN = "sha256:" + "a" * 64
ID_THEN, ID_NOW = "sha256:" + "1" * 64, "sha256:" + "2" * 64


@pytest.mark.parametrize("ref", [f"hub/vllm@{PIN}", f"hub/vllm:0.17@{PIN}", f"registry.example/team/vllm@{PIN}"])
def test_a_digest_pin_is_accepted_in_images_and_installed_image(ref, base: dict[str, Any],
                                                                write_params: Callable[..., Path]):
    base["runtime"]["images"] = [ref]
    base["runtime"]["installed_image"] = ref
    params = load_params(write_params(base))
    assert params.runtime.images == [ref] and params.runtime.installed_image == ref  # type: ignore[union-attr]


@pytest.mark.parametrize("field, digest", [("images", "sha256:abc"), ("images", "sha512:" + "a" * 64),
                                           ("installed_image", "sha256:" + "A" * 64),
                                           ("installed_image", "sha256:" + "a" * 63 + "g")])
def test_a_malformed_digest_is_refused_in_one_line_naming_the_field(field, digest, base: dict[str, Any],
                                                                    write_params: Callable[..., Path]):
    ref = f"hub/vllm:0.17@{digest}"
    base["runtime"][field] = [ref] if field == "images" else ref
    with pytest.raises(ParamsError) as caught:
        load_params(write_params(base))
    [problem] = caught.value.problems
    where = f"runtime.{field}[0]" if field == "images" else f"runtime.{field}"
    assert problem.field == where and "\n" not in str(problem)
    assert f"has a malformed digest {digest!r}: a pin is name@sha256: and 64 lowercase hex digits" in str(problem)


def a_run(root: Path, run_id: str, candidates: dict[str, str | None]) -> Path:
    """A run dir whose 03 chose the first candidate, its state sealed as the session writes it."""
    run_dir = root / run_id
    run_dir.mkdir(parents=True)
    ref = next(iter(candidates))
    state.store(run_dir, ImageChoice(ref=ref, id=candidates[ref], vllm_version="0.32.0", ray_version=None, nodes={},
                                     candidates=candidates), lambda d: d)
    return run_dir


def test_the_last_sealed_record_of_the_clusters_images_is_read_and_a_planted_one_passed_over(tmp_path):
    a_run(tmp_path, "20261201T100000Z", {"hub/vllm:latest": "sha256:0", "hub/old:1": ID_THEN})
    a_run(tmp_path, "20261203T100000Z", {"hub/vllm:latest": ID_THEN})
    planted = a_run(tmp_path, "20261204T100000Z", {"hub/vllm:latest": ID_NOW})
    seal.sig_file(planted / rundir.STATE).unlink()
    (tmp_path / "20261205T100000Z").mkdir()  # a run whose 03 did not run
    now = tmp_path / "20261206T100000Z"
    now.mkdir()
    before = images_before(now)
    assert {ref: (p.image_id, p.run) for ref, p in before.items()} == {
        "hub/vllm:latest": (ID_THEN, "20261203T100000Z")}  # the newest sealed record, whole; never the planted one


class Images:
    """The head's images as `docker image inspect` would answer: ref -> ID."""

    def __init__(self, ids: dict[str, str], candidates: list[str], installed: str | None = None):
        self.ids, self._candidates, self._installed = ids, candidates, installed

    def candidates(self) -> list[str]:
        return self._candidates

    def installed(self, found_running: str | None = None) -> str | None:
        return self._installed

    def image(self, node: object, ref: str) -> tuple[str, int] | None:
        return (self.ids[ref], 1) if ref in self.ids else None


def context(images: Images) -> Context:
    """What moved_tags asks of a context: the head and its images."""
    return SimpleNamespace(images=images, head=SimpleNamespace(name="lab-0"))  # type: ignore[return-value]


def test_02_finds_a_tag_that_names_another_image_than_at_the_last_run(tmp_path):
    a_run(tmp_path, "20261203T100000Z", {"hub/vllm:latest": ID_THEN, "hub/old:1": ID_THEN, "hub/gone:1": ID_THEN})
    now = tmp_path / "20261206T100000Z"
    now.mkdir()
    images = Images({"hub/vllm:latest": ID_NOW, "hub/old:1": ID_THEN, "hub/new:1": ID_NOW},
                    ["hub/vllm:latest", "hub/new:1", "hub/gone:1"], installed="hub/old:1")
    [finding] = imageids.moved_tags(context(images), images_before(now))
    assert finding.severity == "warning" and finding.topic == "image"
    assert finding.text.startswith("`hub/vllm:latest` now points at another image: `sha256:111111111111` -> "
                                   "`sha256:222222222222` (run 20261203T100000Z recorded the first)")
    assert imageids.moved_tags(context(images), {}) == []  # a first run: nothing to set beside


def test_docker_reports_an_images_repo_digests():
    def run(argv, timeout):
        stdout = '["hub/vllm@' + PIN + '"]\n' if argv[-1] == "hub/vllm:0.17" else "null\n"
        return Result("lab-0", tuple(argv), 0, stdout, "", None, 0.1)  # type: ignore[arg-type]
    node = SimpleNamespace(run=run)
    images = DockerImages(SimpleNamespace(image_policy="newest", pull=False))  # type: ignore[arg-type]
    assert images.digests(node, "hub/vllm:0.17") == (f"hub/vllm@{PIN}",)  # type: ignore[arg-type]
    assert images.digests(node, "built/here:1") == ()  # type: ignore[arg-type]


def test_a_pinned_image_is_run_and_checked_on_the_nodes_by_its_id():
    """`docker save NAME@sha256:D | docker load` on another daemon brings the image (its ID) but no repo digest: the
    pin names nothing there (measured with a registry on this machine: `docker image inspect NAME@sha256:D` on the
    loading daemon, "No such image"; by ID, the image). So 03 checks the nodes and 04 starts the containers by ID."""
    from sparkbook.stages.images.distribute import held_as

    pin = f"hub/vllm@{PIN}"
    assert held_as(pin, ID_NOW) == ID_NOW and held_as("hub/vllm:0.17", ID_NOW) == "hub/vllm:0.17"
    chosen = ImageChoice(ref=pin, id=ID_NOW, vllm_version="0.32.0", ray_version=None, nodes={})
    assert chosen.on_nodes == ID_NOW
    assert chosen.model_copy(update={"ref": "hub/vllm:0.17"}).on_nodes == "hub/vllm:0.17"
    assert chosen.model_copy(update={"id": None}).on_nodes == pin, "no ID known (a preview): the ref as given"
