"""Redaction: secret values and token- or key-shaped strings never reach a display, a log or an archive."""
from __future__ import annotations

import math
import os
import re
import shlex
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MASK = "[REDACTED]"
TOKEN_SHAPES = re.compile(
    r"-----BEGIN [A-Z ]*PRIVATE KEY-----.*?-----END [A-Z ]*PRIVATE KEY-----"
    r"|\bhf_[A-Za-z0-9]{20,}"
    r"|\bsk-[A-Za-z0-9_-]{20,}"
    r"|\bgh[pousr]_[A-Za-z0-9]{20,}"
    r"|\bxox[abpr]-[A-Za-z0-9-]{10,}"
    r"|\bAKIA[0-9A-Z]{16}\b"
    r"|(?i:\bbearer\s+)[A-Za-z0-9._~+/-]{16,}=*",
    re.S,
)
ASSIGNED = re.compile(r"\b((?:[A-Z0-9_]*(?:TOKEN|SECRET|PASSWORD|API_KEY|APIKEY))|(?i:password|passwd|secret|"
                      r"api[_-]?key|access[_-]?token|auth[_-]?token))\b(\s*[=:]\s*)(\"?)([^\s\"']{4,})")

# A secret flag's value on a command line, `--flag=V` or `--flag V`, bare or quoted (vllm serve --api-key, --hf-token;
# huggingface-cli --token; --password, --client-secret), whatever the value's shape. Not a value: `--max-tokens 64`,
# `--tokenizer X`, a flag that follows (`--api-key --port`), a shell variable the secret is read from (`"$HF_TOKEN"`).
SECRET_FLAG = re.compile(r"(?i)(--(?:[a-z0-9]+-)*(?:api-?key|token|password|passwd|secret))(=|\s+)(?!['\"]?\$\{?\w)"
                         r"(?:(['\"])[^'\"]+\3|(?!-)[^\s'\"]{4,})")


# A run of letters and digits this long, mixing upper case, lower case and digits, with this much entropy per character
# and switching between those classes this often, is a random key (an API key, a password manager's), not a word, a
# CamelCase model name (Qwen3Next80BA3BInstructFP8: switches 0.42) or a hex digest (3.7 bits at most over 16 symbols).
RANDOM_RUN = re.compile(r"[A-Za-z0-9]{32,}")
RANDOM_BITS, RANDOM_SWITCHES = 4.0, 0.45
SECRET_NAME = re.compile(r"[A-Za-z0-9_]*(?:TOKEN|SECRET|PASSWORD|PASSWD|API_KEY|APIKEY)", re.I)


@dataclass(frozen=True)
class Redactor:
    """Replaces the given secret values and anything token-shaped."""

    secrets: tuple[str, ...] = ()

    @classmethod
    def from_env(cls, names: list[str]) -> Redactor:
        values = [os.environ[n] for n in names if len(os.environ.get(n, "")) >= 4]
        return cls(tuple(sorted(values, key=len, reverse=True)))

    def text(self, text: str) -> str:
        for value in self.secrets:
            text = text.replace(value, MASK)
        text = TOKEN_SHAPES.sub(MASK, text)
        text = SECRET_FLAG.sub(lambda m: f"{m[1]}{m[2]}{m[3] or ''}{MASK}{m[3] or ''}", text)
        return ASSIGNED.sub(lambda m: f"{m[1]}{m[2]}{m[3]}{MASK}", text)

    def data(self, value: Any) -> Any:
        """Redact every string inside nested dicts, lists and tuples."""
        if isinstance(value, str):
            return self.text(value)
        if isinstance(value, dict):
            return {self.data(k): self.data(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(self.data(v) for v in value)
        return value


def token_shaped(text: str) -> bool:
    """Whether text holds something shaped like a secret: a known token's shape (hf_, sk-, ghp_, a private key...),
    a secret flag's or `NAME=`'s value, or a long random-looking run (RANDOM_RUN). What a params value must not be."""
    return Redactor().text(text) != text or any(_random(run) for run in RANDOM_RUN.findall(text))


def _random(run: str) -> bool:
    kinds = ["d" if c.isdigit() else "u" if c.isupper() else "l" for c in run]
    if len(set(kinds)) < 3:
        return False
    bits = -sum(n / len(run) * math.log2(n / len(run)) for n in Counter(run).values())
    switches = sum(a != b for a, b in zip(kinds, kinds[1:], strict=False)) / (len(run) - 1)
    return bits >= RANDOM_BITS and switches >= RANDOM_SWITCHES


def secret_args(argv: Sequence[str]) -> list[int]:
    """The indexes of the argv elements the redactor masks, alone (`hf_...`, `--api-key=V`, `HF_TOKEN=V`) or as the
    value after a secret flag (`--hf-token V`): a command line kept to be run again must not hold them."""
    def masked(text: str) -> bool:
        return Redactor().text(text) != text

    return [i for i, arg in enumerate(argv) if masked(arg)
            or (i > 0 and not masked(argv[i - 1]) and masked(shlex.join(argv[i - 1:i + 1])))]


def text_files(root: Path) -> Iterator[tuple[Path, str]]:
    """Every file under root that is text (no NUL byte, as git tells text from binary), with its text (a stray
    invalid byte replaced): what a scrub redacts whatever the suffix (restore.sh, a log without one); binary files
    (a PNG plot) are left whole, and links are not followed (they may lead out of root)."""
    for path in sorted(root.rglob("*")):
        if path.is_file() and not path.is_symlink() and b"\0" not in (data := path.read_bytes()):
            yield path, data.decode(errors="replace")
