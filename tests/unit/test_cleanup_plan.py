"""cleanup.plan/verify on made-up inventories: order patterns, dependents first, restore, untouched check."""
from __future__ import annotations

import json

from sparkbook.core.analysis.hostfacts import Memory
from sparkbook.core.cluster.context import Context
from sparkbook.core.cluster.nodes import Cluster
from sparkbook.core.cluster.runtimes import runtime_for
from sparkbook.core.values.params import CleanupTargets, load_params
from sparkbook.stages.cleanup.act import verify
from sparkbook.stages.cleanup.inventory import Container, Inventory, Process, Unit
from sparkbook.stages.cleanup.planning import Plan, plan
from sparkbook.stages.cleanup.restore import restore_files

MEM = Memory(100 << 30, 10 << 30)


def inv(node: str, containers=(), units=(), processes=(), memory: Memory = MEM) -> Inventory:
    return Inventory(node, list(containers), "Docker 28", list(units), "systemd", list(processes), "no GPU", [],
                     memory)


def lab_inventories(state: str = "running") -> list[Inventory]:
    return [
        inv("lab-0", [Container("old-proxy", "b", "base", state, ["old-vllm"]),
                      Container("old-vllm", "a", "vllm:0.28", state, []),
                      Container("sshd-helper", "c", "base", "running", [])]),
        inv("lab-1", [Container("old-embeddings", "d", "base", state, []),
                      Container("old-reranker", "e", "base", state, [])]),
    ]


def test_dependents_before_what_they_depend_on():
    targets = CleanupTargets(containers=["old-*"])
    p = plan(lab_inventories(), targets)
    names = [t.name for t in p.targets]
    assert set(names) == {"old-proxy", "old-vllm", "old-embeddings", "old-reranker"}
    assert names.index("old-proxy") < names.index("old-vllm")
    assert all(t.restore == f"docker start {t.name}" for t in p.targets)
    assert not p.warnings


def test_order_patterns_first_and_conflicts_are_warned():
    targets = CleanupTargets(containers=["old-*"], order=["old-rerank*", "old-vllm"])
    p = plan(lab_inventories(), targets)
    assert [t.name for t in p.targets][:2] == ["old-reranker", "old-vllm"]
    assert any("old-proxy" in w and "old-vllm" in w for w in p.warnings)


def test_seed_units_follow_order_and_required_by():
    targets = CleanupTargets(systemd_units=["vllm-*.service"], containers=["*embed*", "*rerank*"],
                             order=["vllm-proxy.service", "vllm-cluster.service", "*embed*", "*rerank*"])
    head = inv("spark-1a32", units=[Unit("vllm-cluster.service", "active", ["vllm-proxy.service"]),
                                    Unit("vllm-proxy.service", "active", []), Unit("ssh.service", "active", []),
                                    Unit("vllm-old.service", "inactive", [])])
    worker = inv("spark-5be3", [Container("tei-embed", "1", "tei", "running", []),
                                Container("tei-rerank", "2", "tei", "running", []),
                                Container("grafana", "3", "g", "running", [])])
    p = plan([head, worker], targets)
    assert [t.name for t in p.targets] == ["vllm-proxy.service", "vllm-cluster.service", "tei-embed", "tei-rerank"]
    assert p.targets[0].restore == "systemctl start -- vllm-proxy.service"


def test_unit_required_by_orders_without_order_patterns():
    head = inv("h", units=[Unit("a.service", "active", ["b.service"]), Unit("b.service", "active", [])])
    p = plan([head], CleanupTargets(systemd_units=["*.service"]))
    assert [t.name for t in p.targets] == ["b.service", "a.service"]


def test_processes_have_no_known_restore():
    p = plan([inv("h", processes=[Process(42, "python", "python serve.py")])], CleanupTargets(processes=["python"]))
    (t,) = p.targets
    assert t.stop == "kill -TERM 42" and t.restore is None and "by hand" in (t.cannot_restore or "")


def test_verify_stopped_memory_and_untouched(tmp_path):
    targets = CleanupTargets(containers=["old-*"])
    before = lab_inventories()
    p = plan(before, targets)
    after = lab_inventories("exited")
    after[1] = inv("lab-1", after[1].containers, memory=Memory(100 << 30, 11 << 30))
    v = verify(p, before, after)
    assert v.ok and "4/4 targets stopped" in v.summary()
    assert [m["rise MiB"] for m in v.memory] == [0.0, 1024.0]
    after[0] = inv("lab-0", [c if c.name != "sshd-helper" else Container("sshd-helper", "c", "base", "exited", [])
                             for c in after[0].containers])
    v = verify(p, before, after)
    assert not v.ok and v.untouched_changes == ["lab-0: sshd-helper running -> exited"]
    after[0] = inv("lab-0", [c for c in after[0].containers if c.name != "sshd-helper"])
    before[0] = inv("lab-0", [*before[0].containers[:2], Container("sshd-helper", "c", "base", "exited", [])])
    v = verify(p, before, after)
    assert v.ok and v.not_ours == ["lab-0: sshd-helper exited -> gone"]


def test_restore_plan_has_every_planned_target_in_reverse_order(tmp_path, write_params, base):
    """Written before acting: a stop that fails may still have stopped its target, so every target has a step."""
    p = plan(lab_inventories(), CleanupTargets(containers=["old-*"]))
    base["nodes"][0].update(name="lab-0", host="10.77.0.10")
    base["nodes"][1].update(name="lab-1", host="10.77.0.11")
    cluster = Cluster(load_params(write_params(base)))
    ctx = Context(cluster.params, cluster, runtime_for(cluster.params), tmp_path)
    files = restore_files(ctx, tmp_path / "lab.yaml", Plan(p.targets))
    steps = json.loads(files.plan.json())["steps"]
    assert [s["name"] for s in steps] == [t.name for t in reversed(p.targets)]
    ssh = f"ssh -i {tmp_path}/id_test -o UserKnownHostsFile={tmp_path}/known_hosts -p 22 root@10.77.0.10"
    script = files.script
    stop_new = f"{ssh} 'docker stop sparkbook-{ctx.params.cluster}-lab-0 || true'"
    assert stop_new in script and script.index(stop_new) < script.index(f"{ssh} 'docker start old-vllm'"), \
        "the new deployment is stopped before the old one starts, as --stop-new does"
    assert "FIRST STOPS THE NEW DEPLOYMENT" in script.split("set -e")[0], "and the script says so at its top"
