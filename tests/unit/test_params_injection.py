"""Injection through params: every free-text field that reaches a node rejects shell syntax, naming the field.

What the schema does allow (spaces, quotes and braces in environment values and extra arguments) travels as
one argv element, quoted by construction (test_redact_and_quoting.py; against the lab: tests/lab/test_injection.py).
"""
from __future__ import annotations

import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel

from sparkbook.core.values.params import Params, ParamsError, load_params

HOSTILE = ["; touch /tmp/pwned", "$(touch /tmp/pwned)", "`touch /tmp/pwned`", "| touch /tmp/pwned",
           "&& touch /tmp/pwned", "x\ntouch /tmp/pwned", "ok\n", "> /tmp/pwned"]

# (schema path, how to put a value there, the field the error must name)
STRING_FIELDS: list[tuple[str, Callable[[dict[str, Any], str], None], str]] = [
    ("cluster", lambda d, v: d.update(cluster=v), "cluster"),
    ("ssh.user", lambda d, v: d["ssh"].update(user=v), "ssh.user"),
    ("nodes.name", lambda d, v: d["nodes"][0].update(name=v), "nodes[0].name"),
    ("nodes.host", lambda d, v: d["nodes"][0].update(host=v), "nodes[0].host"),
    ("nodes.fabric_netdev", lambda d, v: d["nodes"][0].update(fabric_netdev=v), "nodes[0].fabric_netdev"),
    ("nodes.roce_hcas", lambda d, v: d["nodes"][0].update(roce_hcas=[v]), "nodes[0].roce_hcas[0]"),
    ("nodes.ssh_user", lambda d, v: d["nodes"][1].update(ssh_user=v), "nodes[1].ssh_user"),
    ("runtime.images", lambda d, v: d["runtime"].update(images=[v]), "runtime.images[0]"),
    ("runtime.installed_image", lambda d, v: d["runtime"].update(installed_image=v), "runtime.installed_image"),
    ("runtime.shm_size", lambda d, v: d["runtime"].update(shm_size=v), "runtime.shm_size"),
    ("runtime.memory_limit", lambda d, v: d["runtime"].update(memory_limit=v), "runtime.memory_limit"),
    ("runtime.cache_dir", lambda d, v: d["runtime"].update(cache_dir=v), "runtime.cache_dir"),
    ("runtime.env", lambda d, v: d["runtime"].update(env={"A": v}), "runtime.env.A"),
    ("runtime.env (name)", lambda d, v: d["runtime"].update(env={v: "1"}), "runtime.env"),
    ("runtime.python", lambda d, v: d.update(runtime={"kind": "python", "python": v}), "runtime.python"),
    ("model.path", lambda d, v: d.update(model={"path": v, "served_name": "m", "cache_dir": "/srv"}), "model.path"),
    ("model.hf_id", lambda d, v: d["model"].update(hf_id=v), "model.hf_id"),
    ("model.served_name", lambda d, v: d["model"].update(served_name=v), "model.served_name"),
    ("model.cache_dir", lambda d, v: d["model"].update(cache_dir=v), "model.cache_dir"),
    ("model.transfer.reserve", lambda d, v: d["model"].update(transfer={"reserve": v}), "model.transfer.reserve"),
    ("cleanup.containers", lambda d, v: d.update(cleanup={"containers": [v]}), "cleanup.containers[0]"),
    ("cleanup.systemd_units", lambda d, v: d.update(cleanup={"systemd_units": [v]}), "cleanup.systemd_units[0]"),
    ("cleanup.processes", lambda d, v: d.update(cleanup={"processes": [v]}), "cleanup.processes[0]"),
    ("cleanup.order", lambda d, v: d.update(cleanup={"order": [v]}), "cleanup.order[0]"),
    ("ray.env", lambda d, v: d.update(ray={"env": {"A": v}}), "ray.env.A"),
    ("serve.kv_cache_memory_bytes", lambda d, v: d["serve"].update(kv_cache_memory_bytes=v),
     "serve.kv_cache_memory_bytes"),
    ("serve.reasoning_parser", lambda d, v: d["serve"].update(reasoning_parser=v), "serve.reasoning_parser"),
    ("serve.tool_call_parser", lambda d, v: d["serve"].update(tool_call_parser=v), "serve.tool_call_parser"),
    ("serve.chat_template", lambda d, v: d["serve"].update(chat_template=v), "serve.chat_template"),
    ("serve.smoke.prompt", lambda d, v: d["serve"].update(smoke={"prompt": v}), "serve.smoke.prompt"),
    ("serve.smoke.expect", lambda d, v: d["serve"].update(smoke={"expect": v}), "serve.smoke.expect"),
    ("serve.extra_args", lambda d, v: d["serve"].update(extra_args=[v]), "serve.extra_args[0]"),
    ("serve.env", lambda d, v: d["serve"].update(env={"A": v}), "serve.env.A"),
    ("serve.node_env", lambda d, v: d["serve"].update(node_env={"a": {"A": v}}), "serve.node_env.a.A"),
    ("serve.api_key_env", lambda d, v: d["serve"].update(api_key_env=v), "serve.api_key_env"),
    ("serve.speculative.model", lambda d, v: d["serve"].update(
        speculative={"method": "eagle3", "num_speculative_tokens": 2, "model": v}), "serve.speculative.model"),
    ("secrets", lambda d, v: d.update(secrets=[v]), "secrets[0]"),
    ("nodes.state_dir", lambda d, v: d["nodes"][0].update(state_dir=v), "nodes[0].state_dir"),
]
CASES = [(path, put, field, value) for path, put, field in STRING_FIELDS for value in HOSTILE]


@pytest.mark.parametrize("path,put,field,value", CASES, ids=[f"{c[0]}-{HOSTILE.index(c[3])}" for c in CASES])
def test_shell_syntax_in_a_string_field_is_rejected_naming_it(path: str, put: Callable, field: str, value: str,
                                                              base: dict[str, Any],
                                                              write_params: Callable[..., Path]) -> None:
    put(base, value)
    with pytest.raises(ParamsError) as caught:
        load_params(write_params(base))
    fields = [p.field for p in caught.value.problems]
    assert any(f == field or f.startswith(field + ".") or f.startswith(field + "[") for f in fields), fields


def _string_fields(model: type[BaseModel], prefix: str = "") -> set[str]:
    """Dotted paths of every str-valued field in the schema (lists and dicts of str included)."""
    found = set()
    for name, info in model.model_fields.items():
        stack = [info.annotation]
        while stack:
            ann = stack.pop()
            args = typing.get_args(ann)
            if isinstance(ann, type) and issubclass(ann, BaseModel):
                found |= _string_fields(ann, f"{prefix}{name}.")
            elif ann is str:
                found.add(prefix + name)
            elif args:
                stack.extend(a for a in args if not isinstance(a, (str, int)) and a is not type(None))
    return found


def test_every_string_field_of_the_schema_is_covered() -> None:
    """A new free-text field must join STRING_FIELDS, so its hostile values are tested too."""
    covered = {path.split(" ")[0] for path, _, _ in STRING_FIELDS}
    assert _string_fields(Params) - covered == set()


@pytest.mark.parametrize("value", ["a' b", 'say "hi"', "{json: [1, 2]}", "x=1,y=2", "--flag=a b"])
def test_quotes_and_spaces_are_allowed_where_values_are_free_text(value: str, base: dict[str, Any],
                                                                  write_params: Callable[..., Path]) -> None:
    base["serve"]["env"] = {"A": value}
    base["serve"]["extra_args"] = [value]
    params = load_params(write_params(base))
    assert params.serve.env["A"] == value and params.serve.extra_args == [value]
