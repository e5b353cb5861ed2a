"""What a unit or managed process owns (ownership.py + cleanup's plan/verify/restore plan), on recorded
`systemctl show` output (tests/unit/data/) and the seed's unit-managed deployment: launch-cluster.sh's `--rm`
containers on both nodes are listed under their unit, their disappearance is expected, a restore step is written
for every planned target before acting, and restore.sh reaches nodes by their SSH address."""
from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from restoring import kept

from sparkbook.core.analysis.hostfacts import Memory
from sparkbook.core.cluster.context import Context
from sparkbook.core.cluster.nodes import Cluster
from sparkbook.core.cluster.runtimes import runtime_for
from sparkbook.core.values.params import CleanupTargets, load_params
from sparkbook.stages.cleanup import inventory, planning
from sparkbook.stages.cleanup.act import verify
from sparkbook.stages.cleanup.guard import table
from sparkbook.stages.cleanup.inventory import Container, Inventory, Process, Unit
from sparkbook.stages.cleanup.ownership import (
    docker_client_process,
    docker_clients,
    family,
    parse_show,
    timespan_s,
    tree,
)
from sparkbook.stages.cleanup.planning import plan
from sparkbook.stages.cleanup.restore import Seen, bring_back, judge, restore_files

DATA = Path(__file__).parent / "data"
MEM = Memory(100 << 30, 10 << 30)
SEED = CleanupTargets(systemd_units=["vllm-*.service"], containers=["tei-*"])


def recorded(name: str) -> str:
    return "".join(line for line in (DATA / name).read_text().splitlines(keepends=True) if not line.startswith("#"))


def seed_sections() -> dict[str, str]:
    text = recorded("vllm_cluster_head.txt")
    parts = text.split("==")[1:]
    return {parts[i]: parts[i + 1].strip("\n") for i in range(0, len(parts), 2)}


class FakeNode:
    """Answers the unit probe with recorded output; records nothing else."""

    def __init__(self, name: str, reply: str) -> None:
        self.name, self.reply = name, reply

    def run(self, argv: list[str], timeout: float = 0, check: bool = False) -> SimpleNamespace:
        return SimpleNamespace(stdout=self.reply, stderr="", returncode=0)


def test_real_systemctl_show_gives_main_pid_cgroup_exec_start_and_stop_timeout() -> None:
    show = parse_show(recorded("systemctl_show_docker.txt"))
    assert (show.name, show.active, show.main_pid) == ("docker.service", "active", 16789)
    assert show.control_group == "/system.slice/docker.service"
    assert show.exec_start == "/usr/bin/dockerd"
    assert show.stop_timeout_s == 90.0 and show.required_by == []
    assert [timespan_s(t) for t in ("2min", "500ms", "infinity", "")] == [120.0, 0.5, None, None]


@pytest.mark.parametrize("args, want", [
    ("docker run --rm --name vllm_node --gpus all img ./run.sh", ("", "vllm_node")),
    ("/usr/bin/docker -H ssh://root@10.77.1.11 run --rm --name=vllm_node img", ("10.77.1.11", "vllm_node")),
    ("docker --host tcp://10.0.0.5:2375 container run --name x img", ("10.0.0.5", "x")),
    ("ssh -o BatchMode=yes -p 22 nvidia@192.168.177.12 docker run --rm --name vllm_node img",
     ("192.168.177.12", "vllm_node")),
    ("docker start -a 4f1c0b6e2a9d", ("", "4f1c0b6e2a9d")),
    ("docker -H unix:///run/docker.sock start --detach-keys ctrl-x web", ("", "web")),
])
def test_docker_run_and_start_clients_name_their_container_and_daemon(args: str, want: tuple[str, str]) -> None:
    client = docker_client_process(7, args)
    assert client is not None and (client.host, client.ref) == want


@pytest.mark.parametrize("args", ["docker ps -a", "ssh -T -- root@10.77.1.11 docker system dial-stdio",
                                  "docker run --rm img", "python3 docker run --name x", "sshd: root@notty"])
def test_other_processes_are_not_clients(args: str) -> None:
    assert docker_client_process(7, args) is None


def seed_inventories(unit: Unit | None = None, worker_state: str = "running") -> list[Inventory]:
    s = seed_sections()
    procs = tree(s["tree"].splitlines())
    if unit is None:
        unit = inventory._unit(FakeNode("spark-1a32", f"{s['show']}\n==procs==\n{s['procs']}\n"),
                             "vllm-cluster.service", "active")
    head = Inventory("spark-1a32", [Container("vllm_node", "4f1c0b6e2a9d", "vllm-node", "running", [], [2260], 300.0),
                                    Container("tei-embed", "77aa", "tei", "running", [])],
                     "Docker 28", [unit, Unit("ssh.service", "active", [])], "systemd", [], "GB10", [], MEM,
                     clients=docker_clients(procs), addresses=s["addr"].splitlines())
    worker = Inventory("spark-5be3", [Container("vllm_node", "9e8d7c6b5a41", "vllm-node", worker_state, [], [31],
                                                250.0),
                                      Container("grafana", "3", "g", "running", [])],
                       "Docker 28", [], "systemd", [], "GB10", [], MEM,
                       addresses=["spark-5be3", "192.168.177.12"])
    return [head, worker]


def test_the_unit_probe_reads_its_cgroup_and_stop_timeout() -> None:
    unit = seed_inventories()[0].units[0]
    assert unit.pids == [2201, 2230, 2231, 2232] and unit.stop_timeout_s == 120.0
    assert unit.requires == ["vllm-proxy.service"] and unit.exec_start.startswith("/home/nvidia/spark-vllm-docker/")


def test_a_unit_owns_the_containers_its_clients_run_on_both_nodes() -> None:
    p = plan(seed_inventories(), SEED)
    rows = [(t.node, t.name, t.owner) for t in p.targets]
    assert rows == [("spark-1a32", "tei-embed", ""), ("spark-1a32", "vllm-cluster.service", ""),
                    ("spark-1a32", "vllm_node", "spark-1a32/vllm-cluster.service"),
                    ("spark-5be3", "vllm_node", "spark-1a32/vllm-cluster.service")], rows
    owned = p.targets[3]
    assert owned.stop == "stops with spark-1a32/vllm-cluster.service" and owned.restore is None
    assert owned.stop_timeout_s == 120.0, "the unit's own TimeoutStopUSec (2 min) is longer than the parameter"
    assert p.rows()[2]["owned by"] == "spark-1a32/vllm-cluster.service"
    # tei-embed's client (pid 3005) runs outside the unit's cgroup: not owned, stopped on its own
    assert p.targets[0].stop == "docker stop tei-embed"


def test_a_container_labelled_with_the_unit_is_owned_too() -> None:
    invs = seed_inventories(Unit("vllm-cluster.service", "active", [], [2201]))  # no client in its cgroup
    invs[1] = Inventory("spark-5be3", [Container("ray-worker", "5", "ray", "running", [], [],
                                                 labels={"systemd.unit": "vllm-cluster.service"})],
                        "Docker 28", [], "systemd", [], "GB10", [], MEM)
    assert [(t.name, t.owner) for t in plan(invs, SEED).targets if t.owner] == [
        ("ray-worker", "spark-1a32/vllm-cluster.service")]


def test_verify_expects_owned_containers_to_vanish_but_not_others() -> None:
    before = seed_inventories()
    p = plan(before, SEED)
    after = [Inventory("spark-1a32", [Container("tei-embed", "77aa", "tei", "exited", [])], "Docker 28",
                       [Unit("vllm-cluster.service", "inactive", []), Unit("ssh.service", "active", [])], "systemd",
                       [], "GB10", [], MEM),
             Inventory("spark-5be3", [Container("grafana", "3", "g", "running", [])], "Docker 28", [], "systemd",
                       [], "GB10", [], MEM)]
    v = verify(p, before, after)
    assert v.ok and not v.untouched_changes and "4/4 targets stopped" in v.summary(), v.summary()
    after[1] = Inventory("spark-5be3", [], "Docker 28", [], "systemd", [], "GB10", [], MEM)
    v = verify(p, before, after)
    assert not v.ok and v.untouched_changes == ["spark-5be3: grafana running -> gone"]


def test_without_ownership_the_vanished_containers_were_touched_outside() -> None:
    """The issue's failure, kept as the contrast: an owner that owns nothing leaves its --rm containers outside."""
    before = seed_inventories(Unit("vllm-cluster.service", "active", []))
    p = plan(before, SEED)
    after = [Inventory(i.node, [c for c in i.containers if c.name != "vllm_node"], "Docker 28",
                       [Unit(u.name, "inactive" if u.name.startswith("vllm") else u.active, []) for u in i.units],
                       "systemd", [], "GB10", [], MEM) for i in before]
    assert not verify(p, before, after).ok


def lab_process() -> Process:
    args = "python3 /var/lib/sparkbook-lab/services/old_cluster_manager.py --pidfile /run/m.pid"
    procs = tree(["  40     1 " + args,
                  "  41    40 docker run --rm --name vllm_node base python3 svc.py",
                  "  42    40 docker -H ssh://root@10.77.1.11 run --rm --name vllm_node base python3 svc.py",
                  "  43    42 ssh -o ConnectTimeout=30 -T -- root@10.77.1.11 docker system dial-stdio",
                  "  50     1 docker run --rm --name other base"])
    assert family(40, procs) == [40, 41, 42, 43]
    return Process(40, "python3", args, family(40, procs), "/", args.split(), (0, 0, []))


def lab_inventories() -> list[Inventory]:
    procs = tree(["41 40 docker run --rm --name vllm_node base", "42 40 docker -H ssh://root@10.77.1.11 run "
                  "--rm --name vllm_node base", "50 1 docker run --rm --name other base"])
    head = Inventory("lab-0", [Container("old-vllm", "a", "vllm", "running", [], [100], 1200.0),
                               Container("vllm_node", "b", "base", "running", [], [101], 30.0),
                               Container("other", "c", "base", "running", [])],
                     "Docker 28", [], "no systemd", [lab_process()], "no GPU", [], MEM, clients=docker_clients(procs),
                     addresses=["lab-0", "10.77.1.10"], session_uid=0)
    worker = Inventory("lab-1", [Container("vllm_node", "d", "base", "running", [], [201], 30.0)], "Docker 28", [],
                       "no systemd", [], "no GPU", [], MEM, addresses=["lab-1", "10.77.1.11"])
    return [head, worker]


LAB = CleanupTargets(containers=["old-*"], processes=["*old_cluster_manager.py*"], unit_stop_timeout_s=45)


def test_a_managed_process_owns_its_descendants_containers_and_is_relaunched_on_restore() -> None:
    p = plan(lab_inventories(), LAB)
    manager = next(t for t in p.targets if t.kind == "process")
    assert [(t.node, t.name) for t in p.targets if t.owner == "lab-0/python3[40]"] == [
        ("lab-0", "vllm_node"), ("lab-1", "vllm_node")]
    assert "other" not in {t.name for t in p.targets}, "its client is not the manager's descendant"
    assert manager.stop_timeout_s == 45 and manager.stop == "kill -TERM 40"
    assert manager.restore == ("cd / && { setsid python3 /var/lib/sparkbook-lab/services/old_cluster_manager.py "
                               "--pidfile /run/m.pid </dev/null >/dev/null 2>&1 & }")


def lab_cluster(write_params: Callable[[dict[str, Any]], Path], base: dict[str, Any]) -> Cluster:
    base["nodes"][0].update(name="lab-0", host="10.77.1.10")
    base["nodes"][1].update(name="lab-1", host="10.77.1.11", ssh_port=2222)
    return Cluster(load_params(write_params(base)))


def lab_context(write_params: Callable[[dict[str, Any]], Path], base: dict[str, Any], run_dir: Path) -> Context:
    cluster = lab_cluster(write_params, base)
    return Context(cluster.params, cluster, runtime_for(cluster.params), run_dir)


def test_restore_plan_is_written_for_every_target_before_acting_and_reaches_nodes_by_address(
        write_params: Callable[[dict[str, Any]], Path], base: dict[str, Any], tmp_path: Path) -> None:
    p = plan(lab_inventories(), LAB)
    ctx = lab_context(write_params, base, tmp_path)
    files = restore_files(ctx, tmp_path / "lab.yaml", p)
    steps = kept(files, ctx.params, tmp_path)
    assert {(s.node, s.name) for s in steps} == {(t.node, t.name) for t in p.targets}
    assert [s.name for s in steps] == ["python3[40]", "vllm_node", "vllm_node", "old-vllm"], \
        "reverse plan order, owned containers after their owner"
    script = (tmp_path / "restore.sh").read_text()
    ssh = f"ssh -i {tmp_path}/id_test -o UserKnownHostsFile={tmp_path}/known_hosts -p"
    assert f"{ssh} 22 root@10.77.1.10 'docker start old-vllm'" in script
    assert f"{ssh} 22 root@10.77.1.10 'cd / && {{ setsid python3 " in script
    assert "# lab-1 vllm_node: comes back with lab-0/python3[40]" in script
    assert "ssh lab-" not in script, "a node's name is not an SSH address"
    lab = ctx.params.cluster
    assert f"{ssh} 22 root@10.77.1.10 'docker stop sparkbook-{lab}-front || true'" in script, "the front holds a port"
    assert json.loads((tmp_path / "restore-plan.json").read_text())["steps"][2]["ssh"] == f"{ssh} 2222 root@10.77.1.11"


def test_restore_brings_back_owners_only_and_judges_owned_containers(
        write_params: Callable[[dict[str, Any]], Path], base: dict[str, Any], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    p = plan(lab_inventories(), LAB)
    steps = restore_files(lab_context(write_params, base, tmp_path), tmp_path / "lab.yaml", p).plan.steps
    ran: list[str] = []
    monkeypatch.setattr("sparkbook.stages.cleanup.restore._restore_one", lambda n, s, secrets: ran.append(s.name) or "ok")
    actions = bring_back(lab_cluster(write_params, base), steps, [], {})
    assert ran == ["python3[40]", "old-vllm"] and all(a.ok for a in actions)
    owned = next(s for s in steps if s.owner)
    assert judge(owned, Seen("running", True, None, "", 30.0)).ok
    assert judge(owned, Seen("gone (NotFound)", False, None, "", 0.0)).problems[0] == "not running (gone (NotFound))"


def test_unit_stop_timeout_is_a_parameter_defaulting_to_90_s() -> None:
    assert CleanupTargets().unit_stop_timeout_s == 90
    unit = Unit("vllm-cluster.service", "active", [], [], None)
    t = plan([Inventory("h", [], "Docker 28", [unit], "systemd", [], "no GPU", [], MEM)],
             CleanupTargets(systemd_units=["vllm-*"], unit_stop_timeout_s=300)).targets[0]
    assert t.stop_timeout_s == 300


def test_a_matched_process_is_recorded_with_its_exact_argv_working_directory_and_user() -> None:
    """LAUNCH_PROBE's reply (cmdline NULs turned into \\x1f; then uid, gid and groups from /proc/PID/status): an
    argument with a space survives, unlike `ps` args; a process a user ran is relaunched as that user."""
    procs = tree(["40 1 python3 /srv/mgr.py --title old cluster", "41 40 docker run --rm --name vllm_node img"])
    node = FakeNode("lab-0", "==40==\n/srv\npython3\x1f/srv/mgr.py\x1f--title\x1fold cluster\x1f\n1000 1000  27 44\n")
    rows = table(["40 python3 python3 /srv/mgr.py --title old cluster", "41 docker docker run"], procs)
    (pr,) = inventory._processes(node, inventory.matched_processes(rows, ["*mgr.py*"], {})[0], procs)
    assert (pr.pid, pr.cwd, pr.argv, pr.family, pr.user) == (
        40, "/srv", ["python3", "/srv/mgr.py", "--title", "old cluster"], [40, 41], (1000, 1000, [27, 44]))
    assert planning.relaunch(pr, {}, 1000).command() == ("cd /srv && { setsid python3 /srv/mgr.py --title 'old "
                                                         "cluster' </dev/null >/dev/null 2>&1 & }")
    assert planning.relaunch(pr, {}, 0).command() == (
        "cd /srv && { setpriv --reuid=1000 --regid=1000 --groups=27,44 -- setsid python3 /srv/mgr.py --title "
        "'old cluster' </dev/null >/dev/null 2>&1 & }"), "root relaunches it as its user, never as root"


def test_a_process_of_another_user_or_of_an_unread_user_is_not_relaunched_by_a_non_root_ssh_user() -> None:
    pr = Process(40, "python3", "python3 /srv/mgr.py", [40], "/srv", ["python3", "/srv/mgr.py"], (1000, 1000, []))
    assert "it ran as uid 1000, and the SSH user (uid 1001)" in (planning.cannot_relaunch(pr, {}, 1001) or "")
    assert planning.cannot_relaunch(pr, {}, 1000) is None and planning.cannot_relaunch(pr, {}, 0) is None
    unread = Process(40, "python3", "python3 /srv/mgr.py", [40], "/srv", ["python3", "/srv/mgr.py"])
    assert "did not show which user ran it" in (planning.cannot_relaunch(unread, {}, 0) or "")
