"""Lab images and models, checked on the builder daemon (not the namespaced nodes).

Each check runs a container with ``--network host`` on the builder and removes it by name afterwards.
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import pytest

from sparkbook.lab.builder import DOCKERD, LAB_HOME, docker_cmd, image_id, image_label
from sparkbook.lab.imagebuild import BASE, GRAFT, LAB_IMAGES, NEW, NEW_VLLM, OLD, OLD_VLLM, ensure_images, load_images
from sparkbook.lab.models import MODEL_NAMES, ensure_models

pytestmark = [pytest.mark.lab,
              pytest.mark.skipif(os.geteuid() != 0 or not Path(DOCKERD).exists(), reason="needs root and dockerd")]

ARCH = "HYV4ForCausalLM"
SERVE_ENV = {"HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
SERVE_ARGS = ["--dtype", "float32", "--enforce-eager", "--max-model-len", "2048", "--kv-cache-memory-bytes", "128M",
              "--max-num-seqs", "16", "--model-impl", "vllm"]
PROBE = r"""
import json, sys, types
from vllm.model_executor.models.registry import ModelRegistry
arch = sys.argv[1]
cfg = types.SimpleNamespace(model_impl="vllm", runner_type="generate", convert_type="none")
out = {"registered": arch in ModelRegistry.get_supported_archs()}
try:
    ModelRegistry.inspect_model_cls([arch], cfg)
    out["inspect"] = "ok"
except Exception as e:
    out["inspect"] = f"{type(e).__name__}: {e}"
print("PROBE " + json.dumps(out))
"""


@pytest.fixture(scope="module")
def images() -> dict[str, str]:
    return ensure_images()


@pytest.fixture(scope="module")
def models(images: dict[str, str]) -> dict[str, Path]:
    return ensure_models()


def container_name(what: str) -> str:
    return f"sparkbook-test-{what}-{uuid.uuid4().hex[:8]}"


def remove(name: str) -> None:
    subprocess.run(docker_cmd("rm", "-f", name), capture_output=True)


def run_in(image: str, *argv: str, stdin: str | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    """Run ``argv`` in a throwaway host-network container of ``image`` on the builder."""
    name = container_name("run")
    cmd = docker_cmd("run", "--rm", "-i", "--name", name, "--network", "host", "-e", "VLLM_NO_USAGE_STATS=1",
                     "-e", "HF_HUB_OFFLINE=1", image, *argv)
    try:
        return subprocess.run(cmd, input=stdin or "", capture_output=True, text=True, timeout=timeout)
    finally:
        remove(name)


def test_images_built_and_labelled(images: dict[str, str]) -> None:
    assert set(images) == set(LAB_IMAGES)
    roles = {BASE: "base", OLD: "old", NEW: "new", GRAFT: "grafted"}
    for tag, role in roles.items():
        assert images[tag] == image_id(tag)
        assert image_label(tag, "org.sparkbook.lab.role") == role
    assert image_label(NEW, "org.sparkbook.lab.vllm") == NEW_VLLM
    assert image_label(GRAFT, "org.sparkbook.lab.vllm") == OLD_VLLM


def test_warm_ensure_is_fast(images: dict[str, str]) -> None:
    t0 = time.monotonic()
    assert ensure_images() == images
    assert time.monotonic() - t0 < 30


def test_base_has_python(images: dict[str, str]) -> None:
    res = run_in(BASE, "python3", "--version")
    assert res.returncode == 0 and res.stdout.startswith("Python 3.11"), res.stdout + res.stderr


@pytest.mark.parametrize("tag,version", [(OLD, OLD_VLLM), (NEW, NEW_VLLM), (GRAFT, OLD_VLLM)])
def test_vllm_version(images: dict[str, str], tag: str, version: str) -> None:
    res = run_in(tag, "vllm", "--version")
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.strip().splitlines()[-1] == f"{version}+cpu"


def probe(tag: str) -> tuple[dict[str, object], str]:
    """Registry membership and inspection of ARCH in ``tag``, and the container's log (the child's traceback)."""
    res = run_in(tag, "python", "-", ARCH, stdin=PROBE)
    lines = [line for line in res.stdout.splitlines() if line.startswith("PROBE ")]
    assert lines, res.stdout[-2000:] + res.stderr[-2000:]
    return json.loads(lines[-1][len("PROBE "):]), res.stdout + res.stderr


def test_new_image_registers_and_inspects_hyv4(images: dict[str, str]) -> None:
    assert probe(NEW)[0] == {"registered": True, "inspect": "ok"}


def test_old_image_refuses_hyv4(images: dict[str, str]) -> None:
    out, _ = probe(OLD)
    assert out["registered"] is False
    assert "not supported for now" in str(out["inspect"])


def test_grafted_image_registers_but_fails_inspection(images: dict[str, str]) -> None:
    out, log = probe(GRAFT)
    assert out["registered"] is True
    assert "failed to be inspected" in str(out["inspect"])
    assert "ImportError: cannot import name 'hpc_gated_mla_gemm'" in log


def test_models_complete(models: dict[str, Path]) -> None:
    assert set(models) == set(MODEL_NAMES)
    for path in models.values():
        config = json.loads((path / "config.json").read_text())
        assert config["vocab_size"] == 2048
        assert {"model.safetensors", "tokenizer.json", "generation_config.json"} <= {p.name for p in path.iterdir()}
    assert json.loads((models["hyv4-tiny"] / "config.json").read_text())["architectures"] == [ARCH]
    assert ensure_models() == models


def free_port() -> int:
    for port in range(18000 + os.getpid() % 900, 19000):
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) != 0:
                return port
    raise RuntimeError("no free port in 18000-18999")


def wait_ready(name: str, url: str, timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        state = subprocess.run(docker_cmd("inspect", "-f", "{{.State.Running}}", name), capture_output=True, text=True)
        if state.stdout.strip() != "true":
            break
        time.sleep(2)
    logs = subprocess.run(docker_cmd("logs", "--tail", "60", name), capture_output=True, text=True)
    pytest.fail(f"{name} not ready at {url}:\n{logs.stdout[-4000:]}{logs.stderr[-4000:]}")


def chat(url: str, model: str) -> str:
    body = {"model": model, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 16,
            "temperature": 0}
    req = urllib.request.Request(url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.load(r)["choices"][0]["message"]["content"]


# slow: make test serves both builds already, the new one in every whole run (01-06) and the old one as the lab's old
# deployment (old-vllm, waited for before the full run's 01); this serves each from a bare `docker run`.
@pytest.mark.slow
@pytest.mark.parametrize("tag,model,extra", [(NEW, "hyv4-tiny", ["--attention-backend", "CPU_MLA"]),
                                             (OLD, "qwen3-tiny", [])])
def test_serves_chat(models: dict[str, Path], tag: str, model: str, extra: list[str]) -> None:
    port, name = free_port(), container_name("serve")
    env = [a for k, v in SERVE_ENV.items() for a in ("-e", f"{k}={v}")]
    cmd = docker_cmd("run", "-d", "--name", name, "--network", "host", "--shm-size", "1g", *env,
                     "-v", f"{models[model]}:/m:ro", tag, "vllm", "serve", "/m", "--served-model-name", model,
                     "--host", "127.0.0.1", "--port", str(port), *SERVE_ARGS, *extra)
    try:
        subprocess.run(cmd, check=True, capture_output=True)
        url = f"http://127.0.0.1:{port}"
        wait_ready(name, url)
        assert chat(url, model).strip()
    finally:
        remove(name)


@pytest.mark.slow  # make test: `lab up` loads the images into every node's daemon, and each reset skips them
def test_load_images_into_another_daemon(images: dict[str, str]) -> None:
    """load_images copies the base into a fresh daemon, then skips it when asked again."""
    root = Path(tempfile.mkdtemp(prefix="ld-", dir=LAB_HOME))
    sock = f"unix://{root}/d.sock"
    proc = subprocess.Popen([DOCKERD, "--data-root", f"{root}/data", "--exec-root", f"{root}/exec", "-H", sock,
                             "--pidfile", f"{root}/pid", "--iptables=false", "--bridge=none"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    lines: list[str] = []
    try:
        deadline = time.monotonic() + 60
        while subprocess.run(docker_cmd("version", host=sock), capture_output=True).returncode != 0:
            assert time.monotonic() < deadline and proc.poll() is None, "temporary dockerd did not start"
            time.sleep(0.5)
        load_images(sock, [BASE], lines.append)
        assert image_id(BASE, host=sock) == images[BASE]
        lines.clear()
        load_images(sock, [BASE], lines.append)
        assert any("already in" in line for line in lines), lines
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        subprocess.run(["umount", f"{root}/exec/netns/default"], capture_output=True)
        shutil.rmtree(root, ignore_errors=True)
