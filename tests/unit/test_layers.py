"""The package's layers, read from its own imports (issue 28): cli on top; runbook and records beside each other
above the stages; stages that never import one another; a core that imports nothing above it; the lab only for
cli (and tests). A test fails naming the import that points the wrong way."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "sparkbook"
# what each layer may import from the package, besides itself
ALLOWED = {
    "cli": {"runbook", "records", "stages", "core", "lab"},
    "runbook": {"records", "stages", "core"},
    "records": {"core"},
    "stages": {"core"},
    "core": set(),
    "lab": set(),
}


def layer(module: str) -> str:
    """'sparkbook.stages.serve.launch' -> 'stages'; the package's __init__ counts as cli (its public face)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in ALLOWED else "cli"


def stage(module: str) -> str | None:
    parts = module.split(".")
    return parts[2] if len(parts) > 2 and parts[1] == "stages" else None


def module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(rel.parts[:-1]) if rel.name == "__init__" else list(rel.parts)
    return ".".join(parts)


def imports(path: Path) -> list[str]:
    """The sparkbook modules a file imports (relative imports resolved against its package)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: list[str] = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.startswith("sparkbook")]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.startswith("sparkbook"):
                found += [f"{target}.{a.name}" for a in node.names] if not node.module else [target]
    return found


# programs that run inside images or node containers, not modules of the package
OUTSIDE = (PACKAGE / "core" / "probes", PACKAGE / "lab" / "images")
FILES = sorted(p for p in PACKAGE.rglob("*.py") if not any(p.is_relative_to(o) for o in OUTSIDE))


def wrong_way(path: Path) -> list[str]:
    name, problems = module_name(path), []
    for target in imports(path):
        if layer(target) not in ALLOWED[layer(name)] | {layer(name)}:
            problems.append(f"{name} imports {target}: {layer(name)} may import {sorted(ALLOWED[layer(name)])}")
        elif stage(name) and stage(target) and stage(name) != stage(target):
            problems.append(f"{name} imports {target}: a stage never imports another stage")
    return problems


@pytest.mark.parametrize("path", FILES, ids=lambda p: module_name(p))
def test_no_import_points_up_or_across_stages(path: Path) -> None:
    assert wrong_way(path) == []


def test_the_rule_catches_an_arrow_up_and_across(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = tmp_path / "sparkbook"
    for rel, text in {"core/x.py": "from ..stages.serve import launch\n",
                      "stages/serve/launch.py": "from ...stages.images import choice\nfrom ...core import x\n",
                      "records/pages.py": "from sparkbook.stages.bench import sweep\n",
                      "stages/bench/sweep.py": "from . import client\nfrom ...core.x import y\n"}.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    monkeypatch.setattr(__import__(__name__), "PACKAGE", root)
    assert wrong_way(root / "core/x.py") == [
        "sparkbook.core.x imports sparkbook.stages.serve: core may import []"]
    assert wrong_way(root / "stages/serve/launch.py") == [
        "sparkbook.stages.serve.launch imports sparkbook.stages.images: a stage never imports another stage"]
    assert wrong_way(root / "records/pages.py") == [
        "sparkbook.records.pages imports sparkbook.stages.bench: records may import ['core']"]
    assert wrong_way(root / "stages/bench/sweep.py") == []
