"""How 01 launches a stopped process again (its working directory, exact argv and user from /proc), kept so that the
restore plan never holds a secret: the run dir is scrubbed, and a relaunched `[REDACTED]` is no relaunch. Every known
secret (params' `secrets`) inside an argv element, whole or within it (`--hf-token=V`, `http://u:V@h`), is recorded as
its variable's reference and read from the controller's environment when `sparkbook restore` runs; an element that
looks like a secret sparkbook does not know leaves the process without a relaunch, said in the plan."""
from __future__ import annotations

import re
import shlex
from collections.abc import Mapping
from dataclasses import dataclass, field

from ...core.values.redact import secret_args

# a template's pieces: `${NAME}` (a secret's variable) or `$$` (a `$` of the element's own text)
_PIECE = re.compile(r"(\$\$|\$\{[A-Za-z_][A-Za-z0-9_]*\})")


@dataclass(frozen=True)
class SecretRef:
    """An argv element that carried known secrets, as a template: each secret is `${NAME}`, its variable (never the
    value), and a `$` of the element's own text is `$$` (`http://u:${PASS}@h`, `--hf-token=${HF_TOKEN}`)."""

    template: str

    def pieces(self) -> list[tuple[str, bool]]:
        """(text, whether it names a secret's variable) in order; literal `$$` back to `$`."""
        out = []
        for part in _PIECE.split(self.template):
            if part.startswith("${"):
                out.append((part[2:-1], True))
            elif part:
                out.append(("$" if part == "$$" else part, False))
        return out

    def secrets(self) -> list[str]:
        return [text for text, secret in self.pieces() if secret]

    def shell(self) -> str:
        """The element in a shell command: each literal piece quoted, each secret its variable's reference."""
        return "".join(f'"${{{text}}}"' if secret else shlex.quote(text) for text, secret in self.pieces()) or "''"

    def pattern(self) -> str:
        """A regex of the element as `ps` shows it: its literal pieces, any value where a secret was."""
        return "".join(".+" if secret else re.escape(text) for text, secret in self.pieces())


@dataclass(frozen=True)
class RunAs:
    """The user a stopped process ran as, where that is not the SSH user 01 reached the node by: the relaunch drops
    to it (setpriv, from root), so restore never starts it as root."""

    uid: int
    gid: int
    groups: list[int] = field(default_factory=list)

    def prefix(self) -> str:
        groups = f"--groups={','.join(map(str, self.groups))}" if self.groups else "--clear-groups"
        return f"setpriv --reuid={self.uid} --regid={self.gid} {groups} -- "


@dataclass(frozen=True)
class Relaunch:
    """A stopped process's relaunch: its working directory and argv (each secret by reference) and, where it ran as
    another user than the SSH user, that user."""

    cwd: str
    argv: list[str | SecretRef]
    user: RunAs | None = None

    def secrets(self) -> list[str]:
        """The variables its argv reads, in order, each once."""
        return list(dict.fromkeys(n for a in self.argv if isinstance(a, SecretRef) for n in a.secrets()))

    def command(self) -> str:
        """The relaunch as one shell command (run under `sh -c`, written to restore.sh, recorded): each secret read
        first from stdin into its variable, so no value is on a command line but the process's own; then detached,
        from its working directory, as its own user."""
        argv = " ".join(a.shell() if isinstance(a, SecretRef) else shlex.quote(a) for a in self.argv)
        reads = "".join(f"IFS= read -r {name} && " for name in self.secrets())
        user = self.user.prefix() if self.user else ""
        return f"{reads}cd {shlex.quote(self.cwd or '/')} && {{ {user}setsid {argv} </dev/null >/dev/null 2>&1 & }}"

    def stdin(self, values: Mapping[str, str]) -> bytes | None:
        """What `command` reads: each secret's value on a line of its own; None where it reads none."""
        names = self.secrets()
        return "".join(f"{values[n]}\n" for n in names).encode() if names else None

    def identifies(self, args: str) -> bool:
        """Whether a process's command line (ps's args: argv joined by spaces) is this one's: by its non-secret
        parts, any value where a secret was, so the check needs no secret's value. An argv whose program is not
        plain text (empty, or a secret's reference) identifies nothing: its pattern would match any process."""
        if not self.argv or not isinstance(self.argv[0], str) or not self.argv[0]:
            return False
        parts = [re.escape(a) if isinstance(a, str) else a.pattern() for a in self.argv]
        return re.fullmatch(" ".join(parts), args, re.S) is not None


def _reference(arg: str, known: Mapping[str, str]) -> str | SecretRef:
    """The element with each known secret (name -> value) it carries, anywhere in it, replaced by its variable's
    reference (the longest value first); the element as it is where it carries none."""
    names = {value: name for name, value in known.items() if value}
    if not any(value in arg for value in names):
        return arg
    either = "|".join(re.escape(v) for v in sorted(names, key=len, reverse=True))
    parts = re.split(f"({either})", arg)  # the odd ones are the values
    return SecretRef("".join("${" + names[p] + "}" if i % 2 else p.replace("$", "$$") for i, p in enumerate(parts)))


def recorded(cwd: str, argv: list[str], known: Mapping[str, str], user: RunAs | None = None) -> Relaunch:
    """The relaunch with every known secret (name -> value) in each element recorded by the name."""
    return Relaunch(cwd, [_reference(a, known) for a in argv], user)


def unknown_secret(argv: list[str], known: Mapping[str, str]) -> str | None:
    """Why the process cannot be relaunched faithfully: an element looks like a secret (the redactor's shapes) and
    still does once the known secrets are taken out. None where every one is known."""
    either = "|".join(re.escape(v) for v in sorted(filter(None, known.values()), key=len, reverse=True))
    bare = [re.sub(either, "X", a) if either else a for a in argv]  # a stand-in no redactor shape takes for a secret
    unknown = [f"argv[{i}]" for i in secret_args(bare)]
    if not unknown:
        return None
    return (f"its command line carried a secret sparkbook does not know ({', '.join(unknown)}); add its variable to "
            "params.secrets (it is then recorded by name), or restart it by hand")
