"""docs/params.md rendered from the params schema itself (`make docs`), so the reference cannot drift from the code:
every section of a params file with each field's type, bounds, default and description, and the value types'
allowed characters read from their validators."""
from __future__ import annotations

import inspect
import json
import re
import types
import typing
from dataclasses import dataclass
from typing import Annotated, Any, Literal, Union

import annotated_types
from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from . import params

HEADER = """# Params reference

One YAML file per cluster (`params/*.yaml`), validated by `sparkbook check PARAMS` before anything touches a node.
Generated from `sparkbook/core/values/params.py` by `make docs`; edit the schema's descriptions, not this page
(`tests/unit/test_paramsdoc.py` fails when the two differ). How the settings play together: the pages linked from
the [README](../README.md).
"""

_BOUNDS = ((annotated_types.Ge, "ge", ">="), (annotated_types.Gt, "gt", ">"), (annotated_types.Le, "le", "<="),
           (annotated_types.Lt, "lt", "<"), (annotated_types.MinLen, "min_length", "items >="),
           (annotated_types.MaxLen, "max_length", "items <="))

# the validators a named type adds to its pattern, in words
_CHECKS = {"_no_secret": "no token-shaped value (put secrets in the environment)",
           "_no_climb": "no `..` component, `.` and doubled slashes folded"}


@dataclass(frozen=True)
class Section:
    """One model of the schema where a params file holds it: `serve.smoke`, `nodes[]`, `runtime` (kind docker)."""

    path: str
    model: type[BaseModel]


def aliases() -> dict[Any, str]:
    """The schema's named value types (`Name`, `RemotePath`, ...), so a field reads `Name`, not `str`."""
    return {value: name for name, value in vars(params).items() if typing.get_origin(value) is Annotated}


def sections(model: type[BaseModel] = params.Params, path: str = "") -> list[Section]:
    """Every model reachable from `model`, depth first in field order, each under the path a params file uses."""
    found = [Section(path, model)]
    hints = typing.get_type_hints(model, include_extras=True)
    for name in model.model_fields:
        for inner, suffix in _models_in(hints[name]):
            found += sections(inner, f"{path}.{name}{suffix}".lstrip("."))
    return found


def _models_in(hint: Any) -> list[tuple[type[BaseModel], str]]:
    """The models a field holds, with the path suffix that reaches them: `[]` for a list's, the kind for a union's."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if isinstance(hint, type) and issubclass(hint, BaseModel):
        return [(hint, "")]
    if origin is Annotated:
        return _models_in(args[0])
    if origin is list:
        return [(m, "[]" + s) for m, s in _models_in(args[0])]
    if origin in (Union, types.UnionType):
        models = [m for arg in args for m, _ in _models_in(arg)]
        if len(models) > 1:
            return [(m, f" (kind: {_kind(m)})") for m in models]
        return [(m, "") for m in models]
    return []


def _kind(model: type[BaseModel]) -> str:
    return str(typing.get_args(typing.get_type_hints(model)["kind"])[0])


def type_name(hint: Any, named: dict[Any, str]) -> str:
    """A field's type as a reader of YAML needs it: named value types, `a | b` for literals, null where allowed."""
    if hint in named:
        return named[hint]
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is Annotated:
        inner = type_name(args[0], named)
        return _bounded(inner, [b for meta in args[1:] if isinstance(meta, FieldInfo) for b in _bounds(meta.metadata)])
    if origin is Literal:
        return " | ".join(json.dumps(a) for a in args)
    if origin in (Union, types.UnionType):
        return " | ".join("null" if a is type(None) else type_name(a, named) for a in args)
    if origin is list:
        return f"list of {type_name(args[0], named)}"
    if origin is dict:
        return f"map {type_name(args[0], named)} to {type_name(args[1], named)}"
    return {"str": "text", "float": "number", "IPv4Address": "IPv4 address", "Path": "local path"}.get(
        getattr(hint, "__name__", str(hint)), getattr(hint, "__name__", str(hint)))


def _bounded(kind: str, bounds: list[str]) -> str:
    return f"{kind} ({', '.join(bounds)})" if bounds else kind


def _bounds(metadata: list[Any]) -> list[str]:
    return [f"{sign} {getattr(meta, attr)}" for meta in metadata for kind, attr, sign in _BOUNDS
            if isinstance(meta, kind)]


def default(field: FieldInfo) -> str:
    """The default as YAML would spell it; `required` where there is none, `(section)` for a nested model's."""
    if field.is_required():
        return "required"
    value = field.get_default(call_default_factory=True)
    if isinstance(value, BaseModel):
        return "(section)"
    return f"`{json.dumps(value, default=str)}`" if value is not PydanticUndefined else "required"


def _cell(text: str) -> str:
    return re.sub(r"\s+", " ", text).replace("|", "\\|").strip()


def render_section(section: Section, named: dict[Any, str]) -> str:
    hints = typing.get_type_hints(section.model, include_extras=True)
    title = f"`{section.path}`" if section.path else "top level"
    doc = inspect.cleandoc(section.model.__doc__) if section.model.__doc__ else ""
    rows = ["| field | type | default | what |", "|---|---|---|---|"]
    for name, field in section.model.model_fields.items():
        subs = [f"`{section.path}.{name}{suffix}`".replace("`.", "`") for _, suffix in _models_in(hints[name])]
        kind = f"section {' or '.join(subs)}" if subs else _bounded(type_name(hints[name], named),
                                                                     _bounds(field.metadata))
        rows.append(f"| `{name}` | {_cell(kind)} | {_cell(default(field))} | {_cell(field.description or '')} |")
    return "\n\n".join(part for part in (f"## {title}", doc, "\n".join(rows)) if part)


def render_types(named: dict[Any, str]) -> str:
    """The named value types with the characters each admits, read from the validator that enforces it."""
    rows = ["| type | is | allowed |", "|---|---|---|"]
    for hint, name in sorted(named.items(), key=lambda item: item[1]):
        checks = [meta.func for meta in typing.get_args(hint)[1:] if hasattr(meta, "func")]
        closures = [inspect.getclosurevars(check).nonlocals for check in checks]
        found = next((c for c in closures if "regex" in c), None)
        if found is None:
            continue
        extra = [_CHECKS[check.__name__] for check in checks if check.__name__ in _CHECKS]
        what = ", ".join([found["what"], *extra])
        rows.append(f"| `{name}` | {_cell(what)} | `{_cell(found['regex'].pattern)}` |")
    return "## Value types\n\n" + "\n".join(rows)


def render() -> str:
    """The whole of docs/params.md."""
    named = aliases()
    parts = [HEADER.strip(), *(render_section(s, named) for s in sections()), render_types(named)]
    return "\n\n".join(parts) + "\n"
