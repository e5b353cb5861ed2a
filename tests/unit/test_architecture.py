"""ARCHITECTURE.md names every module of the package by its path under sparkbook/ (issue 54), so the document
cannot fall behind a module added or renamed: this names each one it lacks."""
from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "sparkbook"
# programs run inside images and nodes, not modules of the package (as tests/unit/test_layers.py reads it)
OUTSIDE = (PACKAGE / "core" / "cluster" / "probes", PACKAGE / "lab" / "images")


def holds_code(path: Path) -> bool:
    """Whether a file has a statement besides its docstring: an empty or docstring-only __init__.py is no module
    to describe."""
    body = ast.parse(path.read_text()).body
    return any(not (isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant)) for n in body)


def modules(package: Path) -> list[str]:
    return sorted(p.relative_to(package).as_posix() for p in package.rglob("*.py")
                  if not any(p.is_relative_to(o) for o in OUTSIDE) and (p.name != "__init__.py" or holds_code(p)))


def unnamed(text: str, package: Path) -> list[str]:
    return [m for m in modules(package) if f"`{m}`" not in text]


def stale(text: str, package: Path) -> list[str]:
    """Module paths the page names that the package no longer has (a rename the page did not follow)."""
    named = re.findall(r"`([\w/]+\.py)`", text)
    return sorted({m for m in named if not m.startswith("tests/") and not (package / m).is_file()})


def test_architecture_names_every_module_by_its_path() -> None:
    assert unnamed((ROOT / "ARCHITECTURE.md").read_text(), PACKAGE) == []


def test_architecture_names_no_module_that_is_gone() -> None:
    assert stale((ROOT / "ARCHITECTURE.md").read_text(), PACKAGE) == []


def test_a_module_missing_from_the_page_is_named(tmp_path: Path) -> None:
    (tmp_path / "core").mkdir()
    (tmp_path / "__init__.py").write_text('"""only a docstring"""\n')
    (tmp_path / "core" / "__init__.py").write_text("X = 1\n")
    (tmp_path / "core" / "carry.py").write_text("")
    (tmp_path / "core" / "named.py").write_text("")
    text = "`core/named.py` and core/carry.py unquoted, `core/gone.py`, `tests/unit/test_x.py`"
    assert unnamed(text, tmp_path) == ["core/__init__.py", "core/carry.py"]
    assert stale(text, tmp_path) == ["core/gone.py"]
