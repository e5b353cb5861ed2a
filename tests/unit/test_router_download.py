"""Issue 56: the router's wheel is pinned by sha256, not only by version, and the Python version and machine the
image reports (which name paths here and on the node) are refused unless they are X.Y and a machine the router is
built for. Planted: a wheel of the right name with other bytes in the download cache, and hostile image answers."""
from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from sparkbook.stages.serve import router
from sparkbook.stages.serve.commands import ServeError


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setattr(router, "HERE_CACHE", tmp_path)
    return tmp_path


def _planted(cache: Path, machine: str, data: bytes) -> Path:
    """A download cache that says it is complete, with a router wheel of these bytes."""
    into = cache / f"{router.VERSION}-py3.12-{machine}"
    into.mkdir()
    (into / ".complete").touch()
    (into / f"vllm_router-{router.VERSION}-cp38-abi3-manylinux_2_28_{machine}.whl").write_bytes(data)
    return into


def test_a_router_wheel_that_is_not_the_pinned_one_is_removed_and_refused(cache: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    into = _planted(cache, "aarch64", b"a wheel from a poisoned index")
    with pytest.raises(ServeError, match="is not the pinned one") as refused:
        router.download("3.12", "aarch64")
    assert router.ROUTER_SHA256["aarch64"] in str(refused.value) and not into.exists()


def test_the_pinned_wheel_is_taken_from_the_cache(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    data = b"the release"
    monkeypatch.setitem(router.ROUTER_SHA256, "aarch64", hashlib.sha256(data).hexdigest())
    into = _planted(cache, "aarch64", data)
    assert router.download("3.12", "aarch64") == into


@pytest.mark.parametrize("python, machine", [("3.12/../../../etc", "x86_64"), ("3.12", "x86_64/../../x"),
                                             ("3.12 ; rm -rf /", "aarch64"), ("3", "x86_64"), ("3.12", "sparc")])
def test_what_the_image_says_is_refused_unless_x_y_and_a_known_machine(python: str, machine: str, cache: Path) -> None:
    with pytest.raises(ServeError, match="is installed for Python 3.X on x86_64 or aarch64 only"):
        router.download(python, machine)
    assert list(cache.iterdir()) == [], "nothing was fetched or created"
