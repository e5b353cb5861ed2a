"""Every notebook reads open, preview, show, run, record: its code cells hold no branch, loop or handler (issue 39).
The order of a stage's steps and its branches live in the stage's `run`, where the preview, `sparkbook plan` and the
tests reach them too; a cell that needs an `if` is a step the stage lacks."""
from __future__ import annotations

import ast
import inspect
import json
from pathlib import Path
from typing import get_type_hints

import pytest

from sparkbook.core.cluster.context import Context
from sparkbook.core.values.evidence import StageOutcome
from sparkbook.core.values.stagelist import STAGES
from sparkbook.runbook.frontdoors import FRONT_DOORS

NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"
CONTROL = (ast.If, ast.IfExp, ast.For, ast.AsyncFor, ast.While, ast.Try, ast.comprehension, ast.Match)


def control_flow(source: str) -> list[str]:
    """Each branch, loop, comprehension or handler in the cell, as `line: kind`."""
    tree = ast.parse(source)
    return [f"{getattr(n, 'lineno', '?')}: {type(n).__name__}" for n in ast.walk(tree) if isinstance(n, CONTROL)]


def test_the_counter_sees_each_kind_of_control_flow() -> None:
    found = control_flow("if a:\n    b\nx = 1 if c else 2\nfor i in y: pass\n[z for z in w]\ntry:\n    q\n"
                         "except E:\n    pass\nwhile r: pass\n")
    assert sorted(f.split(": ")[1] for f in found) == ["For", "If", "IfExp", "Try", "While", "comprehension"]
    assert control_flow("out = serve.run(ctx, preview)\nrun.show_all(out.shown())\nrun.record_outcome(out)") == []


@pytest.mark.parametrize("stage", STAGES, ids=[s.id for s in STAGES])
def test_the_notebooks_code_cells_hold_no_control_flow(stage) -> None:
    cells = json.loads((NOTEBOOKS / stage.notebook).read_text())["cells"]
    found = {i: flow for i, c in enumerate(cells) if c["cell_type"] == "code"
             if (flow := control_flow("".join(c["source"])))}
    assert found == {}, f"{stage.notebook}: cells with control flow (cell index: lines): {found}"


@pytest.mark.parametrize("stage", STAGES, ids=[s.id for s in STAGES])
def test_each_stage_has_one_front_door(stage) -> None:
    """preview(ctx) -> a value that shows itself; run(ctx, preview, ...) -> a StageOutcome the notebook records."""
    module = FRONT_DOORS[stage]
    preview_hints, run_hints = get_type_hints(module.preview), get_type_hints(module.run)
    assert list(inspect.signature(module.preview).parameters)[:1] == ["ctx"], stage.package
    assert list(inspect.signature(module.run).parameters)[:2] == ["ctx", "preview"], stage.package
    assert preview_hints["ctx"] is Context and run_hints["ctx"] is Context
    assert run_hints["preview"] is preview_hints["return"], "run takes what preview returned"
    assert issubclass(run_hints["return"], StageOutcome)
    assert callable(preview_hints["return"].shown)


@pytest.mark.parametrize("stage", STAGES, ids=[s.id for s in STAGES])
def test_every_cell_has_its_own_id(stage) -> None:
    """nbformat 4.5 asks each cell for an id (nbformat warns, and may add random ones, on every run and save)."""
    cells = json.loads((NOTEBOOKS / stage.notebook).read_text())["cells"]
    ids = [c.get("id") for c in cells]
    assert None not in ids and len(set(ids)) == len(ids), f"{stage.notebook}: cells without or sharing an id"
