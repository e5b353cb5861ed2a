"""Redaction: secret values and token- or key-shaped strings never reach a display, a log or an archive."""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
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
