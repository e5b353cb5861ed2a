"""`sparkbook restore`'s pure parts on made-up data: what 01 records of each target (ports, health URL, memory),
what stands in the way of a restore, the verdict on a restored target, the run index's restore section, and a
run whose cleanup stopped nothing (no node is contacted)."""
from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from sparkbook import cli
from sparkbook.core.analysis.hostfacts import Memory
from sparkbook.core.cluster.context import Context
from sparkbook.core.cluster.nodes import Cluster
from sparkbook.core.cluster.runtimes import runtime_for
from sparkbook.core.values import state
from sparkbook.core.values.evidence import read_events
from sparkbook.core.values.handoff import Action, RayCluster
from sparkbook.core.values.params import CleanupTargets, load_params
from sparkbook.runbook import driver
from sparkbook.runbook.manifest import Manifest, NotebookRun
from sparkbook.runbook.session import open_run
from sparkbook.stages.cleanup import restore
from sparkbook.stages.cleanup.inventory import Container, Inventory, Listener, answering, listeners
from sparkbook.stages.cleanup.planning import Plan, plan
from sparkbook.stages.cleanup.restore import Seen, Step, conflicts, judge, restore_files

MEM = Memory(100 << 30, 10 << 30)
RUN = Path("/runs/lab/1")
NEW = {"lab-0": [("sparkbook-lab-lab-0", "c0ffee000000aaaa"), ("sparkbook-lab-front", "")],
       "lab-1": [("sparkbook-lab-lab-1", "c0ffee111111bbbb")]}
SS = """\
LISTEN 0      4096      10.77.0.10:8000      0.0.0.0:*    users:(("python3",pid=101,fd=5),("python3",pid=102,fd=5))
LISTEN 0      5            0.0.0.0:8080      0.0.0.0:*    users:(("python3",pid=201,fd=3))
LISTEN 0      128             [::]:22           [::]:*    users:(("sshd",pid=7,fd=4))
LISTEN 0      128                *:6379              *:*
"""


def test_ss_listeners_with_their_pids() -> None:
    socks = listeners(SS.splitlines())
    assert socks[0] == Listener("10.77.0.10", 8000, [101, 102])
    assert [(s.port, s.url_host) for s in socks] == [(8000, "10.77.0.10"), (8080, "127.0.0.1"),
                                                     (22, "127.0.0.1"), (6379, "127.0.0.1")]
    assert socks[3].pids == []
    assert [s.port for s in listeners(SS.splitlines(), below=8080)] == [8000, 22, 6379]  # not the ephemeral range


def test_health_probe_answers_only_200() -> None:
    urls = ["http://10.77.0.10:8000/health", "http://127.0.0.1:8080/health", "http://127.0.0.1:9/health"]
    lines = ["http://10.77.0.10:8000/health 200", "http://127.0.0.1:8080/health 503", "http://127.0.0.1:9/health 000"]
    assert answering(urls, lines) == {urls[0]: True, urls[1]: False, urls[2]: False}


def old_head(state: str = "running") -> Inventory:
    pids = {"old-vllm": [101, 102], "old-proxy": [201]} if state == "running" else {}
    return Inventory("lab-0", [Container("old-proxy", "b", "base", state, ["old-vllm"], pids.get("old-proxy", []),
                                         30.0 if pids else 0.0),
                               Container("old-vllm", "a", "vllm:0.28", state, [], pids.get("old-vllm", []),
                                         1200.0 if pids else 0.0)],
                     "Docker 28", [], "systemd", [], "no GPU", [], MEM, listeners(SS.splitlines()),
                     {8000: "http://10.77.0.10:8000/health", 8080: "http://127.0.0.1:8080/health"})


def test_the_plan_and_the_restore_plan_carry_what_each_target_held(
        write_params: Callable[[dict[str, Any]], Path], base: dict[str, Any], tmp_path: Path) -> None:
    p = plan([old_head()], CleanupTargets(containers=["old-*"]))
    vllm = next(t for t in p.targets if t.name == "old-vllm")
    assert (vllm.ports, vllm.health_url, vllm.memory_mib) == ([8000], "http://10.77.0.10:8000/health", 1200.0)
    assert vllm.holds() == "ports 8000; http://10.77.0.10:8000/health; 1200 MiB"
    base["nodes"][0].update(name="lab-0", host="10.77.0.10")
    cluster = Cluster(load_params(write_params(base)))
    ctx = Context(cluster.params, cluster, runtime_for(cluster.params), tmp_path)
    steps = restore_files(ctx, tmp_path / "lab.yaml", Plan(p.targets)).plan.steps
    ssh = f"ssh -i {tmp_path}/id_test -o UserKnownHostsFile={tmp_path}/known_hosts -p 22 root@10.77.0.10"
    assert steps == [Step("lab-0", "container", "old-vllm", "docker start old-vllm", "", [8000],
                          "http://10.77.0.10:8000/health", 1200.0, 0, ssh=ssh),
                     Step("lab-0", "container", "old-proxy", "docker start old-proxy", "", [8080],
                          "http://127.0.0.1:8080/health", 30.0, 0, ssh=ssh)]


STEPS = [Step("lab-0", "container", "old-vllm", "docker start old-vllm", "", [8000], "http://10.77.0.10:8000/health",
              1200.0),
         Step("lab-0", "container", "old-proxy", "docker start old-proxy", "", [8080], "", 30.0),
         Step("lab-1", "container", "old-embeddings", "docker start old-embeddings", "", [8001], "", 300.0)]


def after_new_deployment(memory: Memory = MEM) -> dict[str, Inventory]:
    """The old deployment stopped, this run's node containers running; its vLLM server holds port 8000."""
    head = Inventory("lab-0", [Container("old-proxy", "b", "base", "exited", ["old-vllm"]),
                               Container("old-vllm", "a", "vllm:0.28", "exited", []),
                               Container("sparkbook-lab-lab-0", "c0ffee000000", "vllm:0.32", "running", [],
                                         [900, 950], 2500.0)],
                     "Docker 28", [], "systemd", [], "no GPU", [], memory,
                     listeners(['LISTEN 0 4096 10.77.0.10:8000 0.0.0.0:* users:(("vllm",pid=950,fd=20))',
                                'LISTEN 0 4096 10.77.0.10:6379 0.0.0.0:* users:(("gcs_server",pid=900,fd=9))']))
    worker = Inventory("lab-1", [Container("old-embeddings", "d", "base", "exited", []),
                                 Container("sparkbook-lab-lab-1", "c0ffee111111", "vllm:0.32", "running", [],
                                           [300], 900.0)],
                       "Docker 28", [], "systemd", [], "no GPU", [], MEM, [])
    return {"lab-0": head, "lab-1": worker}


def test_the_new_server_on_the_old_port_is_a_conflict_that_stop_new_clears() -> None:
    now = after_new_deployment()
    head = now["lab-0"]
    ipv6 = listeners(['LISTEN 0 4096 [::]:8000 [::]:* users:(("vllm",pid=950,fd=21))'])
    now["lab-0"] = Inventory("lab-0", head.containers, "Docker 28", [], "systemd", [], "no GPU", [], MEM,
                             head.listeners + ipv6)
    (found,) = [c for c in conflicts(STEPS, now, NEW, RUN) if "port" in c.what]
    assert (found.node, found.target, found.ours) == ("lab-0", "old-vllm", True)
    assert found.what == "port 8000 is held by container sparkbook-lab-lab-0 (this run's node container)"
    assert found.clear == f"sparkbook restore {RUN} --stop-new"
    assert "port 8000" in found.line() and "--stop-new" in found.line()


def test_the_fronts_own_place_on_the_old_port_is_ours_and_stop_new_stops_it_too() -> None:
    """Behind the front, serve.port is held in the front's own container, not the head's: still this runbook's."""
    now = after_new_deployment()
    head = now["lab-0"]
    front = Container("sparkbook-lab-front", "f00d", "vllm:0.32", "running", [], [970], 100.0)
    now["lab-0"] = Inventory("lab-0", [*head.containers, front], "Docker 28", [], "systemd", [], "no GPU", [], MEM,
                             listeners(['LISTEN 0 4096 0.0.0.0:8000 0.0.0.0:* users:(("vllm-router",pid=970,fd=9))']))
    (found,) = [c for c in conflicts(STEPS, now, NEW, RUN) if "port" in c.what]
    assert (found.target, found.ours, found.clear) == ("old-vllm", True, f"sparkbook restore {RUN} --stop-new")
    stopping = [c for c in conflicts(STEPS, now, NEW, RUN) if c.target == "the old services" and c.node == "lab-0"]
    assert sorted(c.what.split("container ")[1].split(" ")[0] for c in stopping) == ["sparkbook-lab-front",
                                                                                     "sparkbook-lab-lab-0"]


def test_the_running_new_deployment_is_in_the_way_on_every_node_ports_recorded_or_not() -> None:
    no_ports = [Step(s.node, s.kind, s.name, s.restore) for s in STEPS]
    found = conflicts(no_ports, after_new_deployment(), NEW, RUN)
    assert [(c.node, c.ours, c.clear) for c in found] == [("lab-0", True, f"sparkbook restore {RUN} --stop-new"),
                                                          ("lab-1", True, f"sparkbook restore {RUN} --stop-new")]
    assert found[0].what == "this runbook's deployment runs: container sparkbook-lab-lab-0 (its Ray and vLLM server)"
    assert restore.unread_ports(no_ports) == [f"{s.node}/{s.name}" for s in STEPS]
    assert restore.unread_ports(STEPS) == [f"{s.node}/{s.name}" for s in STEPS if not s.ports]


def test_someone_elses_holder_is_named_with_its_own_command() -> None:
    now = after_new_deployment()
    assert conflicts(STEPS, now, {}, RUN)[0].clear == "ssh lab-0 docker stop sparkbook-lab-lab-0"
    head = now["lab-0"]
    now["lab-0"] = Inventory("lab-0", head.containers[:2], "Docker 28", [], "systemd", [], "no GPU", [], MEM,
                             listeners(['LISTEN 0 5 0.0.0.0:8080 0.0.0.0:* users:(("nginx",pid=77,fd=6))']))
    (found,) = [c for c in conflicts(STEPS, now, NEW, RUN) if "port" in c.what]
    assert (found.target, found.what, found.clear, found.ours) == \
        ("old-proxy", "port 8080 is held by pid 77", "ssh lab-0 kill 77", False)


def test_nothing_in_the_way_once_the_new_deployment_is_stopped_or_the_target_runs() -> None:
    now = after_new_deployment()
    stopped = {n: Inventory(n, [Container(c.name, c.id, c.image, "exited", []) for c in inv.containers], "Docker 28",
                            [], "systemd", [], "no GPU", [], MEM, []) for n, inv in now.items()}
    assert conflicts(STEPS, stopped, NEW, RUN) == []
    assert conflicts(STEPS, {"lab-0": old_head()}, NEW, RUN) == []  # running targets hold their own ports


def test_memory_the_targets_held_and_cannot_get_is_a_conflict() -> None:
    tight = Memory(100 << 30, 1000 << 20)
    found = [c for c in conflicts(STEPS, after_new_deployment(tight), NEW, RUN) if "MiB" in c.what]
    assert len(found) == 1 and found[0].target == "old-vllm, old-proxy" and found[0].ours
    assert found[0].what == ("they held 1230 MiB, 1000 MiB is available; this run's sparkbook-lab-lab-0 holds "
                             "2500 MiB")
    gpu = Memory(100 << 30, 50 << 30, gpu_total=80 << 30, gpu_used=78 << 30)
    step = Step("lab-0", "container", "old-vllm", "docker start old-vllm", gpu_mib=4096)
    (found,) = [c for c in conflicts([step], after_new_deployment(gpu), NEW, RUN) if "MiB" in c.what]
    assert found.what == "they held 4096 MiB of GPU memory, 2048 MiB is free"


def test_verdicts_on_restored_targets() -> None:
    vllm = STEPS[0]
    good = judge(vllm, Seen("running", True, True, vllm.health_url, 1100.0, "log"))
    assert good.ok and good.problems == [] and good.log_tail == "" and good.health.startswith("answers")
    died = judge(vllm, Seen("exited (exit 1)", False, False, vllm.health_url, 0.0,
                                     "OSError: [Errno 98] Address already in use"))
    assert not died.ok and len(died.problems) == 3 and "Errno 98" in died.log_tail
    assert "exited (exit 1)" in died.problems[0] and vllm.health_url in died.problems[1]
    small = judge(vllm, Seen("running", True, True, vllm.health_url, 100.0))
    assert small.problems == ["holds 100 MiB; it held 1200 MiB before cleanup"]
    no_check = judge(Step("lab-1", "container", "x", "docker start x"), Seen("running", True, None, "", 0.0))
    assert no_check.ok and no_check.health == "(none recorded)"
    by_hand = judge(Step("h", "process", "llama[42]", None, "restart it by hand"),
                    Seen("not restorable", False, None, "", 0.0))
    assert by_hand.problems == ["no restore command: restart it by hand"]


def nothing_stopped_run(write_params: Callable[[dict[str, Any]], Path], base: dict[str, Any], tmp_path: Path) -> Path:
    """A run dir as `sparkbook run PARAMS --only 01` leaves it without confirm_cleanup: no restore plan."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    params = write_params(base)
    manifest = Manifest("unit", "1", str(params), {}, "2026-12-01T00:00:00+00:00",
                                notebooks=[NotebookRun("01-cleanup.ipynb", "ok")])
    manifest.write(run_dir)
    open_run(params, run_dir, stage="01-cleanup").record("cleanup_plan", Plan([]))
    return run_dir


def test_a_run_whose_cleanup_stopped_nothing_restores_nothing(
        write_params: Callable[[dict[str, Any]], Path], base: dict[str, Any], tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    run_dir = nothing_stopped_run(write_params, base, tmp_path)
    assert cli.main(["restore", str(run_dir), "--stop-new"]) == 0
    assert "nothing to restore; nothing was changed" in capsys.readouterr().out
    (event,) = read_events(run_dir, "restore_outcome")
    assert event["stage"] == "restore" and event["data"]["result"] == "nothing to restore"
    assert "<h2>Restore</h2>" in (run_dir / "index.html").read_text()


def test_the_index_shows_each_restore_with_conflicts_and_verdicts(tmp_path: Path) -> None:
    events = [{"at": "t1", "stage": "restore", "kind": "restore_outcome", "data": {
                  "result": "refused", "stopped_new": [], "actions": [], "checks": [], "memory": [],
                  "conflicts": [{"node": "lab-0", "target": "old-vllm", "what": "port 8000 is held by container x",
                                 "clear": "sparkbook restore R --stop-new", "ours": True}]}},
              {"at": "t2", "stage": "restore", "kind": "restore_outcome", "data": {
                  "result": "failed", "conflicts": [], "memory": [],
                  "stopped_new": [asdict(Action("lab-0", "x", "docker stop x", True, "", 1))],
                  "actions": [asdict(Action("lab-0", "old-vllm", "docker start old-vllm", True, "started", 1))],
                  "checks": [{"node": "lab-0", "name": "old-vllm", "ok": False, "state": "exited (exit 1)",
                              "health": "NOT answering u", "memory": "0 MiB", "problems": ["not running"],
                              "log_tail": "Errno 98 <Address in use>"}]}}]
    (tmp_path / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    page = driver.write_index(tmp_path, Manifest("lab", "1", "p.yaml", {}, "t0")).read_text()
    section = page[page.index("<h2>Restore</h2>"):]
    assert section.index("refused") < section.index("port 8000 is held by container x") < section.index("failed")
    assert "docker stop x" in section and "NOT BACK" in section and "Errno 98 &lt;Address in use&gt;" in section


def test_rollback_refuses_without_acting_and_stop_new_clears_the_way(monkeypatch: pytest.MonkeyPatch,
                                                                      tmp_path: Path) -> None:
    seen = [after_new_deployment()]
    acted: list[str] = []
    monkeypatch.setattr(restore, "_inventories", lambda cluster, targets: seen[-1])
    monkeypatch.setattr(restore, "bring_back", lambda cluster, steps, running, secrets: acted.append("restore") or [])
    monkeypatch.setattr(restore, "verify_restore", lambda cluster, steps: [
        judge(s, Seen("running", True, True, s.health_url, s.memory_mib)) for s in steps])

    def stop(cluster: Any, new: dict[str, list[tuple[str, str]]]) -> list[Action]:
        acted.append("stop-new")
        seen.append({n: Inventory(n, [c for c in inv.containers if not c.name.startswith("sparkbook-")], "Docker 28",
                                  [], "systemd", [], "no GPU", [], MEM, []) for n, inv in seen[-1].items()})
        return [Action(n, name, f"docker stop {name}", True, f"stopped {cid[:12]}", 1)
                for n, found in new.items() for name, cid in found]

    monkeypatch.setattr(restore, "stop_new", stop)
    state.store(tmp_path, RayCluster(address="10.77.0.10:6379", containers={n: found[0][0] for n, found in NEW.items()},
                                     reused=False, container_ids={n: found[0][1] for n, found in NEW.items()},
                                     nodes=[]), lambda d: d)
    params = SimpleNamespace(cluster="lab", runtime=SimpleNamespace(kind="docker"), secrets=[], secret_values=dict,
                             nodes=[SimpleNamespace(name=n, role="head" if n == "lab-0" else "worker") for n in NEW])
    containers = SimpleNamespace(own_place=True)  # node containers: the runtime's one fact restore reads here
    ctx = Context(params, None, containers, tmp_path)  # type: ignore[arg-type]
    refused = list(restore.restore_deployment(ctx, STEPS, CleanupTargets(containers=["old-*"]), stop_first=False))
    assert [e.kind for e in refused] == ["restore_conflicts", "restore_outcome"] and acted == []
    out = refused[-1].data
    assert isinstance(out, restore.RestoreOutcome) and out.result == "refused"
    assert [c.target for c in out.conflicts] == ["the old services", "the old services", "old-vllm"]
    restored = list(restore.restore_deployment(ctx, STEPS, CleanupTargets(containers=["old-*"]), stop_first=True))
    assert [e.kind for e in restored] == ["restore_conflicts", "restore_stop_new", "restore_conflicts", "restore",
                                          "restore_outcome"]
    out = restored[-1].data
    assert isinstance(out, restore.RestoreOutcome) and out.result == "restored"
    assert acted == ["stop-new", "restore"]
    assert [a.name for a in out.stopped_new] == ["sparkbook-lab-lab-0", "sparkbook-lab-front", "sparkbook-lab-lab-1"]
