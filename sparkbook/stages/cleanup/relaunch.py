"""How 01 launches a stopped process again (its working directory and exact argv from /proc), kept so that the
restore plan never holds a secret: the run dir is scrubbed, and a relaunched `[REDACTED]` is no relaunch. An argv
element that carried a secret the controller knows (params' `secrets`) is recorded as that variable's name and read
from the controller's environment when `sparkbook restore` runs; one that looks like a secret sparkbook does not
know leaves the process without a relaunch, said in the plan."""
from __future__ import annotations

import re
import shlex
from collections.abc import Mapping
from dataclasses import dataclass

from ...core.values.redact import secret_args


@dataclass(frozen=True)
class SecretRef:
    """An argv element that carried a known secret: the variable that holds it, after what came before the value in
    the same element (`--hf-token=`, `HF_TOKEN=`); never the value."""

    secret: str
    prefix: str = ""

    def shell(self) -> str:
        """The element in a shell command: the variable's reference, quoted."""
        return (shlex.quote(self.prefix) if self.prefix else "") + f'"${self.secret}"'


@dataclass(frozen=True)
class Relaunch:
    """A stopped process's relaunch: its working directory and argv, each secret a reference to its variable."""

    cwd: str
    argv: list[str | SecretRef]

    def secrets(self) -> list[str]:
        """The variables its argv reads, in order, each once."""
        return list(dict.fromkeys(a.secret for a in self.argv if isinstance(a, SecretRef)))

    def command(self) -> str:
        """The relaunch as one shell command (run under `sh -c`, written to restore.sh, recorded): each secret read
        first from stdin into its variable, so no value is on a command line but the process's own; then detached,
        from its working directory."""
        argv = " ".join(a.shell() if isinstance(a, SecretRef) else shlex.quote(a) for a in self.argv)
        reads = "".join(f"IFS= read -r {name} && " for name in self.secrets())
        return f"{reads}cd {shlex.quote(self.cwd or '/')} && {{ setsid {argv} </dev/null >/dev/null 2>&1 & }}"

    def stdin(self, values: Mapping[str, str]) -> bytes | None:
        """What `command` reads: each secret's value on a line of its own; None where it reads none."""
        names = self.secrets()
        return "".join(f"{values[n]}\n" for n in names).encode() if names else None

    def identifies(self, args: str) -> bool:
        """Whether a process's command line (ps's args: argv joined by spaces) is this one's: by its non-secret
        parts, any value where a secret was, so the check needs no secret's value."""
        parts = [re.escape(a) if isinstance(a, str) else re.escape(a.prefix) + ".+" for a in self.argv]
        return re.fullmatch(" ".join(parts), args, re.S) is not None


def _reference(arg: str, known: Mapping[str, str]) -> SecretRef | None:
    """The known secret `arg` carries whole, bare or after `NAME=` / `--flag=`; None where it carries none."""
    for name, value in known.items():
        prefix = arg.removesuffix(value)
        if value and len(prefix) < len(arg) and (not prefix or prefix.endswith("=")):
            return SecretRef(name, prefix)
    return None


def recorded(cwd: str, argv: list[str], known: Mapping[str, str]) -> Relaunch:
    """The relaunch with each element that carries a known secret (name -> value) recorded by the name."""
    return Relaunch(cwd, [_reference(a, known) or a for a in argv])


def unknown_secret(argv: list[str], known: Mapping[str, str]) -> str | None:
    """Why the process cannot be relaunched faithfully: an element looks like a secret (the redactor's shapes) and
    carries none the controller knows. None where every one is known."""
    unknown = [f"argv[{i}]" for i in secret_args(argv) if _reference(argv[i], known) is None]
    if not unknown:
        return None
    return (f"its command line carried a secret sparkbook does not know ({', '.join(unknown)}); add its variable to "
            "params.secrets (it is then recorded by name), or restart it by hand")
