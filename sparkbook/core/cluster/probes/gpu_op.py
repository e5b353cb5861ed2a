"""One GPU operation in an image: a small matmul with the image's torch on device 0, then one of vLLM's own
compiled kernels (silu_and_mul from vllm._C), each timed; every error text kept whole for 03 to classify.

usage: python3 -c SOURCE   (SOURCE = probes.source("gpu_op")) -> its document, as probes/__init__.py says
Why: the CUDA architectures torch was built for (facts.py) say what should run; only launching a kernel says what
does. An image whose kernels lack the GPU's architecture fails at the first launch with "no kernel image is
available for execution on the device", which `vllm serve` would hit only after loading the weights.
"""
import time
import traceback
import warnings


def _error(exc):
    return f"{type(exc).__name__}: {exc}"[:2000]


def torch_op():
    """(document part, torch module or None): device name and capability, the matmul's time or its error."""
    out = {"device": None, "capability": None, "matmul_ms": None, "torch_error": None, "warnings": []}
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            import torch
            if not torch.cuda.is_available():
                out["torch_error"] = "torch.cuda.is_available() is False"
                return out, None
            out["device"] = torch.cuda.get_device_name(0)
            major, minor = torch.cuda.get_device_capability(0)
            out["capability"] = f"{major}.{minor}"
            t0 = time.monotonic()
            a = torch.randn(256, 256, device="cuda")
            (a @ a).sum().item()
            torch.cuda.synchronize()
            out["matmul_ms"] = round((time.monotonic() - t0) * 1000, 1)
        out["warnings"] = [str(w.message)[:600] for w in caught if "CUDA capability" in str(w.message)]
        return out, torch
    except Exception as exc:
        out["torch_error"] = _error(exc)
        out["warnings"] = [str(w.message)[:600] for w in caught if "CUDA capability" in str(w.message)]
        return out, None


def vllm_op(torch):
    """vLLM's compiled silu_and_mul on the device: "ran", "absent: ..." (no vllm._C or no such op) or the error."""
    try:
        import vllm._C  # noqa: F401  (registers torch.ops._C)
    except ImportError as exc:
        return {"vllm_op": f"absent: {_error(exc)}", "vllm_op_ms": None}
    except Exception as exc:
        return {"vllm_op": _error(exc), "vllm_op_ms": None}
    op = getattr(torch.ops._C, "silu_and_mul", None)
    if op is None:
        return {"vllm_op": "absent: torch.ops._C.silu_and_mul", "vllm_op_ms": None}
    try:
        t0 = time.monotonic()
        x = torch.randn(8, 256, device="cuda", dtype=torch.float16)
        out = torch.empty(8, 128, device="cuda", dtype=torch.float16)
        op(out, x)
        torch.cuda.synchronize()
        return {"vllm_op": "ran", "vllm_op_ms": round((time.monotonic() - t0) * 1000, 1)}
    except Exception:
        return {"vllm_op": traceback.format_exc(limit=2)[-2000:], "vllm_op_ms": None}


def main():
    doc, torch = torch_op()
    doc.update(vllm_op(torch) if torch is not None else {"vllm_op": None, "vllm_op_ms": None})
    return doc
