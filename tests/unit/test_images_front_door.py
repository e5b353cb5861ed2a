"""03's front door: the order of the evidence `images.run` returns and where it stops (no usable image, a node
without the image's ID, a model copy that does not verify) as outcome.error after the probes are recorded, with
the stage's remote steps replaced by values (no node is reached); the preview's first candidate as its hand-off."""
from __future__ import annotations

from pathlib import Path

import pytest

from sparkbook.core.cluster.context import Context
from sparkbook.core.cluster.nodes import Cluster
from sparkbook.core.values import rundir
from sparkbook.core.values.evidence import Decision, Event, ProbedBefore
from sparkbook.core.values.handoff import ImageChoice
from sparkbook.core.values.imagefacts import RegistryProbe
from sparkbook.core.values.params import Params
from sparkbook.stages import images
from sparkbook.stages.images import choice, distribute, memo, modelcopy
from sparkbook.stages.images.choice import Candidate, ImageFacts, InspectionProbe, ModelTarget

PARAMS = Path(__file__).resolve().parents[2] / "params"
TARGET = ModelTarget("HYV4ForCausalLM", "hy_v4", "/m", "config.json on lab-0")
ID = "sha256:" + "0" * 64


def candidate(image: str, vllm: str, loads: bool) -> Candidate:
    f = ImageFacts(image, ID, 3_500_000_000, "3.11.2", vllm, "2.13.0", None, "2.60.0", "5.0", [], "", 0.5,
                   ray_cli="/opt/venv/bin/ray", native_multinode=True)
    r = RegistryProbe(image, TARGET.architecture, "x", loads, "vllm.models.hy_v4" if loads else None, None, None,
                      loads, False, 400, 1.2)
    error = "" if loads else "Model architectures ['HYV4ForCausalLM'] are not supported for now."
    i = InspectionProbe(image, TARGET.architecture, loads, TARGET.architecture if loads else None,
                        f"ValueError: {error}" if error else "", error, "", "", False, 5.0, 9.0)
    return Candidate(f, r, i, choice.classify(f, r, i, executor="mp", capabilities={}))


def a_preview(refs: list[str], pull: bool = False) -> images.ImagesPreview:
    first = ImageChoice(ref=refs[0], id=None, vllm_version=None, ray_version=None, nodes={})
    return images.ImagesPreview(TARGET, {}, {"lab-0": "x86_64"}, refs, pull, "newest", None, "not set", None,
                                "the head does not hold it", "lab-0", None, f"lab-0 holds no {refs[0]}", (first,))


def steps(monkeypatch: pytest.MonkeyPatch, loads: dict[str, bool], same_ids: bool = True,
          model_ok: bool = True) -> list[str]:
    """The remote steps replaced by values; the list names each step as it is called."""
    called: list[str] = []
    versions = {"old": "0.28.0", "new": "0.32.0"}

    def evaluate(ctx, ref, target, caps, machines):
        called.append(f"evaluate {ref}")
        return memo.Evaluated(candidate(ref, versions[ref], loads[ref]), None, None, None)

    def distribute_(ctx, ref):
        called.append(f"distribute {ref}")
        copies = [] if same_ids else [distribute.Copy("lab-1", 10**9, 10.0, "")]
        return distribute.Distribution(ref, ID, copies, ["lab-0"], {"lab-0": ID, "lab-1": ID if same_ids else None})

    def copy_model(ctx):
        called.append("copy_model")
        copies = [] if model_ok else [modelcopy.NodeCopy("lab-1", 3, 10**9, 10.0, [], "rsync exited 23")]
        return modelcopy.ModelCopy("lab-0", "/m", copies, [], {"lab-1": model_ok})

    monkeypatch.setattr(memo, "evaluate", evaluate)
    monkeypatch.setattr(distribute, "distribute", distribute_)
    monkeypatch.setattr(modelcopy, "copy_model", copy_model)
    return called


def kinds(out: images.ImagesOutcome) -> list[str]:
    return [r.kind if isinstance(r, Event) else f"decision: {r.choice}" for r in out.records
            if isinstance(r, (Event, Decision))]


def context(params: Params, tmp_path: Path) -> Context:
    return Context(params, None, None, tmp_path / "20261203T000000Z")  # type: ignore[arg-type]  # steps replaced


def test_run_probes_decides_copies_and_hands_on_the_choice(monkeypatch, lab, tmp_path) -> None:
    called = steps(monkeypatch, {"old": False, "new": True})
    out = images.run(context(lab, tmp_path), a_preview(["old", "new"]), probed_before={})
    assert out.error is None and called == ["evaluate old", "evaluate new", "distribute new", "copy_model"]
    assert kinds(out) == ["image_probe", "image_probe", "decision: new", "distribution", "model_copy"]
    assert out.handoffs == [ImageChoice(ref="new", id=ID, vllm_version="0.32.0", ray_version="2.60.0",
                                        nodes={"lab-0": ID, "lab-1": ID}, candidates={"old": ID, "new": ID})]
    log = str(tmp_path / "20261203T000000Z" / rundir.LOGS / "03-inspect-old.txt")
    assert "03-inspect-old.txt" in out.logs and out.decision is not None and log in out.decision.evidence


def test_a_tag_an_earlier_run_probed_as_another_image_warns_in_the_decisions_evidence(monkeypatch, lab, tmp_path):
    steps(monkeypatch, {"old": False, "new": True})
    before = {"new": ProbedBefore("sha256:0170", "20261125T100000Z"), "old": ProbedBefore(ID, "20261125T100000Z")}
    out = images.run(context(lab, tmp_path), a_preview(["old", "new"]), probed_before=before)
    assert out.history["new"].moved and out.history["old"].cell() == "same ID as run 20261125T100000Z"
    assert len(out.moved) == 1 and "new names another image than in run 20261125T100000Z" in out.moved[0]
    assert out.decision is not None and out.moved[0] in out.decision.evidence
    fresh = images.run(context(lab, tmp_path), a_preview(["old", "new"]), probed_before={})
    assert fresh.moved == [] and fresh.history["new"].cell() == "first probe"


def test_no_usable_image_is_the_outcomes_error_after_the_probes(monkeypatch, lab, tmp_path) -> None:
    called = steps(monkeypatch, {"old": False, "new": False})
    out = images.run(context(lab, tmp_path), a_preview(["old", "new"]), probed_before={})
    assert isinstance(out.error, choice.NoUsableImage) and called == ["evaluate old", "evaluate new"]
    assert kinds(out) == ["image_probe", "image_probe"] and out.handoffs == []
    assert "03 stopped" in str(out.decision_shown()[0].value)


def test_a_node_without_the_images_id_stops_before_the_model_copy(monkeypatch, lab, tmp_path) -> None:
    called = steps(monkeypatch, {"old": False, "new": True}, same_ids=False)
    out = images.run(context(lab, tmp_path), a_preview(["old", "new"]), probed_before={})
    assert isinstance(out.error, distribute.NotDistributed) and "IMAGE IDS DIFFER" in str(out.error)
    assert "copy_model" not in called and kinds(out)[-1] == "distribution" and out.handoffs == []


def test_a_model_copy_that_does_not_verify_is_the_outcomes_error(monkeypatch, lab, tmp_path) -> None:
    steps(monkeypatch, {"old": False, "new": True}, model_ok=False)
    out = images.run(context(lab, tmp_path), a_preview(["old", "new"]), probed_before={})
    assert isinstance(out.error, modelcopy.ModelCopyError) and "COPIES DIFFER" in str(out.error)
    assert kinds(out)[-1] == "model_copy" and out.handoffs == []


def test_the_preview_says_it_assumes_the_first_candidate() -> None:
    seen = a_preview(["old", "new"])
    text = seen.assumed_text()
    assert "chooses by probing" in text and "old is the candidate it tries first" in text
    assert [r["image"] for r in seen.candidate_rows()] == ["old", "new"]
    assert "not known before a run" in str(seen.copy_shown()[0].value)


class Holds:
    """The runtime's one verb 03's first-candidate facts ask before probing: does the head hold the image."""

    def __init__(self, held: bool) -> None:
        self.held = held

    def lacks(self, node: object, ref: str, image_id: str | None = None) -> str | None:
        return None if self.held else f"holds no {ref} (absent; expected any)"


def test_the_first_candidate_is_probed_as_03_probes_it_and_handed_on_with_its_facts(monkeypatch, lab, tmp_path):
    """Issue 54, item 6: `sparkbook plan` before a first run learns the first candidate's vLLM and Ray from a
    throwaway container of it (03's own facts probe), so 04 and 05 are previewed for what it holds."""
    probed: list[str] = []

    def probe_facts(ctx, image, node=None):
        probed.append(image)
        return candidate(image, "0.28.0", True).facts

    monkeypatch.setattr(choice, "probe_facts", probe_facts)
    ctx = Context(lab, Cluster(lab), Holds(True), tmp_path)  # type: ignore[arg-type]
    facts, unknown = images.first_facts(ctx, "old")
    assert probed == ["old"] and facts is not None and unknown is None
    first = images.first_choice("old", facts, None)
    assert first.probed and (first.vllm_version, first.ray_version) == ("0.28.0", "2.60.0") and first.id is None


def test_a_first_candidate_the_head_lacks_is_not_probed_and_its_facts_are_not_known(monkeypatch, lab, tmp_path):
    monkeypatch.setattr(choice, "probe_facts", lambda *a, **k: pytest.fail("no probe of an image the head lacks"))
    ctx = Context(lab, Cluster(lab), Holds(False), tmp_path)  # type: ignore[arg-type]
    facts, unknown = images.first_facts(ctx, "new")
    assert facts is None and unknown == "lab-0 holds no new (absent; expected any)"
    first = images.first_choice("new", facts, None)
    assert not first.probed and first.ray_version is None
    shown = a_preview(["new"]).facts_shown()
    assert shown.value == "not known: lab-0 holds no new" and shown.title.startswith("What new holds")
