"""What differs between the plan that serves and a new one, field by field, as an operator reads it before
deciding to replace a live server: settings by their params name, each node's argv as the tokens removed and
added, each node's env by variable (names only for values that are not the same)."""
from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Any

from ...core.values.params import ServeSettings


@dataclass(frozen=True)
class Difference:
    field: str  # serve.max_num_seqs, commands[lab-0].argv, commands[lab-0].env.VLLM_X, executor...
    running: str  # as the running plan has it ('' where it has none)
    new: str


def _text(value: Any) -> str:
    return "" if value is None else str(value)


def _argv(node: str, old: list[str], new: list[str]) -> list[Difference]:
    """The changed stretches of one node's argv (equal tokens left out), one Difference per stretch."""
    ops = difflib.SequenceMatcher(a=old, b=new, autojunk=False).get_opcodes()
    return [Difference(f"commands[{node}].argv", " ".join(old[i1:i2]), " ".join(new[j1:j2]))
            for tag, i1, i2, j1, j2 in ops if tag != "equal"]


def _commands(old: list[dict[str, Any]], new: list[dict[str, Any]]) -> list[Difference]:
    before, after = {c["node"]: c for c in old}, {c["node"]: c for c in new}
    out = []
    for node in [*before, *(n for n in after if n not in before)]:
        if node not in after or node not in before:
            out.append(Difference(f"commands[{node}]", "serves" if node in before else "",
                                  "serves" if node in after else ""))
            continue
        out += _argv(node, before[node]["argv"], after[node]["argv"])
        env_old, env_new = before[node]["env"], after[node]["env"]
        out += [Difference(f"commands[{node}].env.{k}", _text(env_old.get(k)), _text(env_new.get(k)))
                for k in sorted({*env_old, *env_new}) if env_old.get(k) != env_new.get(k)]
    return out


CLIENT_ONLY = {"smoke", "quality"}  # settings of 05's own requests, not of the server: changing them replaces nothing


def _added_at_default(key: str, old: dict[str, Any], new: dict[str, Any]) -> bool:
    """A setting the running plan's record lacks (a sparkbook before the field) at its default: the field did not
    exist, the server does what its default does (serve.layout tp, serve.replica_port of replicas), nothing to
    replace."""
    field = ServeSettings.model_fields.get(key)
    return key not in old and field is not None and new.get(key) == field.get_default(call_default_factory=True)


def differences(running: dict[str, Any], new: dict[str, Any]) -> list[Difference]:
    """Every difference between two plans as `reuse` records them (executor, settings, commands, base_url,
    model, model_dir), the client-only settings left out; empty when they are the same plan."""
    old_s, new_s = running["settings"], new["settings"]
    out = [Difference(f"serve.{k}", _text(old_s.get(k)), _text(new_s.get(k)))
           for k in [*old_s, *(k for k in new_s if k not in old_s)]
           if k not in CLIENT_ONLY and old_s.get(k) != new_s.get(k) and not _added_at_default(k, old_s, new_s)]
    out += [Difference(k, _text(running.get(k)), _text(new.get(k)))
            for k in ("executor", "base_url", "model", "model_dir") if running.get(k) != new.get(k)]
    return out + _commands(running["commands"], new["commands"])
