"""Node state (issue 56, high): the state dir is refused unless it is the SSH user's alone below parents no one else
can change, and a PID read back from a file is signalled only when /proc says it is the process the runbook spawned.
Planted on this machine through a local-transport node, as another user (uid 65534, nobody) would plant them."""
from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from sparkbook.core.cluster import nodestate
from sparkbook.core.cluster.nodes import Cluster, Node
from sparkbook.core.cluster.nodestate import NodeStateError, judge
from sparkbook.core.cluster.runtime import KILL_SH, RUNNING_SH, SPAWN_SH, killed
from sparkbook.core.values.params import load_params

NOBODY = 65534
ME = os.getuid()


@pytest.mark.parametrize("lines,why", [
    (["d 0 1777 /tmp", f"d {NOBODY} 700 /tmp/sb"], f"/tmp/sb is owned by uid {NOBODY}"),
    (["d 0 777 /srv", "d 0 700 /srv/sb"], "its parent /srv has mode 777: others can write in it"),
    ([f"d {NOBODY} 755 /home/x", "d 0 700 /home/x/sb"], f"its parent /home/x is owned by uid {NOBODY}"),
    (["d 0 1777 /tmp", f"l {NOBODY} 777 /tmp/sb"], f"/tmp/sb is a symbolic link owned by uid {NOBODY}"),
    (["d 0 755 /srv", "d 1000 770 /srv/sb"], "/srv/sb has mode 770: others can write in it"),
    (["d 0 755 /srv", "o 0 644 /srv/sb"], "/srv/sb is not a directory"),
    ([], "it is not an absolute path"),
])
def test_judge_refuses_a_dir_anyone_else_owns_or_can_change(lines: list[str], why: str) -> None:
    with pytest.raises(NodeStateError) as refused:
        judge(lines, 1000, "lab-1", "/x")
    assert why in str(refused.value) and str(refused.value).startswith("lab-1: state dir /x: "), str(refused.value)


def test_judge_takes_a_dir_of_our_own_below_root_or_sticky_parents() -> None:
    assert judge(["d 0 1777 /tmp", "d 0 755 /tmp/ours", "d 0 700 /tmp/ours/sb"], 0, "n", "/x") == "/tmp/ours/sb"
    assert judge(["d 0 700 /root", "l 0 777 /root/link", "d 0 700 /srv/sb"], 0, "n", "/x") == "/srv/sb"


@pytest.fixture
def node_at(base: dict[str, Any], write_params: Callable[..., Path]) -> Iterator[Callable[[str], Node]]:
    clusters: list[Cluster] = []

    def make(state_dir: str) -> Node:
        for n in base["nodes"]:
            n.update(transport="local", state_dir=state_dir)
        clusters.append(Cluster(load_params(write_params(base))))
        return clusters[-1].head

    yield make
    for c in clusters:
        c.close()


needs_root = pytest.mark.skipif(ME != 0, reason="planting another user's files needs root")


@needs_root
def test_a_state_dir_made_first_by_another_user_is_refused(node_at: Callable[[str], Node], tmp_path: Path) -> None:
    planted = tmp_path / "sb"
    planted.mkdir(mode=0o777)
    (planted / "logs").symlink_to("/etc/passwd-never")
    os.chown(planted, NOBODY, NOBODY)
    with pytest.raises(NodeStateError) as refused:
        nodestate.ensure(node_at(str(planted)))
    text = str(refused.value)
    assert f"state dir {planted}: {planted} is owned by uid {NOBODY}" in text and "\n" not in text, text
    assert os.readlink(planted / "logs") == "/etc/passwd-never" and planted.stat().st_uid == NOBODY, "left as it is"


@needs_root
def test_a_state_dir_below_a_parent_another_user_owns_is_refused_and_not_made(node_at: Callable[[str], Node],
                                                                             tmp_path: Path) -> None:
    parent = tmp_path / "theirs"
    parent.mkdir()
    os.chown(parent, NOBODY, NOBODY)
    with pytest.raises(NodeStateError, match=f"owned by uid {NOBODY}"):
        nodestate.ensure(node_at(str(parent / "sb")))
    assert not (parent / "sb").exists(), "nothing is made below a directory someone else controls"


@needs_root
def test_a_state_dir_that_is_another_users_link_is_refused(node_at: Callable[[str], Node], tmp_path: Path) -> None:
    victim = tmp_path / "root-owned"
    victim.mkdir()
    link = tmp_path / "sb"
    link.symlink_to(victim)
    os.lchown(link, NOBODY, NOBODY)
    with pytest.raises(NodeStateError, match=f"is a symbolic link owned by uid {NOBODY}"):
        nodestate.ensure(node_at(str(link)))
    assert list(victim.iterdir()) == []


def test_a_fresh_state_dir_is_made_0700_and_the_lock_lies_in_it(node_at: Callable[[str], Node],
                                                                tmp_path: Path) -> None:
    node = node_at(str(tmp_path / "a" / "sb"))
    assert nodestate.lock_path(node) == f"{tmp_path}/a/sb/run.lock"
    assert (tmp_path / "a" / "sb").stat().st_mode & 0o777 == 0o700
    assert (tmp_path / "a").stat().st_mode & 0o777 == 0o700, "parents made on the way are the user's alone too"


@pytest.fixture
def sleeper() -> Iterator[subprocess.Popen[bytes]]:
    """A process the runbook did not spawn (the planted PID file names it)."""
    proc = subprocess.Popen(["sleep", "300"])
    yield proc
    proc.kill()
    proc.wait()


def _sh(script: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["sh", "-c", script, *args], capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("record", ["{pid}", "{pid} 12345", "1 1", "0 5", "-1 2", "{pid} {start} 0"])
def test_a_pid_file_naming_another_process_is_refused_and_it_still_runs(record: str, sleeper: subprocess.Popen[bytes],
                                                                        tmp_path: Path) -> None:
    start = Path(f"/proc/{sleeper.pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    pid_file = tmp_path / "serve-1.log.pid"
    pid_file.write_text(record.format(pid=sleeper.pid, start=start) + "\n")
    done = _sh(KILL_SH, str(pid_file), "1")
    if record.startswith("{pid} "):  # a well-formed record of a process that has ended: its PID is another's now
        assert done.returncode == nodestate.GONE and "not signalled" in done.stderr, done
    else:
        assert done.returncode == nodestate.REFUSED and "refused" in done.stderr, done
    assert not _sh(RUNNING_SH, str(pid_file)).returncode == 0
    time.sleep(0.2)
    assert sleeper.poll() is None, "the planted process was not signalled"
    assert pid_file.exists()


def test_a_pid_file_that_is_a_link_is_refused(sleeper: subprocess.Popen[bytes], tmp_path: Path) -> None:
    (tmp_path / "elsewhere").write_text(f"{sleeper.pid} 1\n")
    (tmp_path / "x.pid").symlink_to(tmp_path / "elsewhere")
    done = _sh(KILL_SH, str(tmp_path / "x.pid"), "1")
    assert done.returncode == nodestate.REFUSED and "is a symbolic link" in done.stderr and sleeper.poll() is None


def test_what_the_runbook_spawned_is_recognised_and_killed(tmp_path: Path, node_at: Callable[[str], Node]) -> None:
    log = tmp_path / "logs" / "serve-1.log"
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "serve-1.log").symlink_to(tmp_path / "victim")  # planted: not followed, replaced
    subprocess.run(["sh", "-c", SPAWN_SH, str(log), "sleep", "300"], timeout=30, check=False,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 10
    while not Path(f"{log}.pid").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    pid = int(Path(f"{log}.pid").read_text().split()[0])
    assert not (tmp_path / "victim").exists() and not log.is_symlink(), "the log was made afresh, not followed"
    assert _sh(RUNNING_SH, f"{log}.pid").returncode == 0
    node = node_at(str(tmp_path / "sb"))
    killed(node, node.run(["sh", "-c", KILL_SH, f"{log}.pid", "2"], timeout=30))
    deadline = time.monotonic() + 10
    while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not Path(f"/proc/{pid}").exists() or " Z " in Path(f"/proc/{pid}/stat").read_text(), "it was killed"


def test_a_refused_kill_is_said_in_one_line(sleeper: subprocess.Popen[bytes], tmp_path: Path,
                                            node_at: Callable[[str], Node]) -> None:
    pid_file = tmp_path / "x.pid"
    pid_file.write_text("1 1\n")
    node = node_at(str(tmp_path / "sb"))
    with pytest.raises(NodeStateError) as refused:
        killed(node, node.run(["sh", "-c", KILL_SH, str(pid_file), "1"], timeout=30))
    assert "names pid 1: refused" in str(refused.value) and "\n" not in str(refused.value)
    assert sleeper.poll() is None
