"""Issue 56: every wheel of the router, its own and its dependencies', is pinned by name, version and sha256 in a
pins file per Python and machine (sparkbook/stages/serve/router-pins/), and the download cache is checked against it
each time; the Python version and machine the image reports (which name paths here and on the node) are refused
unless a pins file exists for them. Planted: wheels with other bytes or not pinned in the download cache, and
hostile image answers. No network: the cache and, but for the shipped files' own test, the pins are planted."""
from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from sparkbook.stages.serve import router
from sparkbook.stages.serve.commands import ServeError

ROUTER = f"vllm_router-{router.VERSION}-cp38-abi3-manylinux_2_28_aarch64.whl"
DEP = "pydantic_core-2.50.5-cp312-cp312-manylinux2014_aarch64.manylinux_2_17_aarch64.whl"
RELEASE = {ROUTER: b"the router's release", DEP: b"pydantic-core's release"}


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setattr(router, "HERE_CACHE", tmp_path / "cache")
    (tmp_path / "cache").mkdir()
    return tmp_path / "cache"


@pytest.fixture
def pinned(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A pins file for Python 3.12 on aarch64 naming RELEASE's two wheels."""
    monkeypatch.setattr(router, "PINS", tmp_path / "pins")
    (tmp_path / "pins").mkdir()
    path = tmp_path / "pins" / "py3.12-aarch64.txt"
    path.write_text("# planted\n" + "".join(f"{'-'.join(n.split('-')[:2]).replace('-', '==').replace('_', '-')} "
                                            f"--hash=sha256:{hashlib.sha256(d).hexdigest()}  # {n}\n"
                                            for n, d in RELEASE.items()))
    return path


def _planted(cache: Path, wheels: dict[str, bytes]) -> Path:
    """A download cache that says it is complete, with these wheels."""
    into = cache / f"{router.VERSION}-py3.12-aarch64"
    into.mkdir()
    (into / ".complete").touch()
    for name, data in wheels.items():
        (into / name).write_bytes(data)
    return into


def test_the_pinned_set_is_taken_from_the_cache(cache: Path, pinned: Path) -> None:
    assert router.pins(pinned) == {"vllm-router": (router.VERSION, hashlib.sha256(RELEASE[ROUTER]).hexdigest()),
                                   "pydantic-core": ("2.50.5", hashlib.sha256(RELEASE[DEP]).hexdigest())}
    into = _planted(cache, RELEASE)
    assert router.download("3.12", "aarch64") == into


def test_a_router_wheel_that_is_not_the_pinned_one_is_removed_and_refused(cache: Path, pinned: Path) -> None:
    into = _planted(cache, {**RELEASE, ROUTER: b"a wheel from a poisoned index"})
    with pytest.raises(ServeError, match=f"{ROUTER} has sha256 [0-9a-f]{{64}}, py3.12-aarch64.txt pins "
                                         f"{hashlib.sha256(RELEASE[ROUTER]).hexdigest()}"):
        router.download("3.12", "aarch64")
    assert not into.exists()


def test_a_poisoned_dependency_wheel_is_removed_and_refused(cache: Path, pinned: Path) -> None:
    into = _planted(cache, {**RELEASE, DEP: b"a dependency from a poisoned index"})
    with pytest.raises(ServeError, match=f"{DEP} has sha256") as refused:
        router.download("3.12", "aarch64")
    assert "\n" not in str(refused.value) and not into.exists()


@pytest.mark.parametrize("extra", ["evil-1.0-py3-none-any.whl",  # a name not pinned
                                   "pydantic_core-2.50.6-cp312-cp312-manylinux2014_aarch64.whl"])  # another version
def test_a_wheel_not_in_the_pins_is_removed_and_refused(extra: str, cache: Path, pinned: Path) -> None:
    into = _planted(cache, {**RELEASE, extra: b"anything"})
    with pytest.raises(ServeError, match=f"{extra} is not in py3.12-aarch64.txt"):
        router.download("3.12", "aarch64")
    assert not into.exists()


def test_a_pinned_wheel_missing_from_the_cache_is_refused(cache: Path, pinned: Path) -> None:
    into = _planted(cache, {ROUTER: RELEASE[ROUTER]})
    with pytest.raises(ServeError, match="pydantic-core pinned in py3.12-aarch64.txt but not downloaded"):
        router.download("3.12", "aarch64")
    assert not into.exists()


@pytest.mark.parametrize("python, machine", [("3.12/../../../etc", "x86_64"), ("3.12", "x86_64/../../x"),
                                             ("3.12 ; rm -rf /", "aarch64"), ("3", "x86_64"), ("3.12", "sparc"),
                                             ("3.99", "x86_64"), ("3.12", "ppc64le")])
def test_what_the_image_says_is_refused_unless_pinned(python: str, machine: str, cache: Path) -> None:
    with pytest.raises(ServeError,
                       match=r"is pinned for (py3\.1[0-9]-[a-z0-9_]+, )+py3\.1[0-9]-[a-z0-9_]+ only") as refused:
        router.download(python, machine)
    assert "\n" not in str(refused.value) and "make router-pins" in str(refused.value)
    assert list(cache.iterdir()) == [], "nothing was fetched or created"


def test_the_shipped_pins_parse_and_each_pins_this_router_release() -> None:
    shipped = router.supported()
    assert {"py3.11-x86_64", "py3.12-x86_64", "py3.12-aarch64"} <= set(shipped)
    for target in shipped:
        found = router.pins(router.PINS / f"{target}.txt")
        assert found["vllm-router"][0] == router.VERSION, target
        assert len(found) > 20, f"{target}: the router's dependencies are pinned too"


def test_a_line_that_is_no_pin_is_refused(tmp_path: Path) -> None:
    for bad in ("vllm-router>=0.1\n", "vllm-router==0.1.17\n", "x==1 --hash=sha256:00\n",
                "x==1 --hash=sha256:" + "0" * 64 + "\nX==2 --hash=sha256:" + "1" * 64 + "\n"):
        (tmp_path / "p.txt").write_text(bad)
        with pytest.raises(ValueError, match="p.txt:[12]: not one"):
            router.pins(tmp_path / "p.txt")
