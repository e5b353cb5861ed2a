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
from sparkbook.core import topology
from sparkbook.core.runtime import runtime_for
from sparkbook.stages import raycluster, serve
from sparkbook.stages.images import distribute

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
    runtime = runtime_for(run.params)
    yield run, runtime, dist.image_id, tmp
    raycluster.stop(run.params, run.cluster, runtime)
    run.close()


def _ray_up(run, runtime, image_id):
    containers = raycluster.start_containers(run.params, run.cluster, runtime, IMAGE, image_id)
    started = raycluster.start_ray(run.params, run.cluster, runtime, IMAGE)
    join = raycluster.wait_for_join(run.params, run.cluster, runtime, IMAGE, containers, started)
    return containers, join, raycluster.gate(run.params, containers, join)


def test_wrong_fabric_ip_fails_the_gate_naming_the_node(env):
    run, runtime, image_id, tmp = env

    wrong_ip = run.params.nodes[1].fabric_ip + 88  # on no interface

    def wrong(d):
        d["nodes"][1]["fabric_ip"] = str(wrong_ip)

    bad = sparkbook.open_run(_params_file(tmp, "wrong-ip.yaml", wrong), tmp / "run-wrong", stage="test")
    _, join, gate = _ray_up(bad, runtime, image_id)
    assert join.seconds < bad.params.ray.join_timeout_s / 2, "a node that can never join must not be waited on"
    assert "lab-1" in join.stopped_because
    with pytest.raises(raycluster.GateFailed, match=rf"lab-1: fabric IP {re.escape(str(wrong_ip))} is not on eth0"):
        raycluster.check(gate)
    assert all(not f.startswith("lab-0") for f in gate.failures)
    bad.close()


@pytest.fixture(scope="module")
def ray_cluster(env):
    run, runtime, image_id, _ = env
    containers, join, gate = _ray_up(run, runtime, image_id)
    raycluster.check(gate)
    assert [r.ray_ip for r in gate.rows] == [str(n.fabric_ip) for n in run.params.nodes]
    return topology.places(run.params, IMAGE)


def test_ray_cluster_of_two_nodes_passes_the_gate(env, ray_cluster):
    run, runtime, _, _ = env
    status = raycluster.status(run.params, runtime, run.cluster.head, ray_cluster["lab-0"])
    assert status.ok and status.stdout.count(" node_") == 2


def test_tp2_across_both_nodes_serves_text(env, ray_cluster):
    run, runtime, _, _ = env
    platform = serve.detect_platform(runtime, run.cluster.head, ray_cluster["lab-0"])
    executor, decision = serve.choose_executor(run.params, platform)
    assert (platform.device, executor) == ("cpu", "mp")
    plan = serve.plan(run.params, executor)
    up = serve.bring_up(run.params, run.cluster, runtime, ray_cluster, plan)
    assert up.ok, serve.failure_message(up)
    assert all("--tensor-parallel-size" in c.argv for c in plan.commands) and len(plan.commands) == 2
    smoke = serve.smoke_test(plan.base_url, plan.model, plan.settings)
    assert [s.kind for s in smoke] == ["chat", "completion"] and all(s.text for s in smoke)
    serve.check_smoke(smoke)  # the tiny model has no reasoning parser: its 32 tokens of text pass as before
    serve.stop_serving(run.cluster, runtime, ray_cluster, up.launched)
