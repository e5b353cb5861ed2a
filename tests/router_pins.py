"""Writes sparkbook/stages/serve/router-pins/pyX.Y-MACHINE.txt for each target below (`make router-pins`): pip
resolves vllm-router==VERSION for that Python and machine from PyPI (wheels only, the node's manylinux tags), each
wheel it downloaded is pinned by name, version and sha256, and the file is then checked: pip's --require-hashes
--no-deps download of it must fetch exactly that set. `--check` checks the existing files without rewriting them.
A target added here and run gives `download()` a pins file for it; nothing else names the targets."""
from __future__ import annotations

import hashlib
import subprocess
import sys
import tempfile
from pathlib import Path

from sparkbook.stages.serve import router

# (Python X.Y, machine): the lab (3.11 x86_64), the GPU device machine (3.12 x86_64), DGX Spark's Ubuntu 24.04 (3.12
# aarch64), and their neighbours
TARGETS = [(py, m) for py in ("3.10", "3.11", "3.12", "3.13") for m in ("x86_64", "aarch64")]


def pip_download(into: Path, python: str, machine: str, *what: str) -> list[Path]:
    argv = [sys.executable, "-m", "pip", "download", "-q", "--no-cache-dir", "--only-binary=:all:",
            *router.pip_platforms(machine), f"--python-version={python}", "--implementation=cp", "-d", str(into),
            *what]
    subprocess.run(argv, check=True)
    return sorted(into.glob("*.whl"))


def written(python: str, machine: str) -> str:
    with tempfile.TemporaryDirectory() as tmp:
        wheels = pip_download(Path(tmp), python, machine, f"vllm-router=={router.VERSION}")
        lines = []
        for w in wheels:
            name, version = w.name.split("-")[:2]
            lines.append(f"{router.canonical(name)}=={version} "
                         f"--hash=sha256:{hashlib.sha256(w.read_bytes()).hexdigest()}  # {w.name}")
    return (f"# vllm-router {router.VERSION} and every wheel it needs for CPython {python} on {machine} (manylinux), "
            "pinned by sha256;\n# written by `make router-pins` (tests/router_pins.py) from PyPI: do not edit by hand\n"
            + "\n".join(sorted(lines)) + "\n")


def checked(python: str, machine: str) -> None:
    """pip downloads exactly the pinned set with --require-hashes --no-deps; AssertionError naming the difference."""
    path = router.pins_file(python, machine)
    want = router.pins(path)
    with tempfile.TemporaryDirectory() as tmp:
        got = pip_download(Path(tmp), python, machine, "--no-deps", "--require-hashes", "-r", str(path))
        have = {router.canonical(w.name.split("-")[0]): (w.name.split("-")[1],
                                                         hashlib.sha256(w.read_bytes()).hexdigest()) for w in got}
    assert have == want, f"{path.name}: pip downloaded {sorted(set(have.items()) ^ set(want.items()))} differently"
    assert want.get("vllm-router", ("",))[0] == router.VERSION, f"{path.name} does not pin vllm-router {router.VERSION}"


def main(argv: list[str]) -> int:
    only = [a for a in argv if a != "--check"]
    for python, machine in TARGETS:
        if only and f"py{python}-{machine}" not in only:
            continue
        if "--check" not in argv:
            router.PINS.mkdir(exist_ok=True)
            router.pins_file(python, machine).write_text(written(python, machine))
        checked(python, machine)
        print(f"py{python}-{machine}: {len(router.pins(router.pins_file(python, machine)))} wheels pinned and checked")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
