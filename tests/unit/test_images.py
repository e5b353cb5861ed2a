"""Image selection and distribution without a cluster: the in-image probes on fake site-packages, the
classification and decision on made-up probe results, the streamed copy through fake nodes."""
from __future__ import annotations

import dataclasses
import io
import json
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path
from types import SimpleNamespace

import pytest

from sparkbook.core.cluster import probes
from sparkbook.core.cluster.nodes import Result
from sparkbook.core.values.imagefacts import RegistryProbe
from sparkbook.stages.images import choice, distribute
from sparkbook.stages.images.choice import (
    FAILS_INSPECTION,
    LOADS,
    NOT_REGISTERED,
    Candidate,
    ImageFacts,
    InspectionProbe,
    ModelTarget,
    arch_covers,
    choose,
    classify,
)

REGISTRY = '''
import os
_TEXT_GENERATION_MODELS = {
    "LlamaForCausalLM": ("llama", "LlamaForCausalLM"),
    "HYV4ForCausalLM": ("vllm.models.hy_v4", "HYV4ForCausalLM"),
}
_TRANSFORMERS_SUPPORTED_MODELS: dict = {"Olmo2ForCausalLM": ("transformers", "TransformersForCausalLM")}
_VLLM_MODELS = {**_TEXT_GENERATION_MODELS}
_PREVIOUSLY_SUPPORTED_MODELS = {"OldForCausalLM": "0.10.2"}
'''


def run_probe(name: str, site: Path, *args: str) -> dict:
    """Run a probe script as the images do (`python3 -c SOURCE ARGS`) with `site` as its only extra path."""
    proc = subprocess.run([sys.executable, "-I", "-c", f"import sys; sys.path.insert(0, {str(site)!r}); "
                           f"exec(compile({probes.source(name)!r}, {name!r}, 'exec'))", *args],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return probes.parse(proc.stdout, node="here", probe=name)


@pytest.fixture
def site(tmp_path: Path) -> Path:
    """A fake site-packages whose vllm raises when imported: the registry probe must never import it."""
    vllm = tmp_path / "vllm"
    (vllm / "model_executor" / "models").mkdir(parents=True)
    (vllm / "models" / "hy_v4").mkdir(parents=True)
    (vllm / "__init__.py").write_text("raise RuntimeError('vllm was imported')\n")
    (vllm / "_version.py").write_text("__version__ = version = '0.99.1'\n")
    (vllm / "model_executor" / "models" / "registry.py").write_text(REGISTRY)
    (vllm / "model_executor" / "models" / "llama.py").write_text("")
    (vllm / "models" / "hy_v4" / "__init__.py").write_text("")
    return tmp_path


def test_registry_probe_reads_registry_without_importing_vllm(site: Path) -> None:
    doc = run_probe("registry", site, "HYV4ForCausalLM")
    assert doc["registered"] and doc["vllm_version"] == "0.99.1" and doc["n_architectures"] == 3
    assert doc["module"] == "vllm.models.hy_v4" and doc["module_present"] and not doc["transformers_backend"]
    llama = run_probe("registry", site, "LlamaForCausalLM")
    assert llama["module"] == "vllm.model_executor.models.llama" and llama["module_present"]


def test_registry_probe_not_registered_transformers_and_grafted_without_module(site: Path) -> None:
    assert run_probe("registry", site, "Qwen9ForCausalLM")["registered"] is False
    assert run_probe("registry", site, "Olmo2ForCausalLM")["transformers_backend"] is True
    (site / "vllm" / "models" / "hy_v4" / "__init__.py").unlink()
    assert run_probe("registry", site, "HYV4ForCausalLM")["module_present"] is False


def test_registry_probe_without_vllm(tmp_path: Path) -> None:
    assert "not installed" in run_probe("registry", tmp_path, "X")["error"]


def test_facts_probe_reads_versions_without_imports(tmp_path: Path) -> None:
    torch = tmp_path / "torch"
    torch.mkdir()
    (torch / "__init__.py").write_text("raise RuntimeError('torch was imported')\n")
    (torch / "version.py").write_text("from typing import Optional\ncuda: Optional[str] = None\n")
    doc = run_probe("facts", tmp_path)
    assert doc["torch_cuda"] is None and doc["cuda_archs"] == [] and doc["python"].startswith("3.")


def test_inspection_probe_reports_a_missing_vllm_as_json(tmp_path: Path) -> None:
    doc = run_probe("inspect_model", tmp_path, "HYV4ForCausalLM", "hy_v4")
    assert "vllm" in doc["error"] and "duration_s" in doc


@pytest.mark.parametrize(("archs", "cc", "ok"), [
    (["12.1a"], "12.1", True), (["sm_121"], "12.1", True), (["9.0", "10.0"], "12.1", False),
    (["8.0+PTX"], "12.1", True), (["compute_120"], "12.1", True), (["12.0"], "12.1", True), ([], "9.0", False)])
def test_arch_covers(archs: list[str], cc: str, ok: bool) -> None:
    assert arch_covers(archs, cc) is ok


# --- classification and decision -------------------------------------------------------------------------------
def facts(image: str, vllm: str, ray: str | None = "2.60.0", cuda: str | None = None,
          archs: list[str] | None = None) -> ImageFacts:
    return ImageFacts(image, "sha256:" + "0" * 64, 3_500_000_000, "3.11.2", vllm, "2.13.0", cuda, ray, "5.0",
                      archs or [], "", 0.5, ray_cli="/opt/venv/bin/ray" if ray else None, native_multinode=True)


def registry(image: str, registered: bool, transformers: bool = False) -> RegistryProbe:
    return RegistryProbe(image, "HYV4ForCausalLM", "x", registered, "vllm.models.hy_v4" if registered else None,
                         None, None, registered, transformers, 400, 1.2)


def inspection(image: str, ok: bool, *, cause: str = "", knows: bool = False) -> InspectionProbe:
    error = "" if ok else ("Model architectures ['HYV4ForCausalLM'] failed to be inspected" if cause
                           else "Model architectures ['HYV4ForCausalLM'] are not supported for now.")
    return InspectionProbe(image, "HYV4ForCausalLM", ok, "HYV4ForCausalLM" if ok else None,
                           f"ValueError: {error}" if error else "", error, cause, cause, knows, 5.0, 9.0)


def candidate(image: str, vllm: str, status: str, executor: str | None = "ray", **kw: object) -> Candidate:
    f = facts(image, vllm, **kw)  # type: ignore[arg-type]
    r = registry(image, status != NOT_REGISTERED)
    i = inspection(image, status == LOADS, cause="ImportError: cannot import name 'x'" if status == FAILS_INSPECTION
                   else "", knows=True)
    return Candidate(f, r, i, classify(f, r, i, executor=executor, capabilities={}))


def test_classify_the_three_cases_and_the_fallback_finding() -> None:
    old, graft, new = (candidate("old", "0.28.0", NOT_REGISTERED), candidate("graft", "0.28.0", FAILS_INSPECTION),
                       candidate("new", "0.32.0", LOADS))
    assert (old.verdict.status, graft.verdict.status, new.verdict.status) == (NOT_REGISTERED, FAILS_INSPECTION, LOADS)
    assert "Transformers fallback" in old.verdict.flags[0] and "not counted as support" in old.verdict.flags[0]
    assert "ImportError" in graft.verdict.summary
    assert new.verdict.usable and not new.verdict.flags


def test_classify_blocks_no_ray_and_missing_cuda_arch() -> None:
    f = facts("img", "0.32.0", ray=None, cuda="12.8", archs=["9.0", "10.0"])
    r, i = registry("img", True), inspection("img", True)
    v = classify(f, r, i, executor="ray", capabilities={"spark-1": ["12.1"]})
    assert v.status == LOADS and not v.usable
    assert any("no Ray" in b for b in v.blocking) and any("12.1" in b for b in v.blocking)
    assert classify(f, r, i, executor="mp", capabilities={}).usable


def test_an_image_without_ray_serves_unless_the_params_ask_for_ray() -> None:
    """Issue 45: stock vLLM images carry no Ray. Unset or mp: usable (04 forms no Ray, vLLM launches its own ranks);
    ray: rejected naming the remedy; a module without its CLI is no Ray; no --nnodes across nodes is no way at all."""
    r, i = registry("stock", True), inspection("stock", True)
    stock = facts("stock", "0.33.0", ray=None)
    assert classify(stock, r, i, executor=None, capabilities={}, multinode=True).usable
    assert classify(stock, r, i, executor="mp", capabilities={}, multinode=True).usable
    refused = classify(stock, r, i, executor="ray", capabilities={})
    assert not refused.usable and "serve.executor: mp" in refused.blocking[0]
    no_cli = dataclasses.replace(facts("half", "0.33.0"), ray_cli=None)
    assert no_cli.ray is None and "without the ray CLI" in classify(no_cli, r, i, executor="ray",
                                                                     capabilities={}).blocking[0]
    old = dataclasses.replace(stock, native_multinode=False)
    assert "has no --nnodes" in classify(old, r, i, executor=None, capabilities={}, multinode=True).blocking[0]
    assert classify(old, r, i, executor=None, capabilities={}, multinode=False).usable, "one node needs no --nnodes"


def test_on_a_tie_of_vllm_versions_the_image_with_ray_wins_and_a_newer_one_without_it_serves() -> None:
    d = choose([candidate("stock", "0.32.0", LOADS, None, ray=None), candidate("with-ray", "0.32.0", LOADS, None)], [])
    assert d.choice == "with-ray" and "has no Ray" in d.alternatives[0].rejected_because
    d = choose([candidate("stock", "0.33.0", LOADS, None, ray=None), candidate("with-ray", "0.32.0", LOADS, None)], [])
    assert d.choice == "stock" and "Ray absent" in d.reason and "newer vLLM" in d.alternatives[0].rejected_because


def test_choose_rejects_each_with_its_reason() -> None:
    cands = [candidate("old", "0.28.0", NOT_REGISTERED), candidate("graft", "0.28.0", FAILS_INSPECTION),
             candidate("new", "0.32.0", LOADS), candidate("newer-no-ray", "0.33.0", LOADS, ray=None)]
    d = choose(cands, ["logs/x.txt"])
    assert d.choice == "new"
    reasons = {a.option: a.rejected_because for a in d.alternatives}
    assert "does not register" in reasons["old"] and "fails inspection" in reasons["graft"]
    assert "no Ray" in reasons["newer-no-ray"] and "logs/x.txt" in d.evidence


def test_choose_prefers_the_newest_of_several_and_fails_without_any() -> None:
    d = choose([candidate("a", "0.30.0", LOADS), candidate("b", "0.32.0", LOADS)], [])
    assert d.choice == "b" and "newer vLLM" in d.alternatives[0].rejected_because
    with pytest.raises(choice.NoUsableImage, match="old"):
        choose([candidate("old", "0.28.0", NOT_REGISTERED)], [])


def test_model_target_from_state_else_from_config_on_the_head() -> None:
    head = SimpleNamespace(name="h", read_text=lambda path: json.dumps(
        {"architectures": ["HYV4ForCausalLM"], "model_type": "hy_v4"}) if path == "/m/config.json" else "")
    ctx = SimpleNamespace(head=head, params=SimpleNamespace(model=SimpleNamespace(path="/m")))
    assert choice.model_target(ctx, None) == ModelTarget("HYV4ForCausalLM", "hy_v4", "/m", "config.json on h")
    recorded = SimpleNamespace(architectures=["A"], model_type="t", dir_on_nodes="/d")
    assert choice.model_target(ctx, recorded).source == "state (02-diagnosis)"


# --- distribution ---------------------------------------------------------------------------------------------
def result(node: str, argv: list[str], code: int = 0, out: str = "") -> Result:
    return Result(node, tuple(argv), code, out, "", datetime.now(UTC), 0.1)


class FakeNode:
    """stream(): `docker save` writes `payload`; `docker load` reads everything into `received`."""

    def __init__(self, name: str, payload: bytes = b""):
        self.name, self.payload, self.received = name, payload, bytearray()
        self.connected = False

    def connect(self) -> None:
        self.connected = True

    def streaming(self) -> FakeNode:
        return self

    def stream(self, argv, *, source=None, sink=None, timeout=None, on_bytes=None):  # type: ignore[no-untyped-def]
        if sink is not None:
            data = io.BytesIO(self.payload)
            while chunk := data.read(1 << 16):
                sink.write(chunk)
        if source is not None:
            while chunk := source.read(1 << 16):
                self.received += chunk
                on_bytes(len(chunk))
            return result(self.name, argv, out="Loaded image: img:1")
        return result(self.name, argv)


def test_copy_image_streams_the_head_save_into_the_node_load(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPARKBOOK_HEADLESS", "1")
    payload = bytes(range(256)) * 40_000
    head, worker = FakeNode("h", payload), FakeNode("w")
    ctx = SimpleNamespace(head=head)
    copy = distribute.copy_image(ctx, "img:1", worker, len(payload))
    assert worker.connected, "the loading side is reached before the head's docker save starts"
    assert bytes(worker.received) == payload and copy.bytes == len(payload) and not copy.error
    assert copy.loaded == "Loaded image: img:1" and copy.mb_s > 0


def test_plan_and_distribution_messages() -> None:
    p = distribute.ImageCopyPlan("img:1", "h", "sha256:a", 10, {"h": "sha256:a", "w1": None, "w2": "sha256:b"})
    assert p.to_copy == ["w1", "w2"]
    same = distribute.Distribution("img:1", "sha256:a", [], ["h", "w1"], {"h": "sha256:a", "w1": "sha256:a"})
    assert same.verified and "nothing copied" in same.message
    copied = distribute.Distribution("img:1", "sha256:a", [distribute.Copy("w1", 2_000_000_000, 20.0, "Loaded")],
                                     ["h"], {"h": "sha256:a", "w1": "sha256:a"})
    assert copied.verified and "100.0 MB/s" in copied.message and copied.rows()[1]["matches head"]
    differs = distribute.Distribution("img:1", "sha256:a", [], [], {"h": "sha256:a", "w1": "sha256:b"})
    assert not differs.verified


# --- GPUs in the probes: the node's driver, CPU and CUDA architectures --------------------------------------------
DATA = Path(__file__).parent / "data"


def _lines(name: str) -> list[str]:
    return [line for line in (DATA / name).read_text().splitlines() if line and not line.startswith("#")]


@pytest.mark.parametrize("error", _lines("cuda-driver-errors.txt"))
def test_a_driver_error_is_the_nodes_not_a_rejection_of_the_image(error: str) -> None:
    f, r = facts("cuda", "0.32.0", cuda="13.0", archs=["12.1a"]), registry("cuda", True)
    i = InspectionProbe("cuda", "HYV4ForCausalLM", False, None, f"ImportError: {error}", error, f"ImportError: {error}",
                        error, False, 5.0, 9.0)
    v = classify(f, r, i, executor="ray", capabilities={})
    assert v.status == choice.NODE_DRIVER and error[:100] in v.summary and "not the image" in v.summary
    c = Candidate(f, r, i, v)
    with pytest.raises(choice.NoUsableImage) as raised:
        choose([c], [])
    assert "NVIDIA driver or container toolkit" in raised.value.remediation
    assert choice.failure_reports([c]).startswith("no candidate registers")  # not reported as a graft


@pytest.mark.parametrize("error", _lines("cuda-image-errors.txt"))
def test_an_image_error_is_not_a_driver_error(error: str) -> None:
    assert choice.driver_error(error) is None
    f, r = facts("cuda", "0.32.0", cuda="13.0"), registry("cuda", True)
    i = InspectionProbe("cuda", "HYV4ForCausalLM", False, None, "ValueError: failed to be inspected",
                        "failed to be inspected", error, error, False, 5.0, 9.0)
    assert classify(f, r, i, executor="ray", capabilities={}).status == FAILS_INSPECTION


@pytest.mark.parametrize(("archs", "cc", "ok"), [
    (["12.0"], "12.1", True), (["sm_120"], "12.1", True), (["12.0f"], "12.1", True), (["12.0a"], "12.1", False),
    (["sm_90"], "9.0", True), (["9.0a"], "9.0", True), (["8.0"], "9.0", False), (["8.6"], "8.0", False),
    (["12.1"], "12.0", False), (["10.0"], "12.1", False)])
def test_same_major_lower_minor_cubins_run(archs: list[str], cc: str, ok: bool) -> None:
    assert arch_covers(archs, cc) is ok


def test_cpu_architecture_must_match_every_node() -> None:
    sparks = {"spark-1": "aarch64", "spark-2": "aarch64"}
    assert choice.arch_mismatch("arm64", sparks) == [] and choice.arch_mismatch(None, sparks) == []
    f = dataclasses.replace(facts("amd", "0.32.0"), architecture="amd64")
    v = classify(f, registry("amd", True), inspection("amd", True), executor="ray", capabilities={}, machines=sparks)
    assert v.status == LOADS and not v.usable
    assert v.blocking == [f"the image is linux/amd64, {n} is aarch64 (arm64): it does not run there (exec format "
                          "error)" for n in sparks]
    mixed = classify(f, registry("amd", True), inspection("amd", True), executor="ray", capabilities={},
                     machines={"head": "x86_64", "spark-2": "aarch64"})
    assert [b.split(",")[1] for b in mixed.blocking] == [" spark-2 is aarch64 (arm64): it does not run there (exec format error)"]


def test_an_image_of_another_cpu_than_the_head_is_not_run() -> None:
    why = choice.arch_mismatch("amd64", {"spark-1": "aarch64"})[0]
    r, i = choice._not_probed("amd", "HYV4ForCausalLM", why)
    f = dataclasses.replace(facts("amd", "0.32.0"), architecture="amd64", error=why)
    v = classify(f, r, i, executor="ray", capabilities={}, machines={"spark-1": "aarch64"})
    assert v.status == choice.WRONG_CPU and v.blocking == [why]
    with pytest.raises(choice.NoUsableImage, match="linux/amd64, spark-1 is aarch64"):
        choose([Candidate(f, r, i, v)], [])


def test_probes_get_the_gpus_params_list_for_their_node() -> None:
    from sparkbook.core.cluster import imageprobes
    seen: list[tuple[str, bool]] = []

    class Runtime:
        def one_off(self, node, image, argv, *, env, timeout, gpus):  # type: ignore[no-untyped-def]
            seen.append((node.name, gpus))

    specs = {"gpu": SimpleNamespace(gpus=[0, 1]), "cpu": SimpleNamespace(gpus=[])}
    ctx = SimpleNamespace(runtime=Runtime(), params=SimpleNamespace(node=specs.__getitem__))
    for name in specs:
        imageprobes.in_image(ctx, SimpleNamespace(name=name), "img", ["true"], {}, 5)  # type: ignore[arg-type]
    assert seen == [("gpu", True), ("cpu", False)]


@pytest.mark.parametrize(("record", "covering", "not_covering"), [
    ("nvidia-smi-h200.txt", ["sm_90"], ["sm_89", "sm_100"]), ("nvidia-smi-gb10.txt", ["sm_120"], ["sm_120a", "sm_90"])])
def test_recorded_compute_capabilities(record: str, covering: list[str], not_covering: list[str]) -> None:
    """The compute_cap that nvidia-smi reported on a real H200 (9.0) and GB10 (12.1)."""
    cc = (DATA / record).read_text().split("==gpu==\n", 1)[1].splitlines()[0].split(",")[1].strip()
    assert arch_covers(covering, cc)
    assert not any(arch_covers([entry], cc) for entry in not_covering)


# --- runtime.image_policy ----------------------------------------------------------------------------------------
def test_keep_installed_keeps_a_working_installed_image_on_every_node() -> None:
    cands = [candidate("old", "0.28.0", LOADS), candidate("new", "0.32.0", LOADS)]
    same = {"h": "sha256:" + "0" * 64, "w": "sha256:" + "0" * 64}
    d = choose(cands, [], "keep_installed", "old", same)
    assert d.choice == "old" and d.reason.startswith("image_policy keep_installed")
    assert "a newer image was not needed" in d.alternatives[0].rejected_because
    newest = choose(cands, [], "newest", "old", same)
    assert newest.choice == "new" and newest.reason.startswith("image_policy newest")


def test_keep_installed_falls_back_to_the_newest_and_says_why() -> None:
    loads, fails = candidate("old", "0.28.0", LOADS), candidate("old", "0.28.0", NOT_REGISTERED)
    new = candidate("new", "0.32.0", LOADS)
    one_missing = {"h": "sha256:" + "0" * 64, "w": None}
    d = choose([loads, new], [], "keep_installed", "old", one_missing)
    assert d.choice == "new" and "not on every node under one ID" in d.reason and "w: absent" in d.reason
    d = choose([fails, new], [], "keep_installed", "old", {"h": "sha256:" + "0" * 64})
    assert d.choice == "new" and "is not a usable candidate" in d.reason
    assert "no runtime.installed_image" in choose([loads, new], [], "keep_installed", None, {}).reason
