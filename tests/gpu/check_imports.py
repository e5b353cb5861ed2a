"""After stage.sh installed the wheels: is everything the runbook needs importable, and is every
requirement of the carried wheels met (by what was carried or what the machine has)?
    PYTHONPATH=/tmp/site:REPO JUPYTER_PATH=/tmp/site/share/jupyter python3 tests/gpu/check_imports.py [--smoke]
--smoke also runs a one-cell notebook through papermill with the kernel named python3.
Exit status 0 = all good."""
import importlib
import importlib.metadata as md
import os
import sys
import tempfile
import time

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name as canon

SITE = os.environ.get("SITE", "/tmp/site")
# module -> distribution, in the order they are imported (vllm last: it is the slow one)
MODULES = {
    "yaml": "pyyaml", "pydantic": "pydantic", "paramiko": "paramiko", "docker": "docker", "httpx": "httpx",
    "aiohttp": "aiohttp", "numpy": "numpy", "pandas": "pandas", "matplotlib": "matplotlib",
    "nbformat": "nbformat", "nbclient": "nbclient", "jupyter_client": "jupyter-client", "ipykernel": "ipykernel",
    "IPython": "ipython", "ipywidgets": "ipywidgets", "ipyparallel": "ipyparallel", "papermill": "papermill",
    "sparkbook": "sparkbook", "torch": "torch", "ray": "ray", "vllm": "vllm",
}
# left out of the carried set on purpose (not needed for bf16 text generation; see notes/gpu-facts.md)
SKIPPED = {canon(n) for n in """
flashinfer-python flashinfer-cubin nvidia-cutlass-dsl nvidia-cutlass-dsl-libs-base nvidia-cutlass-dsl-libs-cu13
tilelang z3-solver tokenspeed-mla tokenspeed-triton humming-kernels pyelftools quack-kernels torch-c-dlpack-ext
torchcodec pynvvideocodec nvtx nvidia-cudnn-frontend fastsafetensors cuda-tile cuda-python nvidia-cuda-nvcc
nvidia-cuda-cccl nvidia-cuda-crt nvidia-nvvm nvidia-cuda-tileiras opentelemetry-sdk opentelemetry-api
opentelemetry-exporter-otlp opentelemetry-semantic-conventions-ai mcp mcp-types pyjwt sse-starlette
pydantic-settings python-dotenv anthropic docstring-parser mistral-common pycountry outlines-core
fastapi-cli fastapi-cloud-cli email-validator rich-toolkit sentry-sdk rignore fastar
""".split()}
bad = []


def requirements() -> None:
    installed = {}
    for d in md.distributions():
        installed.setdefault(canon(d.metadata["Name"]), d.version)
    env, unmet, skipped = {"extra": ""}, [], set()
    for d in md.distributions(path=[SITE]):
        for r in d.requires or []:
            req = Requirement(r)
            if req.marker is not None and not req.marker.evaluate(env):
                continue
            n = canon(req.name)
            if n in SKIPPED:
                skipped.add(n)
            elif n not in installed:
                unmet.append(f"{d.metadata['Name']} needs {req}: MISSING")
            elif req.specifier and not req.specifier.contains(installed[n], prereleases=True):
                unmet.append(f"{d.metadata['Name']} needs {req}: have {installed[n]} (soft)")
    print(f"requirements: {len(skipped)} skipped on purpose; " + ("all others met" if not unmet else ""))
    for u in unmet:
        print("  " + u)
    bad.extend(u for u in unmet if "MISSING" in u)


def kernelspec() -> None:
    from jupyter_client.kernelspec import KernelSpecManager

    spec = KernelSpecManager().get_kernel_spec("python3")
    print(f"kernelspec python3: {spec.resource_dir}\n  argv {spec.argv}\n  env {spec.env}")
    if spec.argv[0] != sys.executable:
        bad.append(f"kernel python {spec.argv[0]} is not this python {sys.executable}")


def smoke() -> None:
    import nbformat
    import papermill

    code = ("import os, sys, sparkbook, IPython, pandas\n"
            "print('KERNEL', sys.executable, sys.version.split()[0], 'sparkbook at', sparkbook.__file__)\n"
            "print('KERNEL NCCL_NVLS_ENABLE', os.environ.get('NCCL_NVLS_ENABLE'))")
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("x = 1", metadata={"tags": ["parameters"]}),
                                         nbformat.v4.new_code_cell(code)])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    with tempfile.TemporaryDirectory() as tmp:
        src, dst = os.path.join(tmp, "in.ipynb"), os.path.join(tmp, "out.ipynb")
        nbformat.write(nb, src)
        t0 = time.monotonic()
        try:
            out = papermill.execute_notebook(src, dst, kernel_name="python3", parameters={"x": 2},
                                             progress_bar=False, cwd=tmp)
        except Exception as exc:
            bad.append(f"papermill smoke: {type(exc).__name__}: {exc}")
            return
        text = "".join(o.get("text", "") for o in out.cells[-1].outputs)
        print(f"papermill smoke ({time.monotonic() - t0:.1f} s): {text.strip()}")
        if "KERNEL" not in text:
            bad.append("papermill smoke printed nothing")


def imports() -> None:
    for mod, dist in MODULES.items():
        t0 = time.monotonic()
        try:
            m = importlib.import_module(mod)
            try:
                ver = md.version(dist)
            except md.PackageNotFoundError:
                ver = getattr(m, "__version__", "?")
            where = os.path.dirname(getattr(m, "__file__", "") or "")
            print(f"  {mod:15s} {ver:22s} {time.monotonic() - t0:5.1f} s  {where}")
            if mod == "torch":
                print(f"  {'':15s} CUDA devices: {m.cuda.device_count()}, torch CUDA {m.version.cuda}")
        except Exception as exc:  # every failure is listed, none hides another
            print(f"  {mod:15s} FAILED: {type(exc).__name__}: {str(exc)[:300]}")
            bad.append(f"import {mod}")


if __name__ == "__main__":
    print(f"python {sys.executable} {sys.version.split()[0]}; PYTHONPATH={os.environ.get('PYTHONPATH')}")
    requirements()
    imports()
    kernelspec()
    if "--smoke" in sys.argv:
        smoke()
    print("IMPORT CHECK " + ("OK" if not bad else "FAILED:\n  " + "\n  ".join(bad)))
    sys.exit(1 if bad else 0)
