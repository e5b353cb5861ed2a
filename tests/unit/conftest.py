"""Fixtures for unit tests: a valid params file of a made-up 2-node cluster (no node is contacted)."""
from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from sparkbook.core.values.params import Params, load_params

BASE: dict[str, Any] = {
    "cluster": "unit",
    "ssh": {"user": "root", "key_file": "id_test", "known_hosts": "known_hosts"},
    "nodes": [
        {"name": "a", "role": "head", "host": "127.0.0.1", "fabric_ip": "10.9.0.1", "fabric_netdev": "eth0",
         "gpus": [0]},
        {"name": "b", "role": "worker", "host": "127.0.0.1", "fabric_ip": "10.9.0.2", "fabric_netdev": "eth0",
         "gpus": [0]},
    ],
    "runtime": {"kind": "docker", "images": ["example/vllm:0.17"]},
    "model": {"hf_id": "Org/Model-1B", "served_name": "model", "cache_dir": "/srv/models"},
    "serve": {"tensor_parallel_size": 2},
    "secrets": ["SPARKBOOK_TEST_TOKEN"],
}


@pytest.fixture
def write_params(tmp_path: Path) -> Callable[[dict[str, Any]], Path]:
    """Write a params dict (with its key and known_hosts files) and return the YAML's path."""
    (tmp_path / "id_test").write_text("not a real key\n")
    (tmp_path / "known_hosts").write_text("")

    def write(data: dict[str, Any], name: str = "cluster.yaml") -> Path:
        path = tmp_path / name
        path.write_text(yaml.safe_dump(data, sort_keys=False))
        return path

    return write


@pytest.fixture
def base() -> dict[str, Any]:
    return copy.deepcopy(BASE)


@pytest.fixture
def lab(tmp_path: Path) -> Params:
    """params/lab.yaml without its ssh files, which may not exist where unit tests run (the front-door tests)."""
    text = (Path(__file__).resolve().parents[2] / "params" / "lab.yaml").read_text()
    for key in ("key_file", "known_hosts"):
        text = text.replace(f"  {key}:", f"  # {key}:")
    (tmp_path / "lab.yaml").write_text(text)
    return load_params(tmp_path / "lab.yaml")


@pytest.fixture(autouse=True, scope="session")
def _sealing_key(tmp_path_factory: pytest.TempPathFactory) -> None:
    """The controller's sealing key (core.values.seal) in a directory of the test session's own, never the user's."""
    import os

    os.environ["XDG_CONFIG_HOME"] = str(tmp_path_factory.mktemp("config"))
