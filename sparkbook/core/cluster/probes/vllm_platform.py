"""Which vLLM and which torch platform this image really has (runs in the head's container).

usage: python3 -c SOURCE   (SOURCE = probes.source("vllm_platform"))
    -> {"vllm", "torch", "cuda", "gpus", "ray"[, "error"]}; "ray": Ray's version where its module and CLI are there
"""
import importlib.metadata as md
import shutil


def ray():
    try:
        return md.version("ray") if shutil.which("ray") else None
    except md.PackageNotFoundError:
        return None


def main():
    out = {"vllm": md.version("vllm"), "ray": ray()}
    try:
        import torch
        out.update(torch=torch.__version__, cuda=torch.cuda.is_available(), gpus=torch.cuda.device_count())
    except Exception as exc:
        out.update(torch=None, cuda=False, gpus=0, error=repr(exc))
    return out
