"""What the runbook learns about an image, kept by image ID (issue 57, item 7): the sealed store beside the cluster's
runs (core.cluster.imagememo) read back on a hit, missed on another image ID or model, and never trusted where a file
was tampered with, planted or is another answer's; 03's candidate the same value whether probed or read back; 05's
argv check asked once per image and argvs. Every probe is replaced by a value that counts its calls."""
from __future__ import annotations

import dataclasses
import json
import stat
from pathlib import Path
from types import SimpleNamespace

import pytest

from sparkbook.core.cluster import imagememo, probes
from sparkbook.core.cluster.context import Context
from sparkbook.core.cluster.nodes import Result
from sparkbook.core.values import rundir, seal
from sparkbook.core.values.handoff import ImageChoice
from sparkbook.core.values.imagefacts import RegistryProbe
from sparkbook.core.values.learned import PROBES, Learned, memo_key
from sparkbook.core.values.params import Params
from sparkbook.core.values.state import Handoffs
from sparkbook.stages.images import choice, memo
from sparkbook.stages.images.choice import ImageFacts, InspectionProbe, ModelTarget, Probes
from sparkbook.stages.serve import bringup, commands

ID, OTHER_ID = "sha256:" + "1" * 64, "sha256:" + "2" * 64
TARGET = ModelTarget("HYV4ForCausalLM", "hy_v4", "/srv/models/hyv4-tiny", "state (02-diagnosis)")
PARTS = {"ref": "img:1", "architecture": "HYV4ForCausalLM", "model_type": "hy_v4", "model_dir": "/m"}


def probes_of(image: str, image_id: str | None = ID) -> Probes:
    f = ImageFacts(image, image_id, 3_500_000_000, "3.11.2", "0.32.0", "2.13.0", None, "2.60.0", "5.0", [], "",
                   0.5, architecture="amd64", ray_cli="/opt/venv/bin/ray", native_multinode=True,
                   repo_digests=("hub/img@sha256:" + "3" * 64,))
    r = RegistryProbe(image, TARGET.architecture, "0.32.0", True, "vllm.models.hy_v4", "HYV4", "_TEXT", True, False,
                      400, 1.2)
    i = InspectionProbe(image, TARGET.architecture, True, TARGET.architecture, "", "", "", "", False, 5.0, 35.7)
    return Probes(f, r, i, None)


def run_dir(tmp_path: Path, run_id: str = "20261207T090000Z") -> Path:
    d = tmp_path / "lab" / run_id
    d.mkdir(parents=True, exist_ok=True)
    return d


def kept(tmp_path: Path, value: Probes, image_id: str = ID, parts: dict[str, str] = PARTS) -> Path:
    return imagememo.keep(run_dir(tmp_path, "20261207T080000Z"),
                          Learned(PROBES, image_id, memo_key(PROBES, image_id, parts), value))


# --- the store -------------------------------------------------------------------------------------------------------
def test_an_answer_kept_under_an_image_id_is_read_back_whole_and_says_where_it_came_from(tmp_path):
    value = probes_of("img:1")
    path = kept(tmp_path, value)
    assert path.parent == tmp_path / "lab" / rundir.LEARNED and seal.problem(path) is None
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700 and stat.S_IMODE(path.stat().st_mode) == 0o600
    recalled, refused = imagememo.recall(run_dir(tmp_path), PROBES, ID, PARTS, Probes)
    assert refused is None and recalled is not None and recalled.value == value
    assert recalled.run == "20261207T080000Z" and recalled.image_id == ID
    assert recalled.line("img:1").startswith("img:1: probe results from an earlier run (")
    assert "run 20261207T080000Z, image sha256:111111111111) — not run again" in recalled.line("img:1")


def test_another_image_id_or_another_model_is_a_miss(tmp_path):
    kept(tmp_path, probes_of("img:1"))
    assert imagememo.recall(run_dir(tmp_path), PROBES, OTHER_ID, PARTS, Probes) == (None, None)
    other_model = {**PARTS, "architecture": "Qwen3ForCausalLM"}
    assert imagememo.recall(run_dir(tmp_path), PROBES, ID, other_model, Probes) == (None, None)
    assert imagememo.recall(run_dir(tmp_path), PROBES, None, PARTS, Probes) == (None, None)  # no ID: nothing kept


def test_a_tampered_file_is_refused_naming_why(tmp_path):
    path = kept(tmp_path, probes_of("img:1"))
    doc = json.loads(path.read_text())
    doc["value"]["inspection"]["inspected"] = False  # a planted verdict: the image "fails" without being asked
    path.write_text(json.dumps(doc))
    recalled, refused = imagememo.recall(run_dir(tmp_path), PROBES, ID, PARTS, Probes)
    assert recalled is None and refused is not None
    assert "refused (not sealed by this controller's sparkbook: its seal does not match" in refused
    assert refused.endswith("asked again")


def test_a_planted_file_without_a_seal_is_refused(tmp_path):
    path = kept(tmp_path, probes_of("img:1"))
    seal.sig_file(path).unlink()
    recalled, refused = imagememo.recall(run_dir(tmp_path), PROBES, ID, PARTS, Probes)
    assert recalled is None and refused is not None and f"no {path.name}.sig beside it" in refused


def test_another_answer_sealed_under_this_name_is_refused(tmp_path):
    """A sealed file copied over another key's name (another image's answers passed off as this one's)."""
    other = kept(tmp_path, probes_of("img:1"), image_id=OTHER_ID)
    mine = rundir.learned_file(tmp_path / "lab" / "x", PROBES, memo_key(PROBES, ID, PARTS))
    seal.write(mine, other.read_bytes())
    recalled, refused = imagememo.recall(run_dir(tmp_path), PROBES, ID, PARTS, Probes)
    assert recalled is None and refused is not None and "it holds another answer than its name says" in refused


def test_a_sealed_file_that_is_not_the_answers_schema_is_refused(tmp_path):
    path = kept(tmp_path, probes_of("img:1"))
    doc = json.loads(path.read_text())
    del doc["value"]["registry"]["registered"]
    seal.write(path, json.dumps(doc))
    recalled, refused = imagememo.recall(run_dir(tmp_path), PROBES, ID, PARTS, Probes)
    assert recalled is None and refused is not None and "refused" in refused and "registered" in refused
    seal.write(path, b"\x00not json")
    assert imagememo.recall(run_dir(tmp_path), PROBES, ID, PARTS, Probes)[1] is not None


# --- 03 --------------------------------------------------------------------------------------------------------------
def images_context(params: Params, tmp_path: Path) -> Context:
    cluster = SimpleNamespace(head=SimpleNamespace(name="lab-0"), nodes={})
    return Context(params, cluster, None, run_dir(tmp_path))  # type: ignore[arg-type]  # probes replaced


@pytest.fixture
def asked(monkeypatch) -> dict[str, object]:
    """The head's image IDs (settable) and the refs probed, with choice's probes replaced by values."""
    state: dict[str, object] = {"ids": {"img:1": ID}, "probed": []}

    def probe(ctx, image, target, machines):
        state["probed"].append(image)  # type: ignore[attr-defined]
        p = probes_of(image, state["ids"][image])  # type: ignore[index]
        return p.facts, p.registry, p.inspection
    monkeypatch.setattr(choice, "_probe", probe)
    monkeypatch.setattr(memo, "_image_id", lambda ctx, ref: state["ids"].get(ref))  # type: ignore[attr-defined]
    return state


def keep_all(ctx: Context, evaluated: memo.Evaluated) -> None:
    """As the session keeps what a stage's outcome learned."""
    if evaluated.learned is not None:
        imagememo.keep(ctx.run_dir, evaluated.learned)


def test_03_reads_back_a_candidates_probes_and_judges_the_same_candidate(lab, tmp_path, asked):
    ctx = images_context(lab, tmp_path)
    first = memo.evaluate(ctx, "img:1", TARGET, {}, {"lab-0": "x86_64"})
    assert asked["probed"] == ["img:1"] and first.recalled is None and first.learned is not None
    assert first.line() is None
    keep_all(ctx, first)
    again = memo.evaluate(ctx, "img:1", TARGET, {}, {"lab-0": "x86_64"})
    assert asked["probed"] == ["img:1"], "not probed again"
    assert again.candidate == first.candidate and again.learned is None and again.refused is None
    assert again.line() is not None and "— not run again" in again.line()


def test_03_probes_again_for_another_image_id_or_model(lab, tmp_path, asked):
    ctx = images_context(lab, tmp_path)
    keep_all(ctx, memo.evaluate(ctx, "img:1", TARGET, {}, {}))
    asked["ids"] = {"img:1": OTHER_ID}  # the tag moved
    moved = memo.evaluate(ctx, "img:1", TARGET, {}, {})
    assert moved.recalled is None and moved.candidate.facts.image_id == OTHER_ID
    other = dataclasses.replace(TARGET, architecture="Qwen3ForCausalLM")
    memo.evaluate(ctx, "img:1", other, {}, {})
    assert asked["probed"] == ["img:1", "img:1", "img:1"]


def test_03_probes_again_where_the_kept_file_was_tampered_with_and_keeps_the_new_answers(lab, tmp_path, asked):
    ctx = images_context(lab, tmp_path)
    keep_all(ctx, memo.evaluate(ctx, "img:1", TARGET, {}, {}))
    [path] = (tmp_path / "lab" / rundir.LEARNED).glob("*.json")
    path.write_text(path.read_text().replace('"inspected": true', '"inspected": false'))
    again = memo.evaluate(ctx, "img:1", TARGET, {}, {})
    assert asked["probed"] == ["img:1", "img:1"] and again.recalled is None
    assert again.refused is not None and again.learned is not None and again.candidate.verdict.usable


def test_03_keeps_no_answer_that_is_the_nodes_or_a_timeout(lab, tmp_path, monkeypatch):
    ctx = images_context(lab, tmp_path)
    monkeypatch.setattr(memo, "_image_id", lambda ctx, ref: ID)
    timed_out = dataclasses.replace(probes_of("img:1").inspection, probe_error="timed out after 600 s")
    monkeypatch.setattr(choice, "_probe", lambda *a: (probes_of("img:1").facts, probes_of("img:1").registry,
                                                      timed_out))
    assert memo.evaluate(ctx, "img:1", TARGET, {}, {}).learned is None
    driver = dataclasses.replace(timed_out, probe_error="", error="RuntimeError: Found no NVIDIA driver on your system")
    monkeypatch.setattr(choice, "_probe", lambda *a: (probes_of("img:1").facts, probes_of("img:1").registry, driver))
    assert memo.evaluate(ctx, "img:1", TARGET, {}, {}).learned is None


# --- 05 --------------------------------------------------------------------------------------------------------------
def serve_context(params: Params, tmp_path: Path, image_id: str, calls: list[list[str]]) -> Context:
    def exec_(node, place, argv, timeout):
        calls.append(argv)
        doc = {"checked": True, "refused": [None] * len(json.loads(argv[-1])), "why_unchecked": "", "vllm": "0.32.0"}
        return Result(node.name, tuple(argv), 0, f"{probes.PREFIX}{json.dumps(doc)}\n{probes.END}\n", "",
                      None, 21.0)  # type: ignore[arg-type]

    nodes = {name: SimpleNamespace(name=name) for name in ("lab-0", "lab-1")}
    cluster = SimpleNamespace(head=nodes["lab-0"], nodes=nodes)
    chosen = ImageChoice(ref="img:1", id=image_id, vllm_version="0.32.0", ray_version=None,
                         nodes={"lab-0": image_id, "lab-1": image_id})
    return Context(params, cluster, SimpleNamespace(exec=exec_), run_dir(tmp_path), "img:1",  # type: ignore[arg-type]
                   Handoffs(given=(chosen,)))


def test_05s_argv_check_is_asked_once_per_image_id_and_argvs(lab, tmp_path):
    calls: list[list[str]] = []
    ctx = serve_context(lab, tmp_path, ID, calls)
    plan = commands.plan(ctx, "mp")
    first = bringup.check_args(ctx, plan)
    assert len(calls) == 1 and first.recalled is None and first.refused == {}
    learned = bringup.args_learned(ctx, plan, first)
    assert learned is not None
    imagememo.keep(ctx.run_dir, learned)
    again = bringup.check_args(ctx, plan)
    assert len(calls) == 1 and again.recalled is not None and "— not run again" in again.recalled
    assert dataclasses.replace(again, recalled=None) == first and bringup.args_learned(ctx, plan, again) is None
    other_argv = dataclasses.replace(plan, commands=[dataclasses.replace(plan.commands[0], argv=[
        *plan.commands[0].argv, "--max-num-seqs", "4"]), *plan.commands[1:]])
    assert bringup.check_args(ctx, other_argv).recalled is None and len(calls) == 2
    assert bringup.check_args(serve_context(lab, tmp_path, OTHER_ID, calls), plan).recalled is None
    assert len(calls) == 3
