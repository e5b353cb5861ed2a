"""Issue 56, deliver 3: `sparkbook check` refuses a secret typed into an env or argv setting (serve.env, node_env,
runtime.env, ray.env, extra_args): a named secret's value as this controller holds it, a token-shaped or random-looking
value, a secret flag's value, a secret's variable given a value. One line per field, naming it and what to do, never
the value; what only looks busy (a model name, a digest, `--max-tokens 64`) passes."""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from sparkbook import cli
from sparkbook.cli import exits

NAMED = "correct horse battery staple"  # no token's shape: only the controller's environment says it is a secret
RANDOM = "nqeubb7Drt3diK39UB9BTNTHViKiTjqR"  # a random key of no known prefix


def _refused(data: dict[str, Any], write_params: Callable[..., Path], capsys: pytest.CaptureFixture[str],
             secret: str) -> str:
    assert cli.main(["check", str(write_params(data))]) == exits.EXIT_INVALID
    err = capsys.readouterr().err
    assert secret not in err and "Traceback" not in err
    assert "name its variable under `secrets`" in err, "it says what to do instead"
    return err


@pytest.mark.parametrize("where, setting, field, value", [
    ("serve", {"env": {"HF_TOKEN": "my-plain-hf-secret"}}, "serve.env", "my-plain-hf-secret"),
    ("runtime", {"env": {"PROXY_PASSWORD": "hunter2hunter2"}}, "runtime.env", "hunter2hunter2"),
    ("serve", {"node_env": {"b": {"VLLM_API_KEY": "letmein-please"}}}, "serve.node_env.b", "letmein-please"),
])
def test_a_secrets_variable_given_a_value_in_an_env_setting_is_refused(
        where: str, setting: dict[str, Any], field: str, value: str, base: dict[str, Any],
        write_params: Callable[..., Path], capsys: pytest.CaptureFixture[str]) -> None:
    base[where] = {**base.get(where, {}), **setting}
    err = _refused(base, write_params, capsys, value)
    assert field in err and "a secret's variable with a value typed in" in err


@pytest.mark.parametrize("args, said", [
    (["--api-key", "abcd1234efgh"], "extra_args[1]"),  # the value in the element after the flag
    (["--hf-token=abcd1234efgh"], "looks like a token"),
    ([f"--served-model-name={RANDOM}"], "looks like a token"),  # random-looking, no known prefix
])
def test_a_secret_typed_into_extra_args_is_refused(args: list[str], said: str, base: dict[str, Any],
                                                    write_params: Callable[..., Path],
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    base["serve"]["extra_args"] = args
    err = _refused(base, write_params, capsys, args[-1].partition("=")[2] or args[-1])
    assert "serve.extra_args" in err and said in err


def test_a_random_looking_value_in_runtime_env_is_refused(base: dict[str, Any], write_params: Callable[..., Path],
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    base["runtime"]["env"] = {"SOME_SETTING": RANDOM}
    err = _refused(base, write_params, capsys, RANDOM)
    assert "runtime.env.SOME_SETTING" in err and "looks like a token" in err


def test_a_named_secrets_value_typed_anywhere_is_refused_naming_field_and_variable(
        base: dict[str, Any], write_params: Callable[..., Path], capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPARKBOOK_TEST_TOKEN", NAMED)
    base["serve"]["env"] = {"GREETING": NAMED}
    base["ray"] = {"env": {"MOTD": f"hello {NAMED}"}}
    err = _refused(base, write_params, capsys, NAMED)
    assert "serve.env: holds the value of SPARKBOOK_TEST_TOKEN" in err
    assert "ray.env: holds the value of SPARKBOOK_TEST_TOKEN" in err


def test_what_only_looks_busy_passes(base: dict[str, Any], write_params: Callable[..., Path],
                                     capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPARKBOOK_TEST_TOKEN", NAMED)
    base["serve"]["env"] = {"HF_HUB_DISABLE_IMPLICIT_TOKEN": "1", "TOKENIZERS_PARALLELISM": "false",
                            "MODEL_ALIAS": "Qwen3Next80BA3BInstructFP8Dynamic2",
                            "DIGEST": "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"}
    base["serve"]["extra_args"] = ["--max-num-batched-tokens", "8192", "--tokenizer-mode=auto"]
    assert cli.main(["check", str(write_params(base))]) == 0, capsys.readouterr().err
