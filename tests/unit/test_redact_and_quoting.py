"""Redaction of secrets, and commands quoted by construction (params never reach a shell unquoted)."""
from __future__ import annotations

import shlex
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from sparkbook.core.cluster.nodes import _remote_argv, bash, shell
from sparkbook.core.values.redact import MASK, Redactor

HOSTILE = ["; touch {p}", "$(touch {p})", "`touch {p}`", "a' ; touch {p} ; '", '"; touch {p}; "', "x\ntouch {p}",
           "| touch {p}", "&& touch {p}", "$((1+1))", "*"]


@pytest.mark.parametrize("template", [shell, bash])
@pytest.mark.parametrize("value", HOSTILE)
def test_shell_template_quotes_values(template: Callable[..., list[str]], value: str, tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    argv = template("echo {v}", v=value.format(p=marker))
    out = subprocess.run(argv, capture_output=True, text=True, timeout=10).stdout
    assert not marker.exists()
    assert out.rstrip("\n") == value.format(p=marker)


@pytest.mark.parametrize("value", HOSTILE)
def test_remote_command_line_keeps_each_argument_whole(value: str, tmp_path: Path) -> None:
    """What a node's login shell receives: argv joined with quotes, env included, under `timeout`."""
    marker = tmp_path / "pwned"
    line = shlex.join(_remote_argv(["printf", "%s", value.format(p=marker)], {"V": value.format(p=marker)}, 10))
    out = subprocess.run(["sh", "-c", line], capture_output=True, text=True, timeout=20).stdout
    assert not marker.exists()
    assert out == value.format(p=marker)


def test_remote_timeout_is_enforced_on_the_node() -> None:
    line = shlex.join(_remote_argv(["sleep", "30"], None, 1))
    proc = subprocess.run(["sh", "-c", line], timeout=15)
    assert proc.returncode == 124


def test_redacts_named_secret_values_and_token_shapes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MY_SECRET", "s3cr3t-value-42")
    r = Redactor.from_env(["MY_SECRET", "UNSET_VAR"])
    text = ("value s3cr3t-value-42 in a log; hf_abcdefghijklmnopqrstuvwx; Authorization: Bearer abcdefghijklmnop1234;"
            " HF_TOKEN=whatever123; -----BEGIN OPENSSH PRIVATE KEY-----\nAAAA\n-----END OPENSSH PRIVATE KEY-----")
    clean = r.text(text)
    for secret in ("s3cr3t-value-42", "hf_abcdefghijklmnopqrstuvwx", "abcdefghijklmnop1234", "whatever123", "AAAA"):
        assert secret not in clean
    assert clean.count(MASK) >= 5
    assert r.data({"a": ["x s3cr3t-value-42"], "b": 3}) == {"a": [f"x {MASK}"], "b": 3}


def test_redaction_leaves_ordinary_text_alone() -> None:
    text = "vllm serve /srv/models/hyv4-tiny --tensor-parallel-size 2 --max-num-seqs 16 tokens=64"
    assert Redactor().text(text) == text


def test_redaction_keeps_vllm_config_fields() -> None:
    text = "tokenizer_mode=auto, max_num_batched_tokens=2048, skip_tokenizer_init=False, HF_TOKEN=abcd1234"
    assert Redactor().text(text) == f"tokenizer_mode=auto, max_num_batched_tokens=2048, skip_tokenizer_init=False, HF_TOKEN={MASK}"
