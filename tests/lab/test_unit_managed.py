"""01 and `sparkbook restore` on the lab's unit-managed part of the old deployment (issue 23, item 3): the old
cluster manager on the head owns a `--rm` vllm_node container on every node, as the seed's vllm-cluster.service
(launch-cluster.sh) did. 01 finds them through their owner, stops the manager by its PID, expects them gone (no
false "touched outside the allow-lists"); restore relaunches the manager, which brings them back. (systemd itself
is not in the lab: tests/unit/test_cleanup_ownership.py covers it on recorded output.)"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

import sparkbook.lab as sblab
from sparkbook import cli
from sparkbook.core.values.evidence import read_events
from sparkbook.lab import cluster, deployment
from sparkbook.runbook import driver
from sparkbook.runbook.driver import RunOptions

pytestmark = pytest.mark.lab
OLD = {"old-vllm", "old-proxy", "old-embeddings", "old-reranker"}


def lab_containers() -> dict[str, dict]:
    """node/name -> container dict (state, answers) of every container of the lab."""
    return {f"{n.name}/{c['name']}": c for n in sblab.status().nodes for c in n.containers}


def managed(containers: dict[str, dict]) -> dict[str, str]:
    return {k: c["state"] for k, c in containers.items() if k.endswith(f"/{deployment.MANAGED_NAME}")}


@pytest.fixture(scope="module")
def cleaned(lab, lab_progress, tmp_path_factory) -> tuple[Path, int]:
    """The old deployment answering (the manager's containers too), then 01 confirmed; (run dir, manager PID).
    Reset first: an earlier module of the session (test_runbook_lab) leaves the old deployment stopped. The worker
    keeps its images, so nbval's 03 afterwards finds 0.32.0 on every node and copies nothing (2-3 min less)."""
    sblab.reset(progress=lab_progress, keep_worker_images=True)
    sblab.wait_old_deployment(progress=lab_progress)
    head = cluster.lab_nodes(len(lab.nodes))[0]
    pid = deployment.manager_pid(head)
    assert pid is not None and set(managed(lab_containers()).values()) == {"running"}
    run_dir, manifest = driver.execute(sblab.params_file(2), RunOptions(out_root=tmp_path_factory.mktemp("managed"),
                                                                        only="01",
                                                                        parameters={"confirm_cleanup": True}),
                                       say=print)
    assert [nb.status for nb in manifest.notebooks if nb.name.startswith("01")] == ["ok"], \
        json.dumps([nb.exception for nb in manifest.notebooks], indent=1)
    yield run_dir, pid
    # what comes after (nbval over the notebooks) finds the lab as a confirmed run leaves it
    _, manifest = driver.execute(sblab.params_file(2), RunOptions(out_root=tmp_path_factory.mktemp("stop-old"),
                                                                  only="01", parameters={"confirm_cleanup": True}),
                                 say=print)
    assert [nb.status for nb in manifest.notebooks if nb.name.startswith("01")] == ["ok"]


def test_01_plans_the_managers_containers_under_it_and_verifies_without_false_alarms(
        lab, cleaned: tuple[Path, int]) -> None:
    run_dir, pid = cleaned
    (plan,) = read_events(run_dir, "cleanup_plan")
    targets = plan["data"]["targets"]
    manager = next(i for i, t in enumerate(targets) if t["kind"] == "process")
    assert targets[manager]["stop"] == f"kill -TERM {pid}"
    owner = f"{lab.nodes[0].name}/{targets[manager]['name']}"
    owned = targets[manager + 1:manager + 1 + len(lab.nodes)]
    assert [(t["node"], t["name"], t["owner"]) for t in owned] == [
        (n.name, deployment.MANAGED_NAME, owner) for n in lab.nodes], "each owned container right under its owner"
    assert not [t for t in targets if t["owner"] and t not in owned]
    (check,) = read_events(run_dir, "cleanup_verification")
    print(json.dumps(check["data"], indent=1))
    assert all(r["stopped"] for r in check["data"]["stopped"]) and not check["data"]["untouched_changes"]
    assert len(check["data"]["stopped"]) == len(OLD) + 1 + len(lab.nodes)
    containers = lab_containers()
    assert not managed(containers), "--rm: the manager removed its containers on every node"
    assert not {k for k, c in containers.items() if c["state"] == "running" and k.split("/")[1] in OLD}
    assert deployment.manager_pid(cluster.lab_nodes(len(lab.nodes))[0]) is None


def test_the_restore_plan_reaches_nodes_by_address_and_restore_brings_the_manager_back(
        lab, cleaned: tuple[Path, int], capsys: pytest.CaptureFixture[str]) -> None:
    run_dir, pid = cleaned
    script = (run_dir / "restore.sh").read_text()
    assert f"root@{lab.nodes[0].ip} " in script and f"root@{lab.nodes[1].ip} " in script
    assert "ssh lab-" not in script
    code = cli.main(["restore", str(run_dir)])
    out = capsys.readouterr()
    print(out.out, out.err)
    assert code == 0, out.out + out.err
    new_pid = deployment.manager_pid(cluster.lab_nodes(len(lab.nodes))[0])
    assert new_pid is not None and new_pid != pid
    containers = lab_containers()
    assert {k: (c["state"], c["answers"]) for k, c in containers.items() if k.endswith("/vllm_node")} == {
        f"{n.name}/{deployment.MANAGED_NAME}": ("running", True) for n in lab.nodes}
    assert all(containers[f"{n.name}/{name}"]["answers"] for n in lab.nodes for name in OLD
               if f"{n.name}/{name}" in containers)
    outcome = [e["data"] for e in read_events(run_dir, "restore_outcome")][-1]
    assert outcome["result"] == "restored", outcome
    assert [a["name"] for a in outcome["actions"]].count(deployment.MANAGED_NAME) == 0, \
        "owned containers have no restore action: their owner brings them back"
    assert sum(c["name"] == deployment.MANAGED_NAME and c["ok"] for c in outcome["checks"]) == len(lab.nodes)
