"""vllm-router in the head's place, installed without network on the nodes: the controller downloads the router's
wheels for the place's own Python and architecture (once, into its cache), copies them into the compile caches'
directory (every place mounts it at the same path) and the place installs them into a directory of their own there
(`pip --target`), so the image's own packages are never changed; the router runs from it (PYTHONPATH)."""
from __future__ import annotations

import hashlib
import json
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from ...core.cluster.context import Context
from ...core.cluster.topology import cache_dir
from ...core.values.params import Params
from .commands import ServeError

VERSION = "0.1.17"
PLACE_TIMEOUT_S = 300  # pip install of ~30 MB of wheels in the place: seconds on the lab, bounded all the same
DOWNLOAD_TIMEOUT_S = 600
HERE_CACHE = Path.home() / ".cache" / "sparkbook" / "vllm-router"
_ASK = ("import json, platform, sys; "
        "print(json.dumps([f'{sys.version_info[0]}.{sys.version_info[1]}', platform.machine()]))")


def site(params: Params) -> str:
    """Where the router's packages live on every node, inside the compile caches' directory (mounted in the
    places): one install per cluster, kept across runs and `up`."""
    return str(PurePosixPath(cache_dir(params)) / f"vllm-router-{VERSION}" / "site")


@dataclass(frozen=True)
class RouterInstall:
    """What 05 found or did to have the router in the head's place."""

    site: str
    python: str  # the place's Python, X.Y
    machine: str  # the place's architecture (platform.machine())
    installed_now: bool  # False: an earlier run's install for this Python and architecture was there
    seconds: float

    def event(self) -> dict[str, object]:
        return {"version": VERSION, "site": self.site, "python": self.python, "machine": self.machine,
                "installed_now": self.installed_now, "seconds": round(self.seconds, 1)}


def ensure(ctx: Context) -> RouterInstall:
    """The router installed in the head's place for its Python and architecture (its marker file says which);
    ServeError naming the step that failed, before any replica is launched."""
    t0, head = time.monotonic(), ctx.head
    place, where = ctx.place(head.name), site(ctx.params)
    asked = ctx.runtime.exec(head, place, ["python3", "-c", _ASK], timeout=60)
    if not asked.ok:
        raise ServeError(f"{head.name}: cannot ask {place.name}'s python3 for its version: {asked.stderr[-300:]}",
                         node=head.name)
    python, machine = json.loads(asked.stdout.strip().splitlines()[-1])
    marker = f"{where}/.installed-for"
    found = ctx.runtime.exec(head, place, ["cat", marker], timeout=30)
    if found.ok and found.stdout.strip() == f"{python} {machine}":
        return RouterInstall(where, python, machine, False, time.monotonic() - t0)
    wheels = download(python, machine)
    remote = f"{PurePosixPath(where).parent}/wheels-py{python}-{machine}"
    head.run(["mkdir", "-p", remote], timeout=30).check()
    for wheel in sorted(wheels.glob("*.whl")):
        head.put(wheel, f"{remote}/{wheel.name}")
    pip = ctx.runtime.exec(head, place, ["sh", "-c", 'rm -rf "$0" && python3 -m pip install -q --no-index '
                                         '--find-links "$1" --target "$0" "vllm-router==$2" && printf %s "$3" >"$0/'
                                         '.installed-for"', where, remote, VERSION, f"{python} {machine}"],
                           timeout=PLACE_TIMEOUT_S)
    if not pip.ok:
        raise ServeError(f"{head.name}: installing vllm-router {VERSION} in {place.name} failed: "
                         f"{(pip.stderr or pip.stdout)[-600:]}", node=head.name,
                         remediation=f"check that {place.name} has pip (python3 -m pip) and room under {where}")
    return RouterInstall(where, python, machine, True, time.monotonic() - t0)


# sha256 of vllm-router VERSION's wheel per machine, as PyPI serves it (one abi3 wheel each): the download is checked
# against it, so what lands in the head's place is that release whatever the index or a proxy hands pip; these keys
# are the machines the router is built for (what a place's platform.machine() must say)
ROUTER_SHA256 = {"x86_64": "85c96bea4d573a49b5a8ae4c72ee3dfe733aba26b6f1ff1256e6142f1f42694d",
                 "aarch64": "1ec4d5ce14c19431cc84e36238507dff89020ab024d99f042f091f5e9f2c895a"}
PYTHON_VERSION = re.compile(r"3\.[0-9]{1,2}")


def download(python: str, machine: str) -> Path:
    """The router's wheels and their dependencies for that Python and architecture, fetched here once (PyPI is
    reachable from the controller, not necessarily from the nodes). `python` and `machine` are what the image said:
    refused unless an X.Y version and a machine the router is built for (they name paths here and on the node); the
    router's own wheel is refused unless its sha256 is the pinned one."""
    if not PYTHON_VERSION.fullmatch(python) or machine not in ROUTER_SHA256:
        raise ServeError(f"the head's place says Python {python[:40]!r} on {machine[:40]!r}; vllm-router {VERSION} "
                         f"is installed for Python 3.X on {' or '.join(ROUTER_SHA256)} only",
                         remediation="serve.layout: replicas needs an image whose python3 is CPython 3 on one of them")
    into = HERE_CACHE / f"{VERSION}-py{python}-{machine}"
    if not (into / ".complete").exists():
        _fetch(into, python, machine)
    _verified(into, machine)
    return into


def _fetch(into: Path, python: str, machine: str) -> None:
    into.mkdir(parents=True, exist_ok=True)
    platforms = [f"--platform={p}_{machine}" for p in ("manylinux_2_28", "manylinux_2_17", "manylinux2014",
                                                      "manylinux_2_5", "manylinux1")]
    argv = [sys.executable, "-m", "pip", "download", "-q", "--only-binary=:all:", *platforms,
            f"--python-version={python}", "--implementation=cp", "-d", str(into), f"vllm-router=={VERSION}"]
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=DOWNLOAD_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired as exc:
        raise ServeError(f"downloading vllm-router {VERSION} here took over {DOWNLOAD_TIMEOUT_S} s",
                         remediation="check this machine's access to PyPI") from exc
    if done.returncode != 0:
        raise ServeError(f"downloading vllm-router {VERSION} for Python {python} on {machine} here failed: "
                         f"{done.stderr[-600:]}", remediation="check this machine's access to PyPI (or its pip "
                         "configuration)")
    (into / ".complete").touch()


def _verified(into: Path, machine: str) -> None:
    """The one router wheel in `into` has the pinned sha256; else the download is removed and refused."""
    wheels = sorted(into.glob(f"vllm_router-{VERSION}-*.whl"))
    digests = [hashlib.sha256(w.read_bytes()).hexdigest() for w in wheels]
    if digests != [ROUTER_SHA256[machine]]:
        shutil.rmtree(into, ignore_errors=True)
        raise ServeError(f"the vllm-router {VERSION} wheel downloaded into {into} is not the pinned one "
                         f"({', '.join(w.name for w in wheels) or 'none'}: sha256 {', '.join(digests) or '-'}, "
                         f"expected {ROUTER_SHA256[machine]}); it was removed",
                         remediation="check the package index this machine's pip uses, then run again")
