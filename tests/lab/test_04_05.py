"""04 and 05 against the lab: Ray over both nodes passes the gate, TP=2 serves text across them; a wrong
fabric IP fails the gate naming the node. A taken port and a killed worker: tests/lab/test_faults.py.

Serves on port 8100 (the old deployment may hold 8000); removes its containers at the end.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

import sparkbook
import sparkbook.lab as sblab
from sparkbook.core.cluster.topology import cache_dir
from sparkbook.stages.images import distribute
from sparkbook.stages.raycluster import containers as node_containers
from sparkbook.stages.raycluster import formation
from sparkbook.stages.serve import bringup, commands, environ, launch, memory, smoke

pytestmark = pytest.mark.lab
LAB_PARAMS = sblab.params_file(2)  # the active lab's (SPARKBOOK_LAB_ID)
IMAGE = "sparkbook-lab/vllm-cpu:0.32.0"
PORT = 8100


def _params_file(tmp: Path, name: str, edit=lambda d: None) -> Path:
    data = yaml.safe_load(LAB_PARAMS.read_text())
    data["serve"]["port"] = PORT
    edit(data)
    path = tmp / name
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


@pytest.fixture(scope="module")
def env(lab, tmp_path_factory):
    """A run on the lab with the 0.32 image on every node (03's distribution), its containers removed after."""
    tmp = tmp_path_factory.mktemp("t0405")
    run = sparkbook.open_run(_params_file(tmp, "lab.yaml"), tmp / "run", stage="test-04-05")
    dist = distribute.distribute(run.context(), IMAGE)
    assert len(set(dist.ids.values())) == 1, dist
    ctx = run.context(IMAGE)
    yield run, ctx, dist.image_id, tmp
    node_containers.stop(ctx)
    run.close()


def _ray_up(ctx, image_id):
    containers = node_containers.start_containers(ctx, node_containers.start_specs(ctx), image_id)
    started = formation.start_ray(ctx)
    join = formation.wait_for_join(ctx, containers, started)
    return containers, join, formation.gate(ctx, containers, join)


def test_wrong_fabric_ip_fails_the_gate_naming_the_node(env):
    run, ctx, image_id, tmp = env

    wrong_ip = run.params.nodes[1].fabric_ip + 88  # on no interface

    def wrong(d):
        d["nodes"][1]["fabric_ip"] = str(wrong_ip)
        d["runtime"]["memory_limit"] = "3G"  # and each container capped (runtime.memory_limit), swap included

    bad = sparkbook.open_run(_params_file(tmp, "wrong-ip.yaml", wrong), tmp / "run-wrong", stage="test")
    bad_ctx = bad.context(IMAGE)
    _, join, gate = _ray_up(bad_ctx, image_id)
    for node in bad_ctx.cluster:
        host = bad_ctx.runtime.client(node).containers.get(bad_ctx.places[node.name].name).attrs["HostConfig"]
        assert host["Memory"] == host["MemorySwap"] == 3 << 30, node.name
    assert join.seconds < bad.params.ray.join_timeout_s / 2, "a node that can never join must not be waited on"
    assert "lab-1" in join.stopped_because
    with pytest.raises(formation.GateFailed, match=rf"lab-1: fabric IP {re.escape(str(wrong_ip))} is not on eth0"):
        formation.check(gate)
    assert all(not f.startswith("lab-0") for f in gate.failures)
    bad.close()


@pytest.fixture(scope="module")
def ray_cluster(env):
    run, ctx, image_id, _ = env
    containers, join, gate = _ray_up(ctx, image_id)
    formation.check(gate)
    assert [r.ray_ip for r in gate.rows] == [str(n.fabric_ip) for n in run.params.nodes]
    return ctx


def test_ray_cluster_of_two_nodes_passes_the_gate(env, ray_cluster):
    status = formation.status(ray_cluster)
    assert status.ok and status.stdout.count(" node_") == 2


def test_tp2_across_both_nodes_serves_text(env, ray_cluster):
    ctx = ray_cluster
    platform = commands.detect_platform(ctx)
    executor, decision = commands.choose_executor(ctx, platform)
    assert (platform.device, executor) == ("cpu", "mp")
    plan = commands.plan(ctx, executor)
    up = bringup.bring_up(ctx, plan)
    assert up.ok, bringup.failure_message(up)
    assert all("--tensor-parallel-size" in c.argv for c in plan.commands) and len(plan.commands) == 2
    replies = smoke.smoke_test(plan.base_url, plan.model, plan.settings)
    assert [s.kind for s in replies] == ["chat", "completion"] and all(s.text for s in replies)
    smoke.check_smoke(replies)  # the tiny model has no reasoning parser: its 32 tokens of text pass as before
    check_env_reaches_every_serving_process(env, ctx, up.launched.plan)
    check_compile_caches_are_on_the_node(ctx)
    launch.stop_serving(ctx, up.launched)


def test_drop_caches_on_the_lab_nodes_with_memavailable_before_and_after(ray_cluster):
    """05's drop on unified memory, here on the lab's nodes (not unified: they share one kernel, so the drop is the
    machine's and MemAvailable is the machine's; what a GB10's pressure does cannot be shown here)."""
    drops = memory.drop_caches(ray_cluster, ["lab-0", "lab-1"])
    for d in drops:
        print(d.row())
        assert d.error is None and d.before > 0 and d.after > 0
    assert any(d.cached_after < d.cached_before for d in drops), [d.row() for d in drops]


def test_a_refused_flag_is_followed_by_the_settle_check_on_both_nodes(env, ray_cluster):
    """A planted failing start (a max_model_len over the model's 4096, which vLLM refuses only once its engine builds
    the config: an argument its parser refuses now ends 05 before anything stops, issue 40): after it, every serving
    node's MemAvailable is checked against its value before the launch, with the three figures recorded."""
    ctx = ray_cluster
    executor, _ = commands.choose_executor(ctx, commands.detect_platform(ctx))
    refused = ctx.params.serve.model_copy(update={"max_model_len": 8192})
    plan = commands.plan(ctx, executor, refused)
    before = memory.before_launch(ctx, plan, model=None)  # the lab is not unified memory: no refit, no model read
    assert before.unified == [] and list(before.available) == ["lab-0", "lab-1"]
    up = bringup.bring_up(ctx, plan, available=before.available)
    assert not up.ok and up.readiness.cause and up.readiness.cause.cause == "configuration refused", up.readiness
    [settled] = up.settles
    for row in settled.rows():
        print(row)
    assert settled.ok, settled.problem()
    assert [r["node"] for r in settled.rows()] == ["lab-0", "lab-1"]
    assert all(r["after failure GiB"] > 0 and r["after settle GiB"] > 0 for r in settled.rows())


def check_env_reaches_every_serving_process(env, ctx, plan):
    """serve.node_env of lab-1 is in lab-1's serving processes (names read from /proc/<pid>/environ); a variable
    params give lab-1 after 04 started its container is missing there, and the check fails naming lab-1."""
    found = {e.node: e for e in environ.read(ctx, plan)}
    assert set(found) == {"lab-0", "lab-1"} and all(e.processes for e in found.values()), found
    assert "VLLM_CPU_OMP_THREADS_BIND" in found["lab-1"].expected
    assert found["lab-1"].missing == (), [(p.cmd, p.missing) for p in found["lab-1"].processes]
    assert "VLLM_CACHE_ROOT" in found["lab-1"].expected
    environ.check(list(found.values()))
    _, _, _, tmp = env

    def late(d):
        d["serve"]["node_env"]["lab-1"]["SPARKBOOK_PLANTED_LATE"] = "1"

    changed = sparkbook.open_run(_params_file(tmp, "late-env.yaml", late), tmp / "run-late", stage="test")
    after = environ.read(changed.context(IMAGE), plan)
    with pytest.raises(commands.ServeError, match=r"lab-1: SPARKBOOK_PLANTED_LATE not in the env of its serving"):
        environ.check(after)
    assert [e.missing for e in after if e.node == "lab-0"] == [()]
    changed.close()


def check_compile_caches_are_on_the_node(ctx):
    """The cache dir is mounted in every node container and vLLM wrote into it (a new container finds it)."""
    root = cache_dir(ctx.params)
    for node in ctx.params.nodes:
        found = ctx.runtime.existing(ctx.cluster.nodes[node.name], ctx.places[node.name])
        assert found is not None and root in found.mounts, (node.name, found)
        listing = ctx.runtime.exec(ctx.cluster.nodes[node.name], ctx.places[node.name],
                                   ["find", root, "-type", "f"], timeout=30)
        assert listing.ok and listing.stdout.strip(), f"nothing written under {root} on {node.name}"
