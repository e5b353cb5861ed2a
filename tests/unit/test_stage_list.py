"""The stage list (core.values.stagelist) is the one place a stage is named (issue 39, item 1): no other module of the
package spells a stage id or a notebook name as a string (docstrings aside); the list is the notebooks/ folder in
order, the driver runs it in that order, and its hand-offs are the models each notebook recalls and remembers."""
from __future__ import annotations

import ast
import inspect
import json
import re
from pathlib import Path

import pytest

from sparkbook.core.values import handoff, modelinfo
from sparkbook.core.values.stagelist import BENCH, SERVE, STAGES, stage_of
from sparkbook.core.values.state import Handoff
from sparkbook.runbook import driver
from sparkbook.runbook.frontdoors import FRONT_DOORS

PACKAGE = Path(__file__).resolve().parents[2] / "sparkbook"
LIST = PACKAGE / "core" / "values" / "stagelist.py"
NOTEBOOK_NAME = re.compile(r"0[1-6]-")


def _docstrings(tree: ast.AST) -> set[int]:
    kinds = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    return {id(n.body[0].value) for n in ast.walk(tree) if isinstance(n, kinds) and n.body
            and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}


def stage_literals(path: Path) -> list[str]:
    """'file:line: text' for each string of `path` (an f-string's parts too; not a docstring) that is a stage id or
    starts like a notebook name."""
    tree = ast.parse(path.read_text())
    skip = _docstrings(tree)
    ids, names = {s.id for s in STAGES}, tuple(s.name for s in STAGES)
    return [f"{path.relative_to(PACKAGE.parent)}:{n.lineno}: {n.value!r}" for n in ast.walk(tree)
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in skip
            and (n.value in ids or n.value.startswith(names) or NOTEBOOK_NAME.match(n.value))]


# every module, the lab's and the programs run in images included: none needs an exception
FILES = sorted(p for p in PACKAGE.rglob("*.py") if p != LIST)


def test_no_stage_id_or_notebook_name_outside_the_list() -> None:
    assert [hit for path in FILES for hit in stage_literals(path)] == []


def test_the_rule_catches_ids_and_names_but_not_docstrings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    planted = tmp_path / "sparkbook" / "x.py"
    planted.parent.mkdir()
    planted.write_text('"""05-serve and 06 in a docstring are prose."""\nSERVE = "05"\n'
                       'def f(x):\n    """06-benchmark."""\n    return f"05-serve.ab-{x}.ipynb", "07-later", "run 02 first"\n')
    monkeypatch.setattr(__import__(__name__), "PACKAGE", tmp_path / "sparkbook")
    assert stage_literals(planted) == ["sparkbook/x.py:2: '05'", "sparkbook/x.py:5: '05-serve.ab-'"]


def test_the_list_is_the_notebooks_folder_in_order_and_the_driver_runs_it_so() -> None:
    on_disk = sorted(p.name for p in driver.NOTEBOOKS.glob("*.ipynb"))
    assert [s.notebook for s in STAGES] == on_disk == driver.notebook_names()
    assert [s.id for s in STAGES] == sorted(s.id for s in STAGES) and len({s.id for s in STAGES}) == len(STAGES)


def test_names_of_a_stage_lead_to_it() -> None:
    assert stage_of("05-serve.ab-kept.ipynb") is SERVE and stage_of(BENCH.name) is BENCH
    assert stage_of("04-ray.ipynb") is STAGES[3] and stage_of("07-later.ipynb") is None and stage_of("") is None


@pytest.mark.parametrize("stage", STAGES, ids=lambda s: s.name)
def test_each_stage_names_its_package_and_its_notebook_opens_its_run_under_its_name(stage) -> None:
    door = FRONT_DOORS[stage]
    assert inspect.ismodule(door) and door.__name__ == f"sparkbook.stages.{stage.package}"
    assert f'stage="{stage.name}"' in _source(stage.notebook)


def _source(notebook: str) -> str:
    cells = json.loads((driver.NOTEBOOKS / notebook).read_text())["cells"]
    return "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")


HANDOFFS = {k.__name__: k for k in Handoff.__subclasses__() if k.__module__ in (handoff.__name__, modelinfo.__name__)}


def test_each_hand_off_is_written_by_the_stage_its_model_names_and_read_only_after() -> None:
    writers = {name: s for s in STAGES for name in s.writes}
    assert sorted(writers) == sorted(HANDOFFS) and sum(len(s.writes) for s in STAGES) == len(HANDOFFS)
    assert {name: kind.notebook for name, kind in HANDOFFS.items()} == {n: s.name for n, s in writers.items()}
    for at, stage in enumerate(STAGES):
        # an A/B runs 05 once per arm: each arm's 05 adds its answers to what the arm before it recorded
        assert all(writers[name] in STAGES[:at] or (name, stage) == ("AbAnswers", SERVE) for name in stage.reads), \
            stage.name


def _stage_source(package: str) -> str:
    """The stage's own code (a package's modules, or its one module): its front door reads the hand-offs."""
    where = PACKAGE / "stages" / package
    return "\n".join(f.read_text() for f in sorted(where.rglob("*.py"))) if where.is_dir() \
        else (PACKAGE / "stages" / f"{package}.py").read_text()


@pytest.mark.parametrize("stage", STAGES, ids=lambda s: s.name)
def test_what_a_notebook_recalls_is_among_its_stages_reads(stage) -> None:
    """What the notebook recalls, or its stage reads through the context's hand-offs (the front door)."""
    recalled = set(re.findall(r"\.recall\((?:\w+\.)*(\w+)", _source(stage.notebook))) | set(
        re.findall(r"\.handoffs\.(?:need|get)\((?:\w+\.)*(\w+)", _stage_source(stage.package)))
    assert recalled <= set(stage.reads) and bool(recalled) == bool(stage.reads)
