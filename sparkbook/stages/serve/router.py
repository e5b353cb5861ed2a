"""vllm-router in its place on the head (the front's own, or the head's), installed without network on the nodes:
the controller downloads the router's wheels for the place's own Python and architecture (once, into its cache),
copies them into the compile caches' directory (every place mounts it at the same path) and the place installs them
into a directory of their own there (`pip --target`), so the image's own packages are never changed; the router runs
from it (PYTHONPATH). With serve.api_key_env it starts through keyed_router.py, copied there beside it as KEYED."""
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
from typing import NoReturn

from ...core.cluster.context import Context
from ...core.cluster.runtime import Place
from ...core.cluster.topology import cache_dir
from ...core.values.params import Params
from .commands import ServeError

VERSION = "0.1.17"
PLACE_TIMEOUT_S = 300  # pip install of ~30 MB of wheels in the place: seconds on the lab, bounded all the same
DOWNLOAD_TIMEOUT_S = 600
HERE_CACHE = Path.home() / ".cache" / "sparkbook" / "vllm-router"
KEYED = "sparkbook_keyed_router"  # the module keyed_router.py is, in the router's install on the node
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


def ensure(ctx: Context, place: Place) -> RouterInstall:
    """The router installed for the Python and architecture of `place`, on the head (the front's own place, or the
    head's), its marker file saying which; ServeError naming the step that failed, before any server is launched."""
    t0, head = time.monotonic(), ctx.head
    where = site(ctx.params)
    asked = ctx.runtime.exec(head, place, ["python3", "-c", _ASK], timeout=60)
    if not asked.ok:
        raise ServeError(f"{head.name}: cannot ask {place.name}'s python3 for its version: {asked.stderr[-300:]}",
                         node=head.name)
    python, machine = json.loads(asked.stdout.strip().splitlines()[-1])
    marker = f"{where}/.installed-for"
    found = ctx.runtime.exec(head, place, ["cat", marker], timeout=30)
    installs = not (found.ok and found.stdout.strip() == f"{python} {machine}")
    if installs:
        _install(ctx, place, where, python, machine)
    # keyed_router.py beside it each time: it changes with sparkbook, not with the router
    head.put(Path(__file__).with_name("keyed_router.py"), f"{where}/{KEYED}.py")
    return RouterInstall(where, python, machine, installs, time.monotonic() - t0)


def _install(ctx: Context, place: Place, where: str, python: str, machine: str) -> None:
    """The pinned wheels for `python` and `machine` copied to the head and installed into `where` by the place's pip,
    its marker written; ServeError naming the place where pip fails."""
    head = ctx.head
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


# every wheel the router needs, pinned by name, version and sha256, one file per Python X.Y and machine the router is
# installed for (router-pins/pyX.Y-MACHINE.txt, pip's hash-checking requirements, the router's own wheel included):
# the set is complete, so pip downloads it with --no-deps and --require-hashes, and what lands in the head's place is
# that set whatever the index or a proxy hands pip. `make router-pins` (tests/router_pins.py) writes them from PyPI.
PINS = Path(__file__).parent / "router-pins"
PYTHON_VERSION = re.compile(r"3\.[0-9]{1,2}")
MACHINE = re.compile(r"[a-z0-9_]{1,20}")
_PIN = re.compile(r"([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s]+)\s+--hash=sha256:([0-9a-f]{64})")
# the manylinux tags pip may take for a node (newest first), the same for the download and for tests/router_pins.py
MANYLINUX = ("manylinux_2_28", "manylinux_2_17", "manylinux2014", "manylinux_2_5", "manylinux1")


def supported() -> list[str]:
    """The (Python, machine) targets a pins file exists for, as `pyX.Y-MACHINE`."""
    return sorted(p.stem for p in PINS.glob("py*-*.txt"))


def pins_file(python: str, machine: str) -> Path:
    return PINS / f"py{python}-{machine}.txt"


def canonical(name: str) -> str:
    """A distribution's name as PEP 503 compares it (a wheel's file name says aiohttp_x for aiohttp-x)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def pins(path: Path) -> dict[str, tuple[str, str]]:
    """canonical name -> (version, sha256) of each `name==version --hash=sha256:...` line of a pins file; ValueError
    naming the line for any other line than a comment or a blank one."""
    found: dict[str, tuple[str, str]] = {}
    for n, line in enumerate(path.read_text().splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        m = _PIN.fullmatch(line)
        if not m or canonical(m[1]) in found:
            raise ValueError(f"{path}:{n}: not one `name==version --hash=sha256:HEX` of a name not pinned above")
        found[canonical(m[1])] = (m[2], m[3])
    return found


def pip_platforms(machine: str) -> list[str]:
    return [f"--platform={p}_{machine}" for p in MANYLINUX]


def download(python: str, machine: str) -> Path:
    """The router's wheels and their dependencies for that Python and architecture, fetched here once (PyPI is
    reachable from the controller, not necessarily from the nodes) from the pinned set for it. `python` and `machine`
    are what the image said: refused unless a pins file exists for them (they name paths here and on the node);
    every wheel in the cache is checked against the pins each time (ServeError naming a wheel not pinned or with
    another sha256, the cache removed)."""
    if not (PYTHON_VERSION.fullmatch(python) and MACHINE.fullmatch(machine) and pins_file(python, machine).is_file()):
        raise ServeError(f"the head's place says Python {python[:40]!r} on {machine[:40]!r}; vllm-router {VERSION} "
                         f"is pinned for {', '.join(supported())} only",
                         remediation="serve.layout: replicas needs an image whose python3 is one of them; to add "
                         "one, name it in tests/router_pins.py's TARGETS and run `make router-pins`")
    into = HERE_CACHE / f"{VERSION}-py{python}-{machine}"
    if not (into / ".complete").exists():
        _fetch(into, python, machine)
    _verified(into, pins_file(python, machine))
    return into


def _fetch(into: Path, python: str, machine: str) -> None:
    into.mkdir(parents=True, exist_ok=True)
    argv = [sys.executable, "-m", "pip", "download", "-q", "--only-binary=:all:", *pip_platforms(machine),
            f"--python-version={python}", "--implementation=cp", "--no-deps", "--require-hashes", "-d", str(into),
            "-r", str(pins_file(python, machine))]
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


def _verified(into: Path, pinned: Path) -> None:
    """Every wheel in `into` is a pinned one (its name, version and sha256), and every pinned wheel is there; else the
    cache is removed and refused, naming the first wheel that differs."""
    want, seen = pins(pinned), set[str]()
    for wheel in sorted(into.glob("*.whl")):
        name, version = (wheel.name.split("-") + [""])[:2]
        pin = want.get(canonical(name))
        digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
        if pin is None or pin[0] != version:
            _refuse(into, f"{wheel.name} is not in {pinned.name}")
        elif digest != pin[1]:
            _refuse(into, f"{wheel.name} has sha256 {digest}, {pinned.name} pins {pin[1]}")
        seen.add(canonical(name))
    missing = sorted(set(want) - seen)
    if missing:
        _refuse(into, f"{', '.join(missing)} pinned in {pinned.name} but not downloaded")


def _refuse(into: Path, why: str) -> NoReturn:
    shutil.rmtree(into, ignore_errors=True)
    raise ServeError(f"vllm-router {VERSION}'s wheels in {into}: {why}; the download was removed",
                     remediation="check the package index this machine's pip uses, then run again")
