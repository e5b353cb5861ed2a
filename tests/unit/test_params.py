"""The params schema: every malformed file is rejected naming its field, before any connection."""
from __future__ import annotations

import socket
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from sparkbook.core.values.params import ParamsError, load_params


def _set(data: dict[str, Any], dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    for part in parents:
        data = data[int(part)] if part.isdigit() else data[part]
    if value is _DELETE:
        del data[int(leaf) if leaf.isdigit() else leaf]
    else:
        data[int(leaf) if leaf.isdigit() else leaf] = value


_DELETE = object()

# (what is wrong, dotted key to change, new value, field the error must name)
MALFORMED = [
    ("missing cluster", "cluster", _DELETE, "cluster"),
    ("missing nodes", "nodes", _DELETE, "nodes"),
    ("missing model", "model", _DELETE, "model"),
    ("missing runtime", "runtime", _DELETE, "runtime"),
    ("node without fabric_ip", "nodes.1.fabric_ip", _DELETE, "nodes[1].fabric_ip"),
    ("port is text", "ssh.port", "twenty-two", "ssh.port"),
    ("gpus is a string", "nodes.0.gpus", "all", "nodes[0].gpus"),
    ("tp is text", "serve.tensor_parallel_size", "two", "serve.tensor_parallel_size"),
    ("unknown top-level key", "colour", "blue", "colour"),
    ("unknown node key", "nodes.0.password", "hunter2", "nodes[0].password"),
    ("duplicate node names", "nodes.1.name", "a", "nodes[1].name"),
    ("two nodes one fabric ip", "nodes.1.fabric_ip", "10.9.0.1", "nodes[1].fabric_ip"),
    ("tp larger than gpus", "serve.tensor_parallel_size", 4, "serve.tensor_parallel_size"),
    ("bad ip", "nodes.0.fabric_ip", "10.9.0.300", "nodes[0].fabric_ip"),
    ("key file missing", "ssh.key_file", "/nonexistent/id_ed25519", "ssh.key_file"),
    ("known_hosts missing", "ssh.known_hosts", "/nonexistent/known_hosts", "ssh.known_hosts"),
    ("two heads", "nodes.1.role", "head", "nodes"),
    ("unknown role", "nodes.1.role", "boss", "nodes[1].role"),
    ("shell in node name", "nodes.0.name", "a; touch /tmp/pwned", "nodes[0].name"),
    ("substitution in image", "runtime.images", ["x/y:$(reboot)"], "runtime.images[0]"),
    ("relative cache dir", "model.cache_dir", "models", "model.cache_dir"),
    ("token value in env", "serve.env", {"HF_TOKEN": "hf_abcdefghijklmnopqrstuvwxyz"}, "serve.env.HF_TOKEN"),
    ("bad executor", "serve.executor", "slurm", "serve.executor"),
    ("memory utilization above 1", "serve.gpu_memory_utilization", 1.5, "serve.gpu_memory_utilization"),
    ("node_env for unknown node", "serve.node_env", {"zz": {"A": "1"}}, "serve.node_env"),
    ("both model path and hf id", "model.path", "/srv/models/x", "model.path"),
    ("wrong runtime kind", "runtime.kind", "podman", "runtime"),
    ("empty image list", "runtime.images", [], "runtime.images"),
    ("bad secret name", "secrets", ["HF-TOKEN"], "secrets[0]"),
    ("extra arg with backticks", "serve.extra_args", ["--foo", "`id`"], "serve.extra_args[1]"),
    ("pipeline x tensor exceeds gpus", "serve.pipeline_parallel_size", 2, "serve.tensor_parallel_size"),
    ("tp zero", "serve.tensor_parallel_size", 0, "serve.tensor_parallel_size"),
    ("port above 65535", "ssh.port", 70000, "ssh.port"),
    ("negative gpu index", "nodes.0.gpus", [-1], "nodes[0].gpus[0]"),
    ("no nodes", "nodes", [], "nodes"),
    ("no head", "nodes.0.role", "worker", "nodes"),
    ("unknown host key policy", "ssh.host_key_policy", "yolo", "ssh.host_key_policy"),
    ("trust on first use without known_hosts", "ssh", {"user": "root", "host_key_policy": "trust_on_first_use"},
     "ssh.host_key_policy"),
    ("nodes is a mapping", "nodes", {"a": {"role": "head"}}, "nodes"),
    ("negative ready timeout", "serve.ready_timeout_s", -5, "serve.ready_timeout_s"),
    ("concurrency zero", "benchmark", {"concurrency": [1, 0]}, "benchmark.concurrency[1]"),
    ("mtu too small", "fabric", {"mtu": 100}, "fabric.mtu"),
    ("shell in ssh user", "ssh.user", "root;id", "ssh.user"),
    ("substitution in model path", "model", {"path": "/srv/$(id)", "served_name": "m", "cache_dir": "/srv"},
     "model.path"),
    ("secret value pasted as a secret name", "secrets", ["hf_abcdefghijklmnopqrstuvwxyz"], "secrets[0]"),
    ("relative state dir", "nodes.0.state_dir", "state", "nodes[0].state_dir"),
    ("shell in host", "nodes.0.host", "10.0.0.1;reboot", "nodes[0].host"),
    ("fabric ip is a name", "nodes.0.fabric_ip", "node-a", "nodes[0].fabric_ip"),
    ("unknown ssh key", "ssh.password", "hunter2", "ssh.password"),
    ("pipe in a cleanup pattern", "cleanup", {"containers": ["old-*|id"]}, "cleanup.containers[0]"),
    ("duplicate fabric ip and name at once", "nodes.1", {"name": "a", "role": "worker", "host": "127.0.0.1",
                                                       "fabric_ip": "10.9.0.1", "fabric_netdev": "eth0"},
     "nodes[1].name"),
    ("host shaped like an IPv4 address but not one", "nodes.0.host", "999.1.1.1", "nodes[0].host"),
]


@pytest.mark.parametrize("what,key,value,field", MALFORMED, ids=[m[0] for m in MALFORMED])
def test_malformed_is_rejected_naming_the_field(what: str, key: str, value: Any, field: str, base: dict[str, Any],
                                                write_params: Callable[..., Path]) -> None:
    _set(base, key, value)
    path = write_params(base)
    with pytest.raises(ParamsError) as caught:
        load_params(path)
    fields = [p.field for p in caught.value.problems]
    assert any(f == field or f.startswith(field + ".") or f.startswith(field + "[") for f in fields), fields
    assert all(p.file == str(path) for p in caught.value.problems)


def test_valid_file_loads(base: dict[str, Any], write_params: Callable[..., Path]) -> None:
    params = load_params(write_params(base))
    assert params.head.name == "a" and [w.name for w in params.workers] == ["b"]
    assert params.total_gpus == 2


def test_error_names_the_line(base: dict[str, Any], write_params: Callable[..., Path]) -> None:
    base["ssh"]["port"] = "x"
    path = write_params(base)
    with pytest.raises(ParamsError) as caught:
        load_params(path)
    problem = caught.value.problems[0]
    assert path.read_text().splitlines()[problem.line - 1].strip().startswith("port:")


def test_every_field_problem_is_reported_at_once(base: dict[str, Any], write_params: Callable[..., Path]) -> None:
    base["ssh"]["port"] = "x"
    base["serve"]["executor"] = "slurm"
    with pytest.raises(ParamsError) as caught:
        load_params(write_params(base))
    assert {p.field for p in caught.value.problems} >= {"ssh.port", "serve.executor"}


def test_invalid_yaml_names_the_line(write_params: Callable[..., Path]) -> None:
    path = write_params({})
    path.write_text("cluster: x\nnodes: [\n")
    with pytest.raises(ParamsError) as caught:
        load_params(path)
    assert caught.value.problems[0].line is not None


@pytest.mark.parametrize("what,key,value,field", MALFORMED, ids=[m[0] for m in MALFORMED])
def test_cli_exits_2_without_connecting(what: str, key: str, value: Any, field: str, base: dict[str, Any],
                                        write_params: Callable[..., Path], tmp_path: Path) -> None:
    """`sparkbook check` (the first 20 files) and `sparkbook run` (the rest) on a bad file: exit 2, the field
    named, no traceback, no connection to any node (not even for the run lock), no run dir."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    listener.settimeout(0.2)
    port = listener.getsockname()[1]
    base["ssh"]["port"] = port
    _set(base, key, value)
    accepted: list[object] = []
    exited = threading.Event()

    def watch() -> None:  # for as long as the command runs, then once more for a connection still in the backlog
        while True:
            last = exited.is_set()
            try:
                accepted.append(listener.accept())
            except OSError:
                pass
            if last:
                return

    watcher = threading.Thread(target=watch)
    watcher.start()
    first_20 = MALFORMED.index((what, key, value, field)) < 20
    command = ["check"] if first_20 else ["run", "--outputs", str(tmp_path / "o")]
    proc = subprocess.run([sys.executable, "-m", "sparkbook.cli", command[0], str(write_params(base)), *command[1:]],
                          capture_output=True, text=True, timeout=60)
    exited.set()
    watcher.join()
    listener.close()
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    assert field.split("[")[0].split(".")[0] in proc.stderr
    assert not accepted, f"{command[0]} must not connect to any node"
    assert not (tmp_path / "o").exists()


PARAMS_FILES = sorted((Path(__file__).resolve().parents[2] / "params").glob("*.yaml"))
LAB_SSH = Path("/var/lib/sparkbook-lab/ssh")  # the lab's key and known_hosts: `sparkbook lab up` makes them


def test_the_params_folder_holds_the_lab_and_a_real_cluster() -> None:
    assert {"lab.yaml", "spark-duo.yaml"} <= {p.name for p in PARAMS_FILES}


@pytest.mark.parametrize("path", PARAMS_FILES, ids=lambda p: p.name)
def test_every_params_file_in_the_repo_validates(path: Path) -> None:
    """Every file validates as committed. One thing is tolerated: the lab's SSH key and known_hosts (under
    /var/lib/sparkbook-lab/ssh), which exist only after `sparkbook lab up`; where they are absent the file must be
    rejected for them alone and validate without them. No file needs the environment (secrets are named, read at
    use)."""
    ssh = yaml.safe_load(path.read_text()).get("ssh") or {}
    absent = {f"ssh.{key}" for key in ("key_file", "known_hosts")
              if key in ssh and Path(ssh[key]).parent == LAB_SSH and not Path(ssh[key]).is_file()}
    params = load_params(path, dict.fromkeys(absent))
    assert params.nodes and params.head.role == "head"
    if absent:
        with pytest.raises(ParamsError) as caught:
            load_params(path)
        assert {p.field for p in caught.value.problems} <= absent
    else:
        assert load_params(path) == params


def test_cross_field_problems_are_all_reported(base: dict[str, Any], write_params: Callable[..., Path]) -> None:
    base["nodes"][1]["name"] = "a"
    base["nodes"][1]["fabric_ip"] = "10.9.0.1"
    base["serve"]["tensor_parallel_size"] = 8
    with pytest.raises(ParamsError) as caught:
        load_params(write_params(base))
    assert {p.field for p in caught.value.problems} >= {"nodes[1].name", "nodes[1].fabric_ip",
                                                        "serve.tensor_parallel_size"}
    assert all(p.line for p in caught.value.problems)
