"""What params give each node's processes reaches them through its container (issue 30): the worker's own
serve.node_env, the compile caches beside the model cache, Ray's caps; RDMA limits where the node has HCAs; and
05's check of the names each serving process holds."""
from __future__ import annotations

import subprocess
import sys
import types

import pytest

from sparkbook.core.cluster import probes, topology
from sparkbook.core.cluster.runtime import Place
from sparkbook.core.cluster.runtime_docker import DockerNodes
from sparkbook.core.values.params import load_params
from sparkbook.stages.serve import environ
from sparkbook.stages.serve.commands import ServeError


@pytest.fixture
def duo(write_params, base):
    base["nodes"][0].update(roce_hcas=["rocep1s0f1", "roceP2p1s0f1"])
    base["model"]["cache_dir"] = "/home/op/.cache/huggingface"
    base["serve"].update(env={"VLLM_LOGGING_LEVEL": "DEBUG"}, node_env={base["nodes"][1]["name"]: {"ONLY_W": "1"}})
    return load_params(write_params(base))


def test_a_workers_node_env_is_on_its_own_container_and_no_other(duo):
    head, worker = duo.head, duo.workers[0]
    places = topology.places(duo, "img")
    assert places[worker.name].env["ONLY_W"] == "1" and "ONLY_W" not in places[head.name].env
    assert places[head.name].env["VLLM_LOGGING_LEVEL"] == places[worker.name].env["VLLM_LOGGING_LEVEL"] == "DEBUG"


def test_compile_caches_live_beside_the_model_cache_per_cluster_unless_params_say_where(duo, write_params, base):
    """On by default on both runtimes (issue 40, item 7): a replacement and `up` start warm."""
    env = topology.node_env(duo, duo.head)
    assert topology.cache_dir(duo) == "/home/op/.cache/sparkbook-cache/unit"
    assert env["VLLM_CACHE_ROOT"] == "/home/op/.cache/sparkbook-cache/unit/vllm"
    assert {"TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR", "FLASHINFER_WORKSPACE_BASE"} <= set(env)
    base["runtime"] = {"kind": "python", "python": "/usr/bin/python3"}
    python = load_params(write_params(base))
    assert topology.node_env(python, python.head)["TRITON_CACHE_DIR"] == "/home/op/.cache/sparkbook-cache/unit/triton"
    base["runtime"]["cache_dir"] = "/srv/compile"
    assert topology.cache_dir(load_params(write_params(base))) == "/srv/compile"


def test_ray_object_store_is_capped_and_no_workers_prestart_unless_ray_env_says_otherwise(duo, write_params, base):
    env = topology.node_env(duo, duo.head)
    assert env["RAY_object_store_memory"] == str(2**30) and env["RAY_num_prestart_python_workers"] == "0"
    base["ray"] = {"object_store_gib": 4, "env": {"RAY_num_prestart_python_workers": "2"}}
    env = topology.node_env(load_params(write_params(base)), duo.head)
    assert env["RAY_object_store_memory"] == str(4 * 2**30) and env["RAY_num_prestart_python_workers"] == "2"


def node(spec):
    return types.SimpleNamespace(spec=spec, name=spec.name)


def test_rdma_needs_memlock_unlimited_and_ipc_lock_where_the_node_has_hcas(duo):
    runtime = DockerNodes(duo.runtime, duo.model.cache_dir)
    ulimits, caps = runtime.rdma_limits(node(duo.head))
    assert [(u.name, u.soft, u.hard) for u in ulimits] == [("nofile", 1048576, 1048576), ("memlock", -1, -1)]
    assert caps == ("IPC_LOCK",)
    assert runtime.rdma_limits(node(duo.workers[0]))[1] == ()  # no HCAs: no memlock, no capability
    assert [u.name for u in runtime.rdma_limits(node(duo.workers[0]))[0]] == ["nofile"]
    privileged = DockerNodes(duo.runtime.model_copy(update={"privileged": True}), duo.model.cache_dir)
    assert privileged.rdma_limits(node(duo.head))[1] == ()  # a privileged container holds every capability


def test_the_start_spec_is_what_the_command_line_shows(duo):
    """The value start() hands docker-py, rendered: limits, capabilities, mounts and env by name, and no secret at
    all (issue 43, item 3: a container's env is what `docker inspect` shows anyone on the node)."""
    runtime = DockerNodes(duo.runtime, duo.model.cache_dir, {"HF_TOKEN": "hf_secret"}, "/var/cache/compile")
    place = Place(duo.head.name, "sparkbook-node-x", "vllm:1", {"NCCL_SOCKET_IFNAME": "enp1"})
    spec = runtime.start_spec(node(duo.head), place, gpus=True, devices=["/dev/infiniband"])
    line = spec.command_line()
    assert spec.mounts == (duo.model.cache_dir, "/var/cache/compile")
    assert "--ulimit memlock=-1:-1" in line and "--cap-add IPC_LOCK" in line and "--gpus all" in line
    assert f"-v {duo.model.cache_dir}:{duo.model.cache_dir}:rw" in line and "-v /var/cache/compile" in line
    assert "HF_TOKEN" not in line and "hf_secret" not in line and "-e NCCL_SOCKET_IFNAME" in line
    assert "HF_TOKEN" not in spec.env_names
    assert "enp1" not in line  # env values stay out of the printed line
    assert line.endswith("--entrypoint sleep vllm:1 infinity")


def test_expected_names_are_what_the_container_carries(duo):
    want = environ.expected(duo, duo.workers[0].name)
    assert {"ONLY_W", "VLLM_LOGGING_LEVEL", "VLLM_HOST_IP", "VLLM_CACHE_ROOT", "RAY_object_store_memory"} <= want
    assert "ONLY_W" not in environ.expected(duo, duo.head.name)


def test_a_missing_name_fails_naming_the_node_and_the_names():
    ok = environ.NodeEnviron("a", ("X", "Y"), (environ.ServingProcess(10, "vllm serve m", ()),))
    short = environ.NodeEnviron("b", ("X", "Y"), (environ.ServingProcess(11, "ray::RayWorkerWrapper", ("Y",)),
                                                  environ.ServingProcess(12, "ray::IDLE", ())))
    environ.check([ok])
    with pytest.raises(ServeError, match=r"b: Y not in the env of its serving processes") as caught:
        environ.check([ok, short])
    assert caught.value.node == "b" and "run 04 again" in caught.value.remediation
    assert short.row()["missing"] == "Y" and ok.row()["missing"] == "none"


def test_a_node_without_serving_processes_is_named():
    with pytest.raises(ServeError, match=r"b: no serving process found"):
        environ.check([environ.NodeEnviron("b", ("X",), ())])


def test_the_probe_reads_the_names_of_serving_processes_and_not_their_values():
    """The probe run over this machine's /proc: a process whose command line names vllm is found with its env
    names; the values are not in the document; the probe's own process is left out."""
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)", "vllm-serve-stand-in"],
                               env={"SPARKBOOK_PROBE_SEES": "secret-value", "PATH": "/usr/bin:/bin"})
    try:
        out = subprocess.run([sys.executable, "-c", probes.source("serving_environ")], capture_output=True,
                             text=True, timeout=60)
        doc = probes.parse(out.stdout, node="here", probe="serving_environ")
    finally:
        sleeper.kill()
    mine = [p for p in doc["processes"] if p["pid"] == sleeper.pid]
    assert mine and "SPARKBOOK_PROBE_SEES" in mine[0]["names"] and "secret-value" not in out.stdout
    assert all("SPARKBOOK-JSON" not in p["cmd"] for p in doc["processes"])


def test_a_spawn_s_secrets_travel_as_a_0600_file_the_shell_exports_and_removes():
    """The archive DockerNodes.spawn copies into the container, and SECRETS_SH run on it as the container runs it:
    the values reach the process's environment and the file is gone."""
    import io
    import os
    import subprocess
    import tarfile

    from sparkbook.core.cluster.runtime import SECRETS_SH
    from sparkbook.core.cluster.runtime_docker import _secrets_archive

    value = "sk-it's a \"quoted\" $value; with `backticks`"
    data = _secrets_archive("s.env", {"VLLM_API_KEY": value, "HF_TOKEN": "hf_x"})
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        (member,) = tar.getmembers()
        assert (member.name, member.mode) == ("s.env", 0o600)
        tar.extractall("/tmp/sb-unit-secrets", filter="data")
    path = "/tmp/sb-unit-secrets/s.env"
    out = subprocess.run(["sh", "-c", SECRETS_SH, path, "sh", "-c", 'printf %s "$VLLM_API_KEY|$HF_TOKEN"'],
                         capture_output=True, text=True, timeout=10, env={"PATH": os.environ["PATH"]})
    assert out.stdout == f"{value}|hf_x" and not os.path.exists(path)


def _reply(stdout: str, exit_code: int = 0, stderr: str = ""):
    from datetime import UTC, datetime

    from sparkbook.core.cluster.nodes import Result
    return Result("b", ("python3",), exit_code, stdout, stderr, datetime.now(UTC), 0.1)


def _reading(duo, replies):
    """A context whose node `b` answers the env probe with `replies`, one per ask (a fan-out run here in turn)."""
    from sparkbook.core.values.fanout import Outcome
    from sparkbook.stages.serve.commands import ServeCommand, ServePlan

    asked = []

    def exec_(node, place, argv, timeout):
        asked.append(argv)
        return replies[len(asked) - 1]

    name = duo.workers[0].name
    node = types.SimpleNamespace(name=name)
    cluster = types.SimpleNamespace(nodes={name: node}, fan_out=lambda step, nodes, timeout: {
        n.name: Outcome(n.name, value=step(n), duration_s=0.0) for n in nodes})
    ctx = types.SimpleNamespace(params=duo, cluster=cluster, places={name: Place(name, "c")},
                                runtime=types.SimpleNamespace(own_place=True, exec=exec_))
    plan = ServePlan("mp", duo.serve, [ServeCommand(name, ["vllm", "serve"], {})], "http://x:8000", "m")
    return environ.read(ctx, plan), asked


def test_a_lost_reply_of_the_env_probe_is_asked_again_once(duo):
    """Seen on a loaded lab: the probe's reply came back empty (0 bytes) and 05 failed a server that was up."""
    out = subprocess.run([sys.executable, "-c", probes.source("serving_environ")], capture_output=True, text=True,
                         timeout=60).stdout  # a real reply (this machine's processes; none serve)
    (found,), asked = _reading(duo, [_reply(""), _reply(out)])
    assert len(asked) == 2 and found.error is None
    (lost,), asked = _reading(duo, [_reply("", 137, "killed"), _reply("", 137, "killed")])
    assert len(asked) == 2 and "0 bytes received" in lost.error and "exit 137" in lost.error and "killed" in lost.error
