"""The front doors are registered by real imports (issue 54, item 2): every stage of the stage list has exactly one,
its own package, and nothing in the package imports a module by a string."""
from __future__ import annotations

import inspect
import re
from pathlib import Path

from sparkbook.core.values.stagelist import STAGES
from sparkbook.runbook.frontdoors import FRONT_DOORS

PACKAGE = Path(__file__).resolve().parents[2] / "sparkbook"
BY_STRING = re.compile(r"\bimport_module\(|\b__import__\(")


def test_every_stage_has_exactly_one_front_door_its_own_package() -> None:
    assert list(FRONT_DOORS) == list(STAGES), "one entry per stage, in run order"
    doors = list(FRONT_DOORS.values())
    assert len({id(d) for d in doors}) == len(doors), "no package is the front door of two stages"
    for stage, door in FRONT_DOORS.items():
        assert inspect.ismodule(door) and door.__name__ == f"sparkbook.stages.{stage.package}", stage.name
        assert callable(door.preview) and callable(door.run), stage.name


def test_no_module_of_the_package_is_imported_by_a_string() -> None:
    found = [f"{path.relative_to(PACKAGE)}:{n}" for path in PACKAGE.rglob("*.py")
             for n, line in enumerate(path.read_text().splitlines(), 1) if BY_STRING.search(line)]
    assert found == []


def test_the_check_finds_an_import_by_a_string() -> None:
    assert BY_STRING.search('importlib.import_module(f"sparkbook.stages.{name}")')
    assert BY_STRING.search("__import__('x')") and not BY_STRING.search("from importlib import metadata")
