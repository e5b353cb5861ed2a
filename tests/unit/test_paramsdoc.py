"""docs/params.md is what the schema renders now (`make docs` rewrites it), and the schema describes every field,
so the params reference cannot fall behind the code."""
from __future__ import annotations

from pathlib import Path

from sparkbook.core.values import params
from sparkbook.core.values.paramsdoc import render, sections

DOC = Path(__file__).resolve().parents[2] / "docs" / "params.md"


def test_committed_reference_is_what_the_schema_renders() -> None:
    assert DOC.read_text() == render(), "docs/params.md is stale: run `make docs` and commit it"


def test_every_field_of_every_section_has_a_description() -> None:
    missing = [f"{s.path or 'top level'}.{name}" for s in sections()
               for name, field in s.model.model_fields.items() if not field.description]
    assert missing == []


def test_every_model_of_the_schema_is_a_section_under_the_path_a_params_file_uses() -> None:
    paths = {s.path: s.model for s in sections()}
    assert paths["serve.smoke"] is params.SmokeCheck
    assert paths["nodes[]"] is params.NodeSpec
    assert paths["runtime (kind: python)"] is params.PythonRuntime
    assert paths["model.transfer"] is params.ModelTransfer
    models = {v for v in vars(params).values() if isinstance(v, type) and issubclass(v, params.Strict)}
    assert models - set(paths.values()) == {params.Strict, params.SoakSettings}  # benchmark's fields include the soak's


def test_a_row_names_type_bounds_default_and_description() -> None:
    text = render()
    assert ("| `port` | int (>= 1, <= 65535) | `8000` | the API's port on the head (the router's, with layout "
            "replicas) |") in text
    assert "| `executor` | \"ray\" \\| \"mp\" \\| null | `null` |" in text
    assert "| `soak_s` | number (>= 0, <= 86400) | `0` |" in text  # inherited from SoakSettings
    assert "| `PlainPath` | absolute path, no `..` component" in text
