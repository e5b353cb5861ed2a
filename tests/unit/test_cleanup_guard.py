"""01 never plans PID 1, kernel threads, sshd/dockerd/containerd, the lab's node processes, the probe's session or the
controller with its ancestors, whatever a pattern matches; a pattern matching more than cleanup.max_targets on one
node is refused with what it matched (issue 43, item 6). On recorded `ps` texts: no node is contacted."""
from __future__ import annotations

import os

import pytest

from sparkbook.core.analysis.hostfacts import Memory
from sparkbook.core.values.params import CleanupTargets
from sparkbook.stages.cleanup import guard, inventory
from sparkbook.stages.cleanup.inventory import Inventory, Process, Unit
from sparkbook.stages.cleanup.ownership import tree
from sparkbook.stages.cleanup.planning import PatternTooBroad, plan

MEM = Memory(100 << 30, 50 << 30)
# a lab node as `ps -eo pid=,comm=,args=` and `ps -eo pid=,ppid=,args=` show it: its init is PID 1, 01 came in by
# sshd (300) -> bash (301) -> sh (302, the probe, `$$`) -> ps (303); the old manager (400) runs its container client
PS = """\
    1 python3         /usr/bin/python3 -I /opt/sparkbook/lab/cluster.py node-init /root/lab/nodes/lab-0/node.json
    2 kthreadd        [kthreadd]
   17 kworker/0:1     [kworker/0:1-events]
  100 dockerd         dockerd --host unix:///run/docker.sock
  110 containerd      containerd --config /var/run/docker/containerd/containerd.toml
  120 containerd-shim /usr/bin/containerd-shim-runc-v2 -namespace moby -id abc
  200 sshd            /usr/sbin/sshd -D -f /root/lab/nodes/lab-0/ssh/sshd_config
  300 sshd            sshd: root@notty
  301 bash            bash -c sh -c 'echo ==meminfo==; python3 probe'
  302 sh              sh -c echo ==meminfo==; python3 probe
  303 ps              ps -eo pid=,comm=,args=
  400 python3         python3 /srv/old_cluster_manager.py --model tiny
  401 docker          docker run --rm --name vllm_node old-image
"""
TREE = """\
    1     0 /usr/bin/python3 -I /opt/sparkbook/lab/cluster.py node-init /root/lab/nodes/lab-0/node.json
    2     0 [kthreadd]
   17     2 [kworker/0:1-events]
  100     1 dockerd --host unix:///run/docker.sock
  110   100 containerd --config /var/run/docker/containerd/containerd.toml
  120     1 /usr/bin/containerd-shim-runc-v2 -namespace moby -id abc
  200     1 /usr/sbin/sshd -D -f /root/lab/nodes/lab-0/ssh/sshd_config
  300   200 sshd: root@notty
  301   300 bash -c sh -c 'echo ==meminfo==; python3 probe'
  302   301 sh -c echo ==meminfo==; python3 probe
  303   302 ps -eo pid=,comm=,args=
  400     1 python3 /srv/old_cluster_manager.py --model tiny
  401   400 docker run --rm --name vllm_node old-image
"""


def _table() -> dict[int, guard.Proc]:
    return guard.table(PS.splitlines(), tree(TREE.splitlines()))


def _matched(patterns: list[str], roots: dict[int, str]) -> tuple[set[int], dict[int, str]]:
    rows = _table()
    found, kept = inventory.matched_processes(rows, patterns, guard.spared(rows, roots))
    return {p.pid for p in found}, {int(k.name.split("[")[1].rstrip("]")): k.why for k in kept}


def test_a_star_pattern_plans_only_the_old_deployment_never_init_kernel_daemons_or_the_probe_session() -> None:
    planned, kept = _matched(["*"], guard.roots(302, ""))
    assert planned == {400, 401}
    assert "PID 1" in kept[1] and "kernel thread" in kept[2] and "kernel thread" in kept[17]
    assert all("the node is reached and run by" in kept[pid] for pid in (100, 110, 120, 200, 300))
    assert all("inventory probe" in kept[pid] for pid in (301, 302, 303)), "the session 01 came in by, its ps too"


def test_python_matches_the_old_manager_but_never_the_lab_nodes_init() -> None:
    planned, kept = _matched(["*python*"], guard.roots(302, ""))
    assert planned == {400}
    assert set(kept) == {1, 301, 302}, "the probe's shells carry `python3 probe` but are spared"


def test_the_lab_node_init_is_spared_from_the_host_too() -> None:
    """On the lab's host (no PID namespace) its nsenter/unshare and init are no PID 1: still never stopped."""
    p = guard.Proc(5000, 4000, "nsenter", "nsenter --net=/var/run/netns/sbk-lab-0 unshare --pid --fork python3 -I "
                                          "/x/sparkbook/lab/cluster.py node-init /x/node.json")
    assert guard.why_spared(p) == "a lab node's own process (its init)"
    assert guard.why_spared(guard.Proc(5001, 1, "python3", "python3 /srv/old_cluster_manager.py")) is None


def test_the_controller_and_its_ancestors_only_where_the_node_is_the_controllers_own_host() -> None:
    here, parent = os.getpid(), os.getppid()
    rows = {1: guard.Proc(1, 0, "init", "/sbin/init"), parent: guard.Proc(parent, 1, "bash", "bash"),
            here: guard.Proc(here, parent, "python3", "python3 -m sparkbook run params/lab.yaml")}
    same = guard.spared(rows, guard.roots(None, guard.controller_host_id()))
    assert "this controller" in same[here] and "this controller" in same[parent]
    other_boot = f"{'0' * 36} {os.readlink('/proc/self/ns/pid')}"
    elsewhere = guard.spared(rows, guard.roots(None, other_boot))
    assert here not in elsewhere and parent not in elsewhere, "another host's same PID is another process"
    assert guard.roots(None, "") == {}, "a node that did not say is not taken for the controller's host"


def test_a_unit_holding_a_spared_process_is_never_planned() -> None:
    rows = _table()
    never = guard.spared(rows, guard.roots(302, ""))
    units = [Unit("ssh.service", "active", [], [200]), Unit("vllm-old.service", "active", [], [400, 401])]
    kept = inventory.spared_units(units, ["*"], never)
    assert [(k.name, k.pattern) for k in kept] == [("ssh.service", "*")]
    inv = Inventory("lab-0", [], "Docker 28", units, "systemd", [], "no GPU", [], MEM, spared=kept)
    p = plan([inv], CleanupTargets(systemd_units=["*"]))
    assert [t.name for t in p.targets] == ["vllm-old.service"]
    assert any("ssh.service matches '*' but is never stopped" in w for w in p.warnings), "said in the plan"


def _many(n: int) -> Inventory:
    procs = [Process(1000 + i, "python3", f"python3 /srv/worker{i}.py") for i in range(n)]
    return Inventory("lab-0", [], "Docker 28", [], "systemd", procs, "no GPU", [], MEM)


def test_a_pattern_matching_more_than_max_targets_is_refused_naming_the_field_and_the_list() -> None:
    with pytest.raises(PatternTooBroad) as refused:
        plan([_many(9)], CleanupTargets(processes=["*python*"]))
    text = str(refused.value)
    assert "cleanup.processes pattern '*python*' matches 9 targets on lab-0" in text
    assert "cleanup.max_targets (8)" in text and "python3[1000]" in text and "python3[1008]" in text
    assert refused.value.remediation and "narrow the pattern" in refused.value.remediation


def test_max_targets_is_a_parameter_and_a_match_within_it_is_planned() -> None:
    assert CleanupTargets().max_targets == 8
    assert len(plan([_many(8)], CleanupTargets(processes=["*python*"])).targets) == 8
    assert len(plan([_many(9)], CleanupTargets(processes=["*python*"], max_targets=9)).targets) == 9


# issue 56: `*` counted before sparing, and the runbook's own connections never planned
QUIET = ["1 0 /sbin/init", "200 1 sshd: /usr/sbin/sshd -D [listener]", "300 200 sshd-session: root@notty",
         "301 300 docker system dial-stdio", "310 1 /lib/systemd/systemd --user", "311 310 (sd-pam)",
         "320 1 @dbus-daemon --system --address=systemd: --nofork", "400 1 python3 /srv/old.py"]
QUIET_COMM = {1: "systemd", 200: "sshd", 300: "sshd-session", 301: "docker", 310: "systemd", 311: "(sd-pam)",
              320: "dbus-daemon", 400: "python3"}


def _quiet(patterns: list[str]) -> Inventory:
    """A quiet node as the inventory builds it: the old service, and the processes of logins (the runbook's own
    Docker connection, a user's systemd) and daemons, none of which `*` may plan."""
    procs = tree(QUIET)
    rows = guard.table([f"{pid} {QUIET_COMM[pid]} {args}" for pid, (_, args) in procs.items()], procs)
    never = guard.spared(rows, guard.roots(None, ""))
    matched, kept = inventory.matched_processes(rows, patterns, never)
    return Inventory("lab-0", [], "Docker 28", [], "systemd", [Process(p.pid, p.comm, p.args) for p in matched],
                     "no GPU", [], MEM, spared=kept)


def test_the_runbooks_own_connection_processes_a_users_systemd_and_dbus_are_never_planned() -> None:
    p = plan([_quiet(["*"])], CleanupTargets(processes=["*"]))
    assert [t.name for t in p.targets] == ["python3[400]"]
    spared = " ".join(p.warnings)
    for name in ("docker[301]", "systemd[310]", "(sd-pam)[311]", "dbus-daemon[320]"):
        assert f"{name} matches '*' but is never stopped" in spared


def test_star_is_counted_before_sparing_so_a_quiet_node_refuses_it() -> None:
    with pytest.raises(PatternTooBroad) as refused:
        plan([_quiet(["*"])], CleanupTargets(processes=["*"], max_targets=3))
    assert "cleanup.processes pattern '*' matches 8 targets on lab-0" in str(refused.value)
    assert "docker[301] (never stopped)" in str(refused.value)
