"""The package's layers, read from its own imports (issue 28): cli on top, which only parses and renders what api
returns (issue 54); api over runbook and records, beside each other above the stages; stages that never import one another; a core that imports nothing above it, itself three floors
(values, then analysis, then cluster), each importing only those below; the lab only for cli (and tests). A test
fails naming the import that points the wrong way, and another any circle of modules."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "sparkbook"
# what each layer may import from the package, besides itself
CORE = {"core.values", "core.analysis", "core.cluster"}
ALLOWED = {
    "cli": {"api", "lab", "core.values"},  # core.values: the errors' kinds and the values it renders
    "sparkbook": {"runbook"},  # the package's own __init__: the session a notebook opens
    "api": {"runbook", "records", "stages"} | CORE,
    "runbook": {"records", "stages"} | CORE,
    "records": CORE,
    "stages": CORE,
    "core.cluster": {"core.values", "core.analysis"},
    "core.analysis": {"core.values"},
    "core.values": set(),
    "lab": set(),
}


def layer(module: str) -> str:
    """'sparkbook.stages.serve.launch' -> 'stages', 'sparkbook.core.values.params' -> 'core.values'; the package's
    __init__ is its own; the bare `sparkbook.core` counts as its lowest floor."""
    parts = module.split(".")
    if len(parts) == 1:
        return "sparkbook"
    if parts[1] == "core":
        return f"core.{parts[2]}" if len(parts) > 2 else "core.values"
    return parts[1]


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
OUTSIDE = (PACKAGE / "core" / "cluster" / "probes", PACKAGE / "lab" / "images")
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
    for rel, text in {"core/values/x.py": "from ...stages.serve import launch\n",
                      "core/values/y.py": "from ..cluster import nodes\nfrom . import params\n",
                      "core/analysis/z.py": "from ..values import params\nfrom ..cluster.nodes import Node\n",
                      "stages/serve/launch.py": "from ...stages.images import choice\nfrom ...core import x\n",
                      "records/pages.py": "from sparkbook.stages.bench import sweep\n",
                      "stages/bench/sweep.py": "from . import client\nfrom ...core.values.x import y\n",
                      "cli/run.py": "from .. import api\nfrom ..runbook import driver\nfrom ..core.cluster import nodes\n"
                      }.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    monkeypatch.setattr(__import__(__name__), "PACKAGE", root)
    assert wrong_way(root / "core/values/x.py") == [
        "sparkbook.core.values.x imports sparkbook.stages.serve: core.values may import []"]
    assert wrong_way(root / "core/values/y.py") == [
        "sparkbook.core.values.y imports sparkbook.core.cluster: core.values may import []"]
    assert wrong_way(root / "core/analysis/z.py") == [
        "sparkbook.core.analysis.z imports sparkbook.core.cluster.nodes: core.analysis may import ['core.values']"]
    assert wrong_way(root / "stages/serve/launch.py") == [
        "sparkbook.stages.serve.launch imports sparkbook.stages.images: a stage never imports another stage"]
    assert wrong_way(root / "records/pages.py") == [
        "sparkbook.records.pages imports sparkbook.stages.bench: records may import ['core.analysis', 'core.cluster', 'core.values']"]
    assert wrong_way(root / "stages/bench/sweep.py") == []
    assert wrong_way(root / "cli/run.py") == [
        "sparkbook.cli.run imports sparkbook.runbook: cli may import ['api', 'core.values', 'lab']",
        "sparkbook.cli.run imports sparkbook.core.cluster: cli may import ['api', 'core.values', 'lab']"]


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected sets of two or more modules (Tarjan), each sorted: every import counts, a
    function-level one too, since an import moved into a function hides a circle without breaking it."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            part = stack[stack.index(v):]
            del stack[stack.index(v):]
            if len(part) > 1:
                found.append(sorted(part))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def import_graph(files: list[Path]) -> dict[str, set[str]]:
    """Module -> the package modules it imports (a name imported from a module counts as that module)."""
    names = {module_name(p) for p in files}

    def resolve(target: str) -> str:
        while target and target not in names:
            target = target.rpartition(".")[0]
        return target

    return {module_name(p): {resolve(t) for t in imports(p)} - {module_name(p), ""} for p in files}


def test_no_circle_of_imports() -> None:
    assert circles(import_graph(FILES)) == []


def test_a_circle_is_found() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert circles(graph) == [["a", "b", "c"]]
