"""Have this environment's vLLM resolve and inspect an architecture the way `vllm serve` does at start-up.

usage: python3 -c SOURCE ARCHITECTURE [MODEL_TYPE]   (SOURCE = probes.source("inspect_model")) -> its document
Native implementation only (model_impl="vllm"): a Transformers-backend fallback is reported separately
(`transformers_knows`), never counted as support. vLLM caches inspection results under VLLM_CACHE_ROOT,
so every run uses a fresh one and removes it afterwards.
"""
import os
import shutil
import sys
import tempfile
import time
import traceback
import types

CACHE = tempfile.mkdtemp(prefix="sparkbook-inspect-")
os.environ["VLLM_CACHE_ROOT"] = CACHE
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")


def short(text):
    """vLLM's message without the list of every supported architecture it appends."""
    return text.split(" Supported architectures:")[0].strip()


def last_line(exc):
    lines = [line for line in short(str(exc)).splitlines() if line.strip()]
    return f"{type(exc).__name__}: {lines[-1] if lines else ''}"[:600]


def root_cause(exc):
    """The innermost error vLLM's subprocess reported (e.g. the ImportError behind a failed inspection)."""
    text = str(exc)
    for marker in ("ImportError", "ModuleNotFoundError", "AttributeError", "NameError", "TypeError"):
        hits = [line.strip() for line in text.splitlines() if line.strip().startswith(marker)]
        if hits:
            return hits[-1][:600]
    return last_line(exc)


def transformers_view(arch, model_type):
    """Would vLLM's Transformers backend take this model (under --model-impl auto)?"""
    try:
        import transformers
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    except Exception as exc:
        return {"transformers_version": None, "transformers_knows": False, "transformers_error": last_line(exc)}
    knows = bool(model_type) and model_type in CONFIG_MAPPING_NAMES or hasattr(transformers, arch)
    return {"transformers_version": transformers.__version__, "transformers_knows": knows}


def probe(arch, model_type):
    t0 = time.monotonic()
    import vllm
    from vllm.model_executor.models.registry import ModelRegistry

    out = {"vllm_version": getattr(vllm, "__version__", None), "import_s": round(time.monotonic() - t0, 2),
           "registered": arch in ModelRegistry.get_supported_archs()}
    config = types.SimpleNamespace(model_impl="vllm", runner_type="generate", convert_type="none")
    t1 = time.monotonic()
    try:
        info, resolved = ModelRegistry.inspect_model_cls([arch], config)
        out.update(inspected=True, resolved=resolved, text_generation=bool(info.is_text_generation_model))
    except Exception as exc:
        out.update(inspected=False, error=short(str(exc))[-3000:], error_line=last_line(exc))
        if arch in getattr(ModelRegistry, "models", {}):
            try:
                ModelRegistry.models[arch].inspect_model_cls()
            except Exception as inner:
                out.update(cause=root_cause(inner), cause_text=str(inner).strip()[-3000:])
    out["inspect_s"] = round(time.monotonic() - t1, 2)
    out.update(transformers_view(arch, model_type))
    return out


def main():
    t0 = time.monotonic()
    try:
        result = probe(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "")
    except Exception as exc:  # reported, not raised: the caller reads the document
        result = {"error": last_line(exc), "traceback": traceback.format_exc()[-3000:]}
    finally:
        shutil.rmtree(CACHE, ignore_errors=True)
    result["duration_s"] = round(time.monotonic() - t0, 2)
    return result
