"""Which vLLM and which torch platform this image really has (runs in the head's container).

usage: python3 -c SOURCE   (SOURCE = probes.source("vllm_platform")) -> {"vllm", "torch", "cuda", "gpus"[, "error"]}
"""
import importlib.metadata as md


def main():
    out = {"vllm": md.version("vllm")}
    try:
        import torch
        out.update(torch=torch.__version__, cuda=torch.cuda.is_available(), gpus=torch.cuda.device_count())
    except Exception as exc:
        out.update(torch=None, cuda=False, gpus=0, error=repr(exc))
    return out
