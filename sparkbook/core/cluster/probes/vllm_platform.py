"""Which vLLM and which torch platform this image really has (runs in the head's container).

usage: python3 -c SOURCE   (SOURCE = probes.source("vllm_platform"))
    -> {"vllm", "torch", "cuda", "gpus", "ray", "drain"[, "error"]}; "ray": Ray's version where its module and CLI
    are there; "drain": whether its CLI has --shutdown-timeout (read from its argument source, nothing imported)
"""
import importlib.metadata as md
import importlib.util
import pathlib
import shutil


def ray():
    try:
        return md.version("ray") if shutil.which("ray") else None
    except md.PackageNotFoundError:
        return None


def drain():
    spec = importlib.util.find_spec("vllm")
    for where in (spec.submodule_search_locations or []) if spec else []:
        args = pathlib.Path(where, "engine", "arg_utils.py")
        if args.is_file():
            return "--shutdown-timeout" in args.read_text(errors="replace")
    return False


def main():
    out = {"vllm": md.version("vllm"), "ray": ray(), "drain": drain()}
    try:
        import torch
        out.update(torch=torch.__version__, cuda=torch.cuda.is_available(), gpus=torch.cuda.device_count())
    except Exception as exc:
        out.update(torch=None, cuda=False, gpus=0, error=repr(exc))
    return out
