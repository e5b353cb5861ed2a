"""Node state on a lab node, planted by an unprivileged user (issue 56, high): on lab-1, `nobody` makes the state dir
first (with a link inside aimed at a root-owned file), or makes it a link to a root-owned directory, or writes PID
files naming a process of theirs or PID 1. The runbook, as root over SSH, refuses each in one line naming the node
and path; the root-owned targets are untouched and the planted process still runs. Seconds of lab time; it uses
lab-1's own /tmp and a state dir of its own, so a deployment serving on the lab is not disturbed. Everything planted
is removed at the end (the process killed by its PID)."""
from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Iterator

import pytest
import yaml

import sparkbook.lab as sblab
from sparkbook.core.cluster.nodes import Cluster, Node, NodeError
from sparkbook.core.cluster.nodestate import GONE, NodeStateError, ensure
from sparkbook.core.cluster.runtime import KILL_SH, RUNNING_SH, killed
from sparkbook.core.values.params import load_params
from sparkbook.runbook import lock

pytestmark = pytest.mark.lab
NODE = "lab-1"
TAG = f"sb-nodestate-{uuid.uuid4().hex[:8]}"  # every planted path on lab-1 starts /tmp/TAG


@pytest.fixture(scope="module")
def node_with(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[[str | None], Node]]:
    """lab-1 over SSH as the lab's params reach it, with its state_dir set as given (None: the default)."""
    if os.geteuid() != 0:
        pytest.skip("the lab needs root")
    data = yaml.safe_load(sblab.params_file(2).read_text())
    clusters: list[Cluster] = []

    def make(state_dir: str | None) -> Node:
        for n in data["nodes"]:
            n.pop("state_dir", None)
            if n["name"] == NODE and state_dir:
                n["state_dir"] = state_dir
        path = tmp_path_factory.mktemp("params") / "lab.yaml"
        path.write_text(yaml.safe_dump(data))
        clusters.append(Cluster(load_params(path)))
        node = clusters[-1].nodes[NODE]
        try:
            node.connect()
        except NodeError as exc:
            pytest.skip(f"the lab is not up: {exc}")
        return node

    root = make(None)
    yield make
    root.run(["sh", "-c", f'rm -rf /tmp/{TAG}*'], timeout=30)
    for c in clusters:
        c.close()


def _as_nobody(node: Node, script: str) -> str:
    r = node.run(["runuser", "-u", "nobody", "--", "sh", "-c", script], timeout=30, check=True)
    return r.stdout.strip()


def test_a_state_dir_nobody_made_first_is_refused_and_its_link_not_followed(node_with) -> None:  # type: ignore[no-untyped-def]
    root = node_with(None)
    victim = f"/tmp/{TAG}-victim"
    root.run(["sh", "-c", f'printf root-owned >{victim}'], timeout=30, check=True)
    planted = f"/tmp/{TAG}-state"
    _as_nobody(root, f"mkdir -m 777 {planted} && ln -s {victim} {planted}/run.lock && ln -s {victim} {planted}/logs")
    node = node_with(planted)
    with pytest.raises(NodeStateError) as refused:
        ensure(node)
    text = str(refused.value)
    assert text.startswith(f"{NODE}: state dir {planted}: {planted} is owned by uid 65534") and "\n" not in text, text
    with pytest.raises(NodeStateError):  # the run lock lives there: no run takes it
        lock.acquire(load_params(sblab.params_file(2)), node, lock.me("run-x", "lab.yaml"), params_file="lab.yaml")
    assert root.run(["cat", victim], timeout=30).stdout == "root-owned", "the root-owned file is untouched"
    assert root.run(["stat", "-c", "%U", victim], timeout=30).stdout.strip() == "root"


def test_a_state_dir_that_is_nobodys_link_to_a_root_dir_is_refused(node_with) -> None:  # type: ignore[no-untyped-def]
    root = node_with(None)
    target = f"/tmp/{TAG}-rootdir"
    root.run(["mkdir", "-m", "700", target], timeout=30, check=True)
    link = f"/tmp/{TAG}-link"
    _as_nobody(root, f"ln -s {target} {link}")
    with pytest.raises(NodeStateError, match="is a symbolic link owned by uid 65534"):
        ensure(node_with(link))
    assert root.run(["ls", "-A", target], timeout=30).stdout == "", "nothing was made in the root-owned dir"


def test_a_state_dir_below_a_dir_nobody_owns_is_refused_and_not_made(node_with) -> None:  # type: ignore[no-untyped-def]
    root = node_with(None)
    theirs = f"/tmp/{TAG}-theirs"
    _as_nobody(root, f"mkdir -m 755 {theirs}")
    with pytest.raises(NodeStateError, match=f"{theirs} is owned by uid 65534"):
        ensure(node_with(f"{theirs}/state"))
    assert root.run(["test", "-e", f"{theirs}/state"], timeout=30).exit_code == 1


@pytest.fixture
def nobodys_sleep(node_with) -> Iterator[int]:  # type: ignore[no-untyped-def]
    root = node_with(None)
    pid = int(_as_nobody(root, "sleep 300 >/dev/null 2>&1 </dev/null & echo $!"))
    yield pid
    root.run(["kill", "-KILL", str(pid)], timeout=30)


@pytest.mark.parametrize("record", ["{pid}", "{pid} 1", "1 {init_start}", "{pid} {start}", "link"])
def test_a_pid_file_naming_a_process_the_runbook_did_not_spawn_is_refused(record: str, nobodys_sleep: int,
                                                                          node_with) -> None:  # type: ignore[no-untyped-def]
    node = node_with(f"/tmp/{TAG}-ours")
    state = ensure(node)  # ours: made 0700 by root on lab-1
    assert node.run(["stat", "-c", "%U %a", state], timeout=30).stdout.split() == ["root", "700"]
    start = node.run(["sh", "-c", f'cut -d")" -f2- /proc/{nobodys_sleep}/stat | cut -d" " -f21'],
                     timeout=30).stdout.strip()
    init_start = node.run(["sh", "-c", 'cut -d")" -f2- /proc/1/stat | cut -d" " -f21'], timeout=30).stdout.strip()
    pid_file = f"{state}/serve-1.log.pid"
    if record == "link":  # a link to a file naming the process with its true start time
        node.run(["sh", "-c", f'echo "{nobodys_sleep} {start}" >{state}/elsewhere; ln -sf elsewhere {pid_file}'],
                 timeout=30, check=True)
    else:  # "{pid} {start}": its true start time, but it leads no session of its own (not what the runbook spawns)
        text = record.format(pid=nobodys_sleep, start=start, init_start=init_start)
        node.run(["sh", "-c", f'echo "{text}" >{pid_file}'], timeout=30, check=True)
    assert not node.run(["sh", "-c", RUNNING_SH, pid_file], timeout=30).ok
    answer = node.run(["sh", "-c", KILL_SH, pid_file, "1"], timeout=30)
    if record in ("{pid} 1", "{pid} {start}"):  # well-formed, of a process that ended: nothing signalled, no stop
        assert answer.exit_code == GONE and "not signalled" in answer.stderr, answer
    else:
        with pytest.raises(NodeStateError) as refused:
            killed(node, answer)
        assert str(refused.value).startswith(f"{NODE}: not signalled: ") and "refused" in str(refused.value)
    assert node.run(["kill", "-0", str(nobodys_sleep)], timeout=30).ok, "the planted process still runs"
    assert node.run(["kill", "-0", "1"], timeout=30).ok
