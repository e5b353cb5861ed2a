"""The keyed router's launcher (serve.api_key_env behind vllm-router): the validation URL it answers accepts the key
alone, it starts nothing without the key, and the front's argv goes through it only where a key is set. The router
itself refusing requests without the key is proven on the lab (test_replicas_lab)."""
from __future__ import annotations

import threading

import httpx
import pytest
from test_front import value, with_front
from test_serve_plan import ctx

from sparkbook.stages.serve import bringup, keyed_router, router


@pytest.fixture
def validation_url():
    server = keyed_router.validator("s3cret-key")
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/"
    server.shutdown()
    server.server_close()


@pytest.mark.parametrize(("authorization", "status"), [
    ("Bearer s3cret-key", 200),
    ("Bearer s3cret-keyX", 401),
    ("Bearer s3cret", 401),
    ("bearer s3cret-key", 401),
    ("s3cret-key", 401),
    (None, 401)])
def test_the_validation_url_accepts_the_key_alone(validation_url, authorization, status):
    headers = {"Authorization": authorization} if authorization else {}
    assert httpx.get(validation_url, headers=headers, timeout=5).status_code == status


def test_without_the_key_nothing_starts(monkeypatch, capsys):
    monkeypatch.delenv(keyed_router.KEY_ENV, raising=False)
    assert keyed_router.main(["--port", "1"]) == 2
    assert f"{keyed_router.KEY_ENV} is empty or not set" in capsys.readouterr().err


def test_the_front_goes_through_the_keyed_launcher_only_with_a_key(lab):
    keyed, plain = with_front(lab, api_key_env="VLLM_KEY"), with_front(lab)
    keyed_argv = bringup.layout_plan(ctx(keyed), "mp", keyed.serve, "").router.argv
    plain_argv = bringup.layout_plan(ctx(plain), "mp", plain.serve, "").router.argv
    assert keyed_argv[:3] == ["python3", "-m", router.KEYED] and value(keyed_argv, "--prometheus-host") == "127.0.0.1"
    assert plain_argv[:3] == ["python3", "-m", "vllm_router.launch_router"] and "--prometheus-host" not in plain_argv
    assert [a for a in keyed_argv[3:] if a not in ("--prometheus-host", "127.0.0.1")] == plain_argv[3:]
    assert "VLLM_KEY" not in " ".join(keyed_argv)  # the key travels as a secret, never by name or value on an argv
