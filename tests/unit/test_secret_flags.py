"""Issue 43, item 3 (the redactor): a secret flag's value in the space form (`--hf-token V`, `--api-key V`) is
redacted as `--api-key=V` was, and every text file of a run dir, restore.sh among them, is scrubbed before it is
packed into the archive."""
from __future__ import annotations

import tarfile
from pathlib import Path

import pytest

from sparkbook.core.values.redact import MASK, Redactor
from sparkbook.runbook import driver

HF = "hf_abcdefghijklmnopqrstuvwxyz0123"
SK = "sk-abcdefghijklmnopqrstuvwx0123"
OLD = (f"docker exec vllm vllm serve /models/x --hf-token {HF} --api-key {SK} --port 8000\n"
       "vllm serve m --api-key plainkey42 --hf-token 'quoted value' --token=other99 --max-tokens 64\n")


@pytest.mark.parametrize("line, secret", [
    (f"vllm serve m --hf-token {HF} --port 8000", HF),
    (f"vllm serve m --api-key {SK}", SK),
    ("vllm serve m --api-key  plainkey42 --port 8000", "plainkey42"),  # no token shape: the flag says it
    ("vllm serve m --HF-TOKEN Plain-Value-7", "Plain-Value-7"),
    ("huggingface-cli download --token plain99 x", "plain99"),
    ("vllm serve m --api-key 'my key' --port 8000", "my key"),
    ("vllm serve m --client-secret=plain-77", "plain-77"),
])
def test_a_secret_flags_value_is_redacted_in_the_space_form(line: str, secret: str) -> None:
    clean = Redactor().text(line)
    assert secret not in clean and MASK in clean
    assert clean.split()[:3] == line.split()[:3] and ("--port 8000" in clean) == ("--port 8000" in line)


@pytest.mark.parametrize("line", [
    "vllm serve m --max-tokens 64 --tokenizer hf-internal/tok --tokenizer-mode auto --secret-name cfg",
    "vllm serve m --api-key --port 8000",  # a flag follows: no value to hide
    'vllm serve m --hf-token "$HF_TOKEN" --api-key ${VLLM_API_KEY}',  # read from the environment, not written
])
def test_ordinary_flags_and_variable_references_stay(line: str) -> None:
    assert Redactor().text(line) == line


def test_the_archive_holds_no_secret_from_restore_sh_or_any_text_file(tmp_path: Path) -> None:
    run_dir = tmp_path / "lab" / "20261201T100000Z"
    (run_dir / "logs").mkdir(parents=True)
    (run_dir / "restore.sh").write_text(f"#!/bin/sh\n{OLD}")
    (run_dir / "logs" / "old-cmdline").write_text(OLD)  # no suffix at all
    png = b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR" + b"--api-key plainkey42"  # binary: left whole
    (run_dir / "plot.png").write_bytes(png)
    driver._scrub(run_dir, Redactor())
    assert (run_dir / "plot.png").read_bytes() == png
    with tarfile.open(driver.pack_run(run_dir)) as tar:
        texts = {m.name: tar.extractfile(m).read() for m in tar.getmembers() if m.isfile()}  # type: ignore[union-attr]
    assert {Path(n).name for n in texts} == {"restore.sh", "old-cmdline", "plot.png"}
    for name, data in texts.items():
        if not name.endswith(".png"):
            text = data.decode()
            assert not any(s in text for s in (HF, SK, "plainkey42", "quoted value", "other99")), name
            assert "--max-tokens 64 " in text or text.endswith("--max-tokens 64\n"), name
