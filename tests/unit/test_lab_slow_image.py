"""The lab's slow image (the image A/B's planted worse image) without a builder: its recipe and inputs, that
ensure_images builds it but leaves it out of the images `lab up` puts on the head, and the plugin's wrapping of a
stand-in EngineCore (the real one is exercised only in the image)."""
from __future__ import annotations

import dataclasses
import importlib.util
import logging
import shutil
import sys
import tomllib
import types
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import pytest

from sparkbook.lab import imagebuild as ib

PLUGIN_DIR = ib.RECIPES_DIR / "slow_step"


def slow_spec() -> ib.ImageSpec:
    return next(s for s in ib.image_specs() if s.tag == ib.SLOW)


def load_plugin() -> types.ModuleType:
    spec = importlib.util.spec_from_file_location("sparkbook_slow_step_under_test", PLUGIN_DIR / "sparkbook_slow_step.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_slow_spec_is_new_plus_a_plugin() -> None:
    specs = ib.image_specs()
    tags = [s.tag for s in specs]
    spec = slow_spec()
    assert ib.SLOW == f"{ib.NEW}-slow" and tags.index(ib.NEW) < tags.index(ib.SLOW)
    assert spec.role == "slow" and spec.parents == {"BASE": ib.NEW} and spec.vllm == ib.NEW_VLLM
    labels = ib.labels(spec, "r")
    assert labels[f"{ib.LABEL}.role"] == "slow" and "sparkbook_slow_step" in labels[f"{ib.LABEL}.planted"]
    assert all(p.is_file() for p in spec.files)
    ib.check_inputs(spec)
    # the build context is flat: the Dockerfile copies exactly the inputs' names
    copy = next(line for line in (ib.RECIPES_DIR / "Dockerfile.slow").read_text().splitlines()
                if line.startswith("COPY "))
    assert sorted(copy.split()[1:-1]) == sorted(p.name for p in spec.files)


def test_slow_is_built_but_not_loaded_at_lab_up(monkeypatch: pytest.MonkeyPatch) -> None:
    assert ib.SLOW not in ib.LAB_IMAGES and ib.SLOW in ib.ON_DEMAND_IMAGES
    built: list[str] = []

    def fake_ensure(spec: ib.ImageSpec, done: dict[str, str], emit: Any) -> str:
        assert all(parent in done for parent in spec.parents.values()), spec.tag  # parents first
        built.append(spec.tag)
        return f"sha256:{len(built)}"

    monkeypatch.setattr(ib, "ensure_builder", lambda: 1)
    monkeypatch.setattr(ib, "lab_lock", lambda name: nullcontext())
    monkeypatch.setattr(ib, "ensure_image", fake_ensure)
    out = ib.ensure_images(lambda line: None)
    assert ib.SLOW in built
    assert list(out) == list(ib.LAB_IMAGES)   # what `lab up` loads onto the head


def test_recipe_hash_follows_the_plugin_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    recipes = tmp_path / "images"
    shutil.copytree(ib.RECIPES_DIR, recipes)
    monkeypatch.setattr(ib, "RECIPES_DIR", recipes)
    spec = dataclasses.replace(slow_spec(), files=tuple(recipes / "slow_step" / p.name for p in slow_spec().files))
    parents = {"BASE": "sha256:new"}
    before = ib.recipe_hash(spec, parents)
    assert ib.recipe_hash(spec, parents) == before
    toml = recipes / "slow_step" / "pyproject.toml"
    toml.write_text(toml.read_text().replace('version = "1.0.0"', 'version = "1.0.1"'))  # same size: by content
    after_toml = ib.recipe_hash(spec, parents)
    assert after_toml != before
    src = recipes / "slow_step" / "sparkbook_slow_step.py"
    src.write_text(src.read_text().replace("SLOW_FACTOR = 1.0", "SLOW_FACTOR = 2.0"))
    assert ib.recipe_hash(spec, parents) not in (before, after_toml)
    assert ib.recipe_hash(spec, {"BASE": "sha256:other"}) != ib.recipe_hash(spec, parents)


def test_plugin_entry_point_names_register() -> None:
    project = tomllib.loads((PLUGIN_DIR / "pyproject.toml").read_text())
    assert project["tool"]["setuptools"]["py-modules"] == ["sparkbook_slow_step"]
    target = project["project"]["entry-points"]["vllm.general_plugins"]["sparkbook_slow_step"]
    module, attr = target.split(":")
    assert module == "sparkbook_slow_step" and callable(getattr(load_plugin(), attr))


class FakeCore:
    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    def step(self, *args: Any) -> tuple[dict[int, str], bool]:
        self.calls.append(args)
        return {0: "out"}, True


def test_plant_sleeps_k_times_each_step_once() -> None:
    plugin = load_plugin()
    slept: list[float] = []
    ticks = iter([10.0, 10.004, 20.0, 20.006])
    cls = type("Core", (FakeCore,), {"step": FakeCore.step})
    assert plugin.plant(cls, 1.5, sleep=slept.append, clock=lambda: next(ticks)) == ["step"]
    assert plugin.plant(cls, 1.5, sleep=slept.append) == []   # loaded again in the same process: no double wrap
    core = cls()
    assert core.step() == ({0: "out"}, True) and core.step("x") == ({0: "out"}, True)
    assert core.calls == [(), ("x",)]
    assert slept == pytest.approx([0.006, 0.009])
    assert cls.__dict__["step"].__name__ == "step" and FakeCore.step.__name__ == "step"


def test_register_wraps_engine_core_and_says_so(monkeypatch: pytest.MonkeyPatch,
                                                caplog: pytest.LogCaptureFixture) -> None:
    plugin = load_plugin()
    core_cls = type("EngineCore", (), {"step": FakeCore.step, "step_with_batch_queue": FakeCore.step})
    names = ("vllm", "vllm.v1", "vllm.v1.engine", "vllm.v1.engine.core")
    for name in names:
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    sys.modules["vllm.v1.engine.core"].EngineCore = core_cls  # type: ignore[attr-defined]
    monkeypatch.setenv("SPARKBOOK_SLOW_FACTOR", "0.5")
    with caplog.at_level(logging.WARNING, logger="vllm.plugins.sparkbook_slow_step"):
        plugin.register()
        plugin.register()
    assert [r.getMessage() for r in caplog.records if "PLANTED SLOWDOWN" in r.getMessage()][0].count("0.50x") == 1
    assert len([r for r in caplog.records if "PLANTED" in r.getMessage()]) == 1
    assert all(getattr(core_cls.__dict__[name], plugin.MARK) == 0.5 for name in plugin.STEPS)
    monkeypatch.delenv("SPARKBOOK_SLOW_FACTOR")
    assert plugin.factor() == plugin.SLOW_FACTOR == 1.0
