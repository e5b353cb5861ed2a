"""Commands and env built from params (lab: mp multi-node; spark-duo: ray), the executor decision, the Ray gate."""
from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path
from types import SimpleNamespace

import pytest

from sparkbook.core.cluster import topology
from sparkbook.core.cluster.context import Context
from sparkbook.core.cluster.nodes import Result
from sparkbook.core.values.fanout import Outcome
from sparkbook.core.values.params import ParamsError, Speculative, load_params
from sparkbook.stages.raycluster import containers, formation
from sparkbook.stages.serve import bringup, commands

PARAMS = Path(__file__).resolve().parents[2] / "params"
def ctx(params, cluster=None, runtime=None):
    """A context for the pure command builders (and, with stand-ins for nodes and runtime, the pre-launch checks)."""
    return Context(params, cluster, runtime, Path("/tmp"), image="img")


CPU = commands.Platform("cpu", "0.32.0+cpu", "2.13.0+cpu", 0, "2.60.0")
CUDA = commands.Platform("cuda", "0.17.1", "2.9.1+cu130", 1, "2.60.0")


@pytest.fixture
def duo(write_params, base):
    base["nodes"][0].update(fabric_ip="192.168.200.12", fabric_netdev="enp1s0f1np1",
                            roce_hcas=["rocep1s0f1", "roceP2p1s0f1"])
    base["nodes"][1].update(fabric_ip="192.168.200.13", fabric_netdev="enp1s0f1np1")
    base["serve"].update(gpu_memory_utilization=0.7, max_model_len=32768, extra_args=["--trust-remote-code"])
    return load_params(write_params(base))


@pytest.fixture
def lab(tmp_path):
    text = (PARAMS / "lab.yaml").read_text()
    for key in ("key_file", "known_hosts"):  # the lab's files may not exist where unit tests run
        text = text.replace(f"  {key}:", f"  # {key}:")
    path = tmp_path / "lab.yaml"
    path.write_text(text)
    return load_params(path)


def test_lab_on_cpu_serves_with_mp_across_both_nodes(lab):
    executor, decision = commands.choose_executor(ctx(lab), CPU)
    assert executor == "mp" and decision.choice.startswith("mp")
    assert any("0.32.0+cpu" in e for e in decision.evidence)
    p = commands.plan(ctx(lab), executor)
    head, worker = p.commands
    assert (head.node, worker.node) == ("lab-0", "lab-1")
    assert head.argv[:3] == ["vllm", "serve", "/srv/models/hyv4-tiny"]
    for flag, value in (("--nnodes", "2"), ("--master-addr", "10.77.0.10"), ("--master-port", "29501"),
                        ("--tensor-parallel-size", "2"), ("--distributed-executor-backend", "mp"),
                        ("--host", "0.0.0.0"), ("--port", "8000"), ("--dtype", "float32"),
                        ("--kv-cache-memory-bytes", "128M"), ("--served-model-name", "hyv4-tiny")):
        assert head.argv[head.argv.index(flag) + 1] == value
    assert head.argv[head.argv.index("--node-rank") + 1] == "0" and "--headless" not in head.argv
    assert worker.argv[worker.argv.index("--node-rank") + 1] == "1" and "--headless" in worker.argv
    assert head.argv[-4:] == ["--model-impl", "vllm", "--attention-backend", "CPU_MLA"]
    assert "--enforce-eager" in head.argv
    assert (head.env, worker.env) == ({"VLLM_CPU_OMP_THREADS_BIND": "0"}, {"VLLM_CPU_OMP_THREADS_BIND": "1"})
    assert p.base_url == "http://10.77.0.10:8000"


def test_gpu_cluster_serves_with_ray_from_the_head_only(duo):
    executor, decision = commands.choose_executor(ctx(duo), CUDA)
    assert executor == "ray" and decision.choice == "ray"
    (cmd,) = commands.plan(ctx(duo), executor).commands
    assert cmd.node == "a"
    assert cmd.argv[2] == "Org/Model-1B"
    assert "--nnodes" not in cmd.argv and "--headless" not in cmd.argv
    assert cmd.argv[cmd.argv.index("--gpu-memory-utilization") + 1] == "0.7"
    assert cmd.argv[-1] == "--trust-remote-code"


def test_params_with_a_space_stay_one_argument(write_params, base):
    base["serve"]["extra_args"] = ["--override-generation-config", '{"temperature": 0.5}']
    (cmd, *_) = commands.plan(ctx(load_params(write_params(base))), "ray").commands
    assert cmd.argv[-1] == '{"temperature": 0.5}'


def test_a_world_smaller_than_the_cluster_uses_the_head_only(write_params, base):
    base["nodes"][0]["gpus"] = [0, 1]
    params = load_params(write_params(base))
    assert [n.name for n in commands.serving_nodes(params)] == ["a"]
    (cmd,) = commands.plan(ctx(params), "mp").commands
    assert "--nnodes" not in cmd.argv


def test_container_env_follows_the_anchors(duo):
    env = topology.fabric_env(duo, duo.head)
    assert env["VLLM_HOST_IP"] == env["RAY_NODE_IP_ADDRESS"] == "192.168.200.12"
    for key in ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME", "TP_SOCKET_IFNAME", "UCX_NET_DEVICES",
                "OMPI_MCA_btl_tcp_if_include"):
        assert env[key] == "enp1s0f1np1"
    assert env["NCCL_IB_HCA"] == "rocep1s0f1,roceP2p1s0f1"
    assert "NCCL_IB_HCA" not in topology.fabric_env(duo, duo.workers[0])


def test_ray_start_argv_head_and_worker(lab):
    head, worker = (formation.ray_argv(lab, n) for n in lab.nodes)
    assert head[:3] == ["ray", "start", "--block"] and "--head" in head
    assert head[head.index("--temp-dir") + 1] == topology.RAY_TEMP_DIR
    assert head[head.index("--node-ip-address") + 1] == "10.77.0.10"
    assert worker[worker.index("--address") + 1] == "10.77.0.10:6379"
    assert worker[worker.index("--node-ip-address") + 1] == "10.77.0.11"
    assert '"sparkbook_node_lab-1": 1' in worker[worker.index("--resources") + 1]


def _containers(params, ips=None):
    ips = ips or {}
    return [containers.NodeContainer(n.name, topology.container_name(params, n.name), "x", "img", False, [], {},
                             str(n.fabric_ip), n.fabric_netdev, [ips.get(n.name, str(n.fabric_ip))])
            for n in params.nodes]


def _join(params, ray_ips=None, pgs=(), cpus=2.0):
    ray_ips = ray_ips or {}
    nodes = [formation.RayNode(ray_ips.get(n.name, str(n.fabric_ip)), True, n.name,
                        {"CPU": cpus, topology.NODE_RESOURCE.format(n.name): 1.0}) for n in params.nodes
             if ray_ips.get(n.name) != "absent"]
    snap = formation.Snapshot(nodes, list(pgs))
    return formation.Join([n.name() for n in nodes], [], 1.0, snap)


def test_gate_passes_on_a_consistent_cluster(lab):
    g = formation.gate(ctx(lab), _containers(lab), _join(lab))
    assert g.ok, g.failures
    assert [r.verdict for r in g.rows] == ["ok", "ok"]


def test_gate_names_the_node_whose_fabric_ip_is_wrong(lab):
    g = formation.gate(ctx(lab), _containers(lab, {"lab-1": "10.77.0.12"}), _join(lab, {"lab-1": "10.77.0.12"}))
    assert not g.ok
    (failure,) = g.failures
    assert failure.startswith("lab-1: ") and "10.77.0.11 is not on eth0" in failure
    assert "Ray reports IP 10.77.0.12" in failure
    with pytest.raises(formation.GateFailed, match="lab-1"):
        formation.check(g)


def test_gate_names_missing_nodes_short_resources_and_pending_groups(lab):
    join = _join(lab, {"lab-1": "absent"}, pgs=[{"id": "pg1", "state": "PENDING"}], cpus=0.0)
    g = formation.gate(ctx(lab), _containers(lab), join)
    assert g.failures == ["lab-0: offers 0 CPU, needs 1", "lab-1: not in the Ray cluster",
                          "placement group pg1 is pending"]


def test_gate_expects_gpus_where_params_list_them(duo):
    g = formation.gate(ctx(duo), _containers(duo), _join(duo))
    assert [r.expected for r in g.rows] == ["1 GPU", "1 GPU"]
    assert not g.ok and "offers 0 GPU, needs 1" in g.failures[0]


RAY_STATUS = """======== Autoscaler status: 2026-11-30 15:10:30.391643 ========
Node status
---------------------------------------------------------------
Active:
 1 node_30ade49ad212d75e95c7a6b2491199367802a13a1f3d1642e32eb277
 1 node_636b92a81a45da52666d6c7a6470304e0b877d78509d4727149b1f45
Pending:
 1 node_999
Recent failures:
 (no failures)
"""


@pytest.mark.parametrize("report, count", [(RAY_STATUS, 2), (RAY_STATUS.replace(
    " 1 node_636b92a81a45da52666d6c7a6470304e0b877d78509d4727149b1f45\n", ""), 1),
    ("Active:\n (no active nodes)\nPending:\n 1 node_x\n", 0), ("", 0)])
def test_ray_status_active_nodes_counts_only_the_active_section(report: str, count: int):
    assert formation.active_nodes(report) == count


def test_a_model_by_hf_id_is_served_offline_from_the_snapshot_02_found(duo):
    snapshot = "/home/u/.cache/huggingface/hub/models--Org--Model-1B/snapshots/0123abc"
    (cmd,) = commands.plan(ctx(duo), "ray", model_dir=snapshot).commands
    assert cmd.argv[2] == snapshot
    assert cmd.env["HF_HUB_CACHE"] == "/home/u/.cache/huggingface/hub" and cmd.env["HF_HUB_OFFLINE"] == "1"


def test_a_model_by_hf_id_without_02s_record_is_looked_up_in_the_params_cache(write_params, base):
    base["model"].update(cache_dir="/home/u/.cache/huggingface", offline=False)
    (cmd,) = commands.plan(ctx(load_params(write_params(base))), "ray").commands
    assert cmd.argv[2] == "Org/Model-1B"
    assert cmd.env["HF_HUB_CACHE"] == "/home/u/.cache/huggingface/hub" and "HF_HUB_OFFLINE" not in cmd.env


def test_the_second_lab_params_differ_from_the_lab_only_in_image_and_model():
    import yaml
    lab, hf = (yaml.safe_load((PARAMS / f).read_text()) for f in ("lab.yaml", "lab-hf.yaml"))
    assert hf["model"] == {"hf_id": "sparkbook-lab/hyv4-tiny", "served_name": "hyv4-tiny",
                           "cache_dir": "/home/lab/.cache/huggingface"}
    assert hf["runtime"]["images"][-1] == "sparkbook-lab/vllm-openai-cpu:0.32.0"
    for key in ("model", "runtime", "cluster"):
        del lab[key], hf[key]
    assert lab == hf


def test_output_fields_reach_the_argv_of_every_serving_node(write_params, base):
    base["serve"].update(reasoning_parser="qwen3", tool_call_parser="qwen3_coder", host="10.9.0.1",
                         chat_template="/srv/models/unsloth.jinja")
    for cmd in commands.plan(ctx(load_params(write_params(base))), "mp").commands:
        for flag, value in (("--reasoning-parser", "qwen3"), ("--tool-call-parser", "qwen3_coder"),
                            ("--chat-template", "/srv/models/unsloth.jinja"), ("--host", "10.9.0.1")):
            assert cmd.argv[cmd.argv.index(flag) + 1] == value
        assert cmd.argv.count("--enable-auto-tool-choice") == 1


def test_without_output_fields_no_parser_flags_and_the_api_binds_every_interface(write_params, base):
    (cmd, *_) = commands.plan(ctx(load_params(write_params(base))), "ray").commands
    assert cmd.argv[cmd.argv.index("--host") + 1] == "0.0.0.0"
    assert not {"--reasoning-parser", "--tool-call-parser", "--enable-auto-tool-choice",
                "--chat-template"} & set(cmd.argv)


def test_the_seed_cluster_serves_qwen35_with_the_recipes_parsers():
    (cmd,) = commands.plan(ctx(load_params(PARAMS / "spark-duo.yaml")), "ray").commands
    assert cmd.argv[cmd.argv.index("--reasoning-parser") + 1] == "qwen3"
    assert cmd.argv[cmd.argv.index("--tool-call-parser") + 1] == "qwen3_coder"
    assert "--enable-auto-tool-choice" in cmd.argv


@pytest.mark.parametrize("field, value, says", [
    ("reasoning_parser", "", "not a valid vLLM parser name"),
    ("tool_call_parser", "qwen3 --x", "not a valid vLLM parser name"),
    ("chat_template", "unsloth.jinja", "not a valid absolute path"),
    ("host", "999.1.1.1", "IPv4"),
    ("smoke_max_tokens", 0, "greater than or equal to 1"),
    ("extra_args", ["--reasoning-parser", "qwen3"], "--reasoning-parser (use serve.reasoning_parser)"),
    ("extra_args", ["--enable-auto-tool-choice"], "(use serve.tool_call_parser)")])
def test_output_fields_are_validated(write_params, base, field, value, says):
    base["serve"][field] = value
    with pytest.raises(ParamsError) as exc:
        load_params(write_params(base))
    (problem,) = exc.value.problems
    assert problem.field.startswith(f"serve.{field}") and says in problem.message


class _Cluster:
    """Stands in for Cluster: its nodes by name and a fan-out that runs the step on each in turn."""

    def __init__(self, names):
        self.nodes = {n: SimpleNamespace(name=n) for n in names}

    def fan_out(self, step, nodes, timeout=None):
        return {n.name: Outcome(n.name, value=step(n)) for n in nodes}


class _Files:
    """A runtime whose `test -f PATH` (or -d) succeeds only for the (node, path) pairs it holds."""

    def __init__(self, present):
        self.present = present

    def exec(self, node, place, argv, timeout=120):
        return Result(node.name, tuple(argv), 0 if (node.name, argv[-1]) in self.present else 1, "", "",
                      datetime.now(UTC), 0.0)


def test_a_chat_template_missing_on_a_serving_node_stops_serve_before_launch(lab, monkeypatch):
    assert bringup.missing_on_nodes(ctx(lab), commands.plan(ctx(lab), "mp")) == {}  # none named: nothing to ask
    template = "/srv/models/unsloth.jinja"
    params = lab.model_copy(update={"serve": lab.serve.model_copy(update={"chat_template": template})})
    p = commands.plan(ctx(params), "mp")
    on_nodes = ctx(params, _Cluster(["lab-0", "lab-1"]), _Files({("lab-0", template)}))
    assert bringup.missing_on_nodes(on_nodes, p) == {"serve.chat_template": "lab-1"}
    for name, value in (("lost", {}), ("find_running", (None, "nothing serving")), ("stop_earlier", None),
                        ("port_taken", None)):
        monkeypatch.setattr(bringup, name, lambda *a, v=value, **kw: v)
    monkeypatch.setattr(bringup, "launch", lambda *a: pytest.fail("launched despite the missing template"))
    with pytest.raises(commands.ServeError) as exc:
        bringup.bring_up(on_nodes, p)
    assert exc.value.message == f"serve.chat_template: {template} is not a file where `vllm serve` runs on lab-1"
    assert exc.value.node == "lab-1" and "under model.cache_dir (/srv/models" in exc.value.remediation


def test_a_draft_model_missing_on_a_serving_node_is_named_with_its_field(lab):
    """serve.speculative's draft (eagle3, draft_model) must be a directory on every serving node (issue 32 item 1)."""
    draft = "/srv/models/eagle3-draft"
    spec = Speculative(method="eagle3", num_speculative_tokens=3, model=draft)
    params = lab.model_copy(update={"serve": lab.serve.model_copy(update={"speculative": spec})})
    p = commands.plan(ctx(params), "mp")
    assert bringup.missing_on_nodes(ctx(params, _Cluster(["lab-0", "lab-1"]), _Files(set())), p) == \
        {"serve.speculative.model": "lab-0, lab-1"}
    present = _Files({("lab-0", draft), ("lab-1", draft)})
    assert bringup.missing_on_nodes(ctx(params, _Cluster(["lab-0", "lab-1"]), present), p) == {}
    with pytest.raises(commands.ServeError, match="serve.speculative.model: /srv/models/eagle3-draft is not a "
                       "directory where `vllm serve` runs on lab-1"):
        bringup.refuse_missing_files(ctx(params, _Cluster(["lab-0", "lab-1"]), _Files({("lab-0", draft)})), p)


@pytest.mark.parametrize("platform", [CPU, CUDA], ids=["cpu", "cuda"])
def test_a_single_rank_leaves_the_executor_to_vllm_and_says_so(write_params, base, platform):
    base["serve"].update(tensor_parallel_size=1)
    base["serve"].pop("executor", None)
    params = load_params(write_params(base))
    executor, decision = commands.choose_executor(ctx(params), platform)
    assert (executor, decision.choice, decision.key) == (commands.DEFAULT, "vLLM's default", "executor")
    assert "TP x PP = 1" in decision.evidence and "31-48 s" in decision.reason
    (cmd,) = commands.plan(ctx(params), executor).commands
    assert cmd.node == "a" and "--distributed-executor-backend" not in cmd.argv and "RAY_ADDRESS" not in cmd.env
