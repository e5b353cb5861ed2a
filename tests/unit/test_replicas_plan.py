"""05's commands for serve.layout replicas (issue 42, item 3): a whole copy per node on serve.replica_port with that
node's GPUs as its split, no Ray and no multi-node launch, and vllm-router on the head on serve.port before them;
the params that cannot serve replicas refused by name; what readiness waits for, what the Endpoint, the reuse record
and `status` keep of the router. The launch itself is proven on the lab (tests/lab/test_replicas_lab.py)."""
from __future__ import annotations

import dataclasses

import pytest
from test_layout_fit import GPT_OSS_120B, GPT_OSS_BYTES
from test_serve_front_door import a_preview
from test_serve_plan import CPU, CUDA, ctx

from sparkbook.core.cluster import topology
from sparkbook.core.values.handoff import ImageChoice
from sparkbook.core.values.modelinfo import GIB, model_facts, utilization_floor
from sparkbook.core.values.params import ParamsError, load_params
from sparkbook.runbook import operate
from sparkbook.stages import serve
from sparkbook.stages.serve import bluegreen, bringup, commands, front, launch, replicas, reuse, router


def as_replicas(params, **serve):
    return params.model_copy(update={"serve": params.serve.model_copy(update={"layout": "replicas", **serve})})


def value(argv, flag):
    return argv[argv.index(flag) + 1]


def test_lab_replicas_one_rank_each_behind_the_router_on_the_head(lab):
    params = as_replicas(lab)
    executor, decision = replicas.executor(params, CPU)
    assert executor == "default" and decision.choice == "vLLM's default" and "no Ray" in decision.reason
    plan = replicas.plan(params, executor, model_dir="")
    assert [c.node for c in plan.commands] == ["lab-0", "lab-1"]
    for c in plan.commands:
        assert c.argv[:3] == ["vllm", "serve", "/srv/models/hyv4-tiny"]
        assert (value(c.argv, "--port"), value(c.argv, "--tensor-parallel-size")) == ("8001", "1")
        assert not {"--nnodes", "--headless", "--distributed-executor-backend", "--master-addr"} & set(c.argv)
        assert value(c.argv, "--max-num-seqs") == "16" and c.argv[-1] == "CPU_MLA"  # the params' own settings
    assert [c.env for c in plan.commands] == [{"VLLM_CPU_OMP_THREADS_BIND": "0"}, {"VLLM_CPU_OMP_THREADS_BIND": "1"}]
    assert plan.router is not None and plan.router.node == "lab-0"
    assert plan.router.argv == ["python3", "-m", "vllm_router.launch_router", "--host", "0.0.0.0", "--port", "8000", "--policy", "power_of_two",
                                "--worker-startup-timeout-secs", "600", "--worker-startup-check-interval", "5",
                                "--retry-max-retries", "120", "--retry-initial-backoff-ms", "100",
                                "--retry-max-backoff-ms", "1000", "--disable-circuit-breaker",
                                "--health-check-interval-secs", "3600",
                                "--worker-urls", "http://10.77.0.10:8001", "http://10.77.0.11:8001"]
    assert plan.base_url == "http://10.77.0.10:8000"  # clients see the router, one endpoint
    assert plan.router.env == {"PYTHONPATH": router.site(params)}  # its own install, not the image's packages
    assert router.site(params).startswith("/srv/sparkbook-cache/") and router.VERSION in router.site(params)
    rows = plan.table()
    assert [r["node"] for r in rows] == ["lab-0", "lab-1", "lab-0"]
    assert rows[-1]["command"].startswith("python3 -m vllm_router.launch_router")


def test_gpu_nodes_split_each_copy_over_their_own_gpus(write_params, base):
    base["nodes"][0]["gpus"] = [0, 1]
    base["nodes"][1]["gpus"] = [0, 1]
    base["serve"] = {"layout": "replicas", "tensor_parallel_size": 4, "replica_port": 9000, "port": 8080,
                     "router_policy": "round_robin"}
    params = load_params(write_params(base))
    executor, decision = replicas.executor(params, CUDA)
    assert executor == "mp" and "up to 2 GPUs on one node" in decision.reason
    plan = replicas.plan(params, executor)
    for c in plan.commands:
        assert value(c.argv, "--tensor-parallel-size") == "2" and value(c.argv, "--port") == "9000"
        assert value(c.argv, "--distributed-executor-backend") == "mp" and "--nnodes" not in c.argv
        assert "RAY_ADDRESS" not in c.env
    assert plan.router is not None and value(plan.router.argv, "--policy") == "round_robin"
    assert plan.router.argv[-2:] == ["http://10.9.0.1:9000", "http://10.9.0.2:9000"]
    assert plan.base_url == "http://10.9.0.1:8080"


def test_tp_plans_have_no_router(lab):
    plan = commands.plan(ctx(lab), "mp")
    assert plan.router is None and len(plan.table()) == 2


@pytest.mark.parametrize(("serve", "said"), [
    ({"replica_port": 8000}, "serve.replica_port: 8000 is serve.port, where the router answers"),
    ({"api_key_env": "VLLM_KEY"}, "serve.host: with serve.api_key_env, 0.0.0.0 would open every replica's port"),
    ({"executor": "ray"}, "serve.executor: ray joins ranks over the nodes, and a replica serves on one node")])
def test_params_that_cannot_serve_replicas_are_refused_by_name(write_params, base, serve, said):
    base["serve"] = {"tensor_parallel_size": 2, "layout": "replicas", **serve}
    base["secrets"] = ["VLLM_KEY"] if "api_key_env" in serve else []
    with pytest.raises(ParamsError, match=said):
        load_params(write_params(base))


def test_replicas_floor_is_each_whole_copy_on_its_node(write_params, base):
    """gpt-oss-120b on two 128 GiB nodes: a replica holds all 65 GB where TP=2 holds half, so its OOM ladder starts
    higher, from the same load (8 sequences of 32k)."""
    base["serve"] = {"tensor_parallel_size": 2, "max_model_len": 32768, "max_num_seqs": 8}
    tp = load_params(write_params(base))
    facts = model_facts(GPT_OSS_120B, {"metadata": {"total_size": GPT_OSS_BYTES}}, [], "/m")
    memory = {"a": 128 * GIB, "b": 128 * GIB}
    split, copy = utilization_floor(facts, tp, memory), replicas.floor(facts, as_replicas(tp), memory)
    assert split is not None and copy is not None and split < copy < 1.0
    assert copy == utilization_floor(facts, replicas.alone(as_replicas(tp), tp.nodes[1]), memory)
    assert replicas.floor(facts, as_replicas(tp), {"a": 128 * GIB}) is None  # b's memory unknown


def test_preview_shows_every_command_the_router_included(lab, monkeypatch):
    """05's preview (`sparkbook plan`): serve.layout picks the replicas' commands and the router's, titled as such,
    in the slot the standing front routes to (none stands here)."""
    monkeypatch.setattr(front, "routes", lambda ctx: None)
    monkeypatch.setattr(reuse, "read_serving", lambda ctx, head: None)
    imaged = ctx(as_replicas(lab)).with_image("img")
    executor, decision, plan = serve._layout_plan(imaged, CPU, "")
    assert (executor, plan.router is not None) == ("default", True)
    shown = dataclasses.replace(a_preview(imaged), plan=plan, executor=executor, executor_decision=decision).shown()
    (table,) = [s for s in shown if s.title.startswith("vllm serve")]
    assert table.title.startswith("vllm serve, a whole copy per node, then vllm-router on the head before them")
    assert [r["command"].split()[:3] for r in table.value][-1] == ["python3", "-m", "vllm_router.launch_router"]
    direct = lab.model_copy(update={"serve": lab.serve.model_copy(update={"front": "none"})})
    assert serve._layout_plan(ctx(direct).with_image("img"), CPU, "")[2].router is None  # tp, no front: no router


def test_readiness_waits_for_every_replica_by_the_router_s_own_worker_urls(lab):
    plan = replicas.plan(as_replicas(lab), "default")
    assert launch.replica_urls(plan) == {"lab-0": "http://10.77.0.10:8001", "lab-1": "http://10.77.0.11:8001"}
    assert launch.replica_urls(commands.plan(ctx(lab), "mp")) == {}  # one server: nothing but its own API


def test_the_endpoint_and_the_reuse_record_keep_the_router(lab):
    plan = replicas.plan(as_replicas(lab), "default")
    e = bringup.planned_endpoint(plan, [])
    assert e.router == plan.router.argv and e.router_log == "/tmp/sparkbook/logs/front.log"  # type: ignore[union-attr]
    assert e.replicas == launch.replica_urls(plan) and e.base_url == "http://10.77.0.10:8000"
    again = reuse._plan_from(reuse.plan_data(plan))
    assert again == plan, "a later run compares its plan, the router included, with the recorded one"
    tp = commands.plan(ctx(lab), "mp")
    assert "router" not in reuse.plan_data(tp) and reuse._plan_from(reuse.plan_data(tp)) == tp
    assert bringup.planned_endpoint(tp, []).router is None


def test_remedies_replan_in_the_layout_served(lab):
    params = as_replicas(lab)
    plan = replicas.plan(params, "default")
    fixed = bringup.layout_plan(ctx(params), plan.executor,
                                plan.settings.model_copy(update={"gpu_memory_utilization": 0.8}), plan.model_dir)
    assert fixed.router is not None and [c.node for c in fixed.commands] == ["lab-0", "lab-1"]
    assert all(value(c.argv, "--gpu-memory-utilization") == "0.8" for c in fixed.commands)


def test_04_forms_no_ray_for_replicas(lab):
    assert topology.without_ray(as_replicas(lab), "2.60.0") is not None
    assert topology.without_ray(lab, "2.60.0") is None  # tp, executor unset, an image with Ray: 05 may choose it


def test_status_serves_only_with_the_router_running_and_every_replica_answering(lab, tmp_path):
    plan = replicas.plan(as_replicas(lab), "default")
    d = operate.Deployment(tmp_path, ImageChoice(ref="img", id=None, vllm_version=None, ray_version=None, nodes={}), bringup.planned_endpoint(plan, []))
    nodes = [operate.NodeStatus(n, "running 0123456789ab", "not used", "running", 60.0) for n in ("lab-0", "lab-1")]
    up = operate.RouterStatus("lab-0", "running", {"lab-0": None, "lab-1": None})
    assert operate.Status(d, nodes, None, router=up).serving
    half = operate.RouterStatus("lab-0", "running", {"lab-0": None, "lab-1": "ConnectError: refused"})
    gone = operate.RouterStatus("lab-0", "not running", {"lab-0": None, "lab-1": None})
    assert not operate.Status(d, nodes, None, router=half).serving, "the router answers while one replica does"
    assert not operate.Status(d, nodes, None, router=gone).serving
    lines = operate.Status(d, nodes, None, router=half).lines()
    assert "router on lab-0: running (/tmp/sparkbook/logs/front.log)" in lines
    assert "replica on lab-1 http://10.77.0.11:8001: /health NOT answering (ConnectError: refused)" in lines
    assert d.plan_hash != operate.Deployment(tmp_path, d.image, d.endpoint.model_copy(update={"router": []})).plan_hash


def test_each_replica_binds_its_own_nodes_address_where_serve_host_names_one(lab):
    """Issue 56, item 5: serve.host set to the head's fabric address (as `check` advises) went to every replica, and
    the worker's could not bind an address it lacks; now each binds its own, 0.0.0.0 staying 0.0.0.0."""
    plan = replicas.plan(as_replicas(lab, host="10.77.0.10"), "default", model_dir="")
    assert [value(c.argv, "--host") for c in plan.commands] == ["10.77.0.10", "10.77.0.11"]
    assert value(plan.router.argv, "--host") == "10.77.0.10"
    everywhere = replicas.plan(as_replicas(lab), "default", model_dir="")
    assert [value(c.argv, "--host") for c in everywhere.commands] == ["0.0.0.0", "0.0.0.0"]


def test_behind_the_front_replicas_stand_in_either_slot_and_stop_drained(lab):
    """Blue-green for replicas (issue 55): the new copies on serve.replica_port + 1 on every node, the front's argv
    naming them, while the serving ones keep their port; each replica, a server of its own, drains."""
    params = as_replicas(lab, front="router")
    blue = bringup.layout_plan(ctx(params), "default", params.serve, "", drains=True, slot=0)
    green = bringup.layout_plan(ctx(params), "default", params.serve, "", drains=True, slot=1)
    assert [value(c.argv, "--port") for c in green.commands] == ["8002", "8002"]
    assert [value(c.argv, "--port") for c in blue.commands] == ["8001", "8001"]
    assert all(value(c.argv, "--shutdown-timeout") == str(params.serve.drain_timeout_s) for c in green.commands)
    assert (front.slot_of(blue), front.slot_of(green)) == (0, 1)
    assert bluegreen.backends(green) == ["http://10.77.0.10:8002", "http://10.77.0.11:8002"]
    assert launch.replica_urls(green) == {"lab-0": "http://10.77.0.10:8002", "lab-1": "http://10.77.0.11:8002"}
    assert front.routes_alike(blue.router, green.router) and green.base_url == blue.base_url
    assert launch.log_path(1, front.slot_of(green)).endswith("serve-1-slot1.log")  # the serving copies' files kept
    undrained = bringup.layout_plan(ctx(params), "default", params.serve, "", drains=False, slot=1)
    assert not front.drains(undrained)
    alone = as_replicas(lab, front="none")
    assert "--shutdown-timeout" not in bringup.layout_plan(ctx(alone), "default", alone.serve, "",
                                                           drains=True).commands[0].argv


def test_blue_green_moves_every_replica_before_removing_any(lab):
    """The front gets every new replica added before any old one is removed (the order a client never sees a front
    without a server), against a real HTTP server answering the router's admin calls."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    asked: list[str] = []
    keys: list[str | None] = []

    class Admin(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 (http.server's name)
            asked.append(self.path)
            keys.append(self.headers.get("Authorization"))
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Admin)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        bluegreen.move(f"http://127.0.0.1:{server.server_address[1]}", ["http://a:8002", "http://b:8002"],
                       ["http://a:8001", "http://b:8001"], {"Authorization": "Bearer k"})
    finally:
        server.shutdown()
    assert asked == ["/add_worker?url=http%3A%2F%2Fa%3A8002", "/add_worker?url=http%3A%2F%2Fb%3A8002",
                     "/remove_worker?url=http%3A%2F%2Fa%3A8001", "/remove_worker?url=http%3A%2F%2Fb%3A8001"]
    assert keys == ["Bearer k"] * 4  # a keyed front refuses its admin routes without the key
