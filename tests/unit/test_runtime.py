"""The Runtime and ImageSource interfaces and the fan-out result, on `transport: local` nodes running real commands
here: both runtimes implement every verb, the Python runtime's verbs work end to end, the Docker runtime's CLI verbs
read a stand-in `docker`, and a fan-out names every node that failed."""
from __future__ import annotations

import os
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from sparkbook.core.cluster import topology
from sparkbook.core.cluster.nodes import Cluster, LocalNode, Node
from sparkbook.core.cluster.nodestate import NodeStateError, ensure
from sparkbook.core.cluster.runtime import ImageSource, Place, Runtime
from sparkbook.core.cluster.runtime_docker import DockerImages, DockerNodes
from sparkbook.core.cluster.runtime_python import PythonImages, PythonNodes
from sparkbook.core.cluster.runtimes import image_source_for, runtime_for
from sparkbook.core.values.errors import SparkbookError
from sparkbook.core.values.fanout import FanOut
from sparkbook.core.values.params import load_params

# a stand-in `docker`: one image is held, the daemon never answers, `run` prints its argv one per line
FAKE_DOCKER = """#!/bin/sh
case "$1" in
  image) if [ "$5" = held:1 ]; then echo "sha256:abc 1234"; else echo "Error: No such image: $5" >&2; exit 1; fi ;;
  version) echo "Cannot connect to the Docker daemon at unix:///var/run/docker.sock" >&2; exit 1 ;;
  run) printf '%s\\n' "$@" ;;
esac
"""


@pytest.fixture
def local(write_params: Callable[[dict[str, Any]], Path], base: dict[str, Any], tmp_path: Path,
          monkeypatch: pytest.MonkeyPatch) -> Callable[[dict[str, Any]], Cluster]:
    """A cluster of `transport: local` nodes (a, b, c) with the given runtime, each with a state dir of this test's
    own; closed at the end."""
    monkeypatch.setenv("SPARKBOOK_HEADLESS", "1")
    base["nodes"].append({**base["nodes"][1], "name": "c", "fabric_ip": "10.9.0.3"})
    base["nodes"] = [{**n, "transport": "local", "state_dir": str(tmp_path / "state" / n["name"])}
                     for n in base["nodes"]]
    clusters: list[Cluster] = []

    def make(runtime: dict[str, Any]) -> Cluster:
        clusters.append(Cluster(load_params(write_params({**base, "runtime": runtime}))))
        return clusters[-1]

    yield make
    for c in clusters:
        c.close()


@pytest.fixture
def fake_docker(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "docker").write_text(FAKE_DOCKER)
    (bindir / "docker").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bindir}:{os.environ['PATH']}")


def test_both_runtimes_implement_the_protocol_and_nodes_one_interface(local) -> None:  # type: ignore[no-untyped-def]
    docker_cluster = local({"kind": "docker", "images": ["example/vllm:0.17"]})
    python_cluster = local({"kind": "python", "python": sys.executable})
    docker_rt, python_rt = runtime_for(docker_cluster.params), runtime_for(python_cluster.params)
    assert isinstance(docker_rt, DockerNodes) and isinstance(python_rt, PythonNodes)
    assert isinstance(docker_rt, Runtime) and isinstance(python_rt, Runtime)
    docker_src, python_src = image_source_for(docker_cluster.params), image_source_for(python_cluster.params)
    assert isinstance(docker_src, DockerImages) and isinstance(python_src, PythonImages)
    assert isinstance(docker_src, ImageSource) and isinstance(python_src, ImageSource)
    node = python_cluster.head
    assert isinstance(node, LocalNode) and isinstance(node, Node) and node.local
    node.connect()
    assert node.streaming() is node


def test_python_runtime_verbs_on_a_local_node(local) -> None:  # type: ignore[no-untyped-def]
    cluster = local({"kind": "python", "python": sys.executable})
    rt, src, node = runtime_for(cluster.params), image_source_for(cluster.params), cluster.head
    assert src.candidates() == [sys.executable] and not src.copies_images and rt.not_reusable is None
    assert src.image(node, sys.executable) is None and rt.lacks(node, sys.executable, None) is None
    assert src.installed() is None and "runtime python" in src.no_installed_reason()
    assert src.installed("found:running") is None, "an environment runs no image: what ran before is no candidate"
    assert (rt.place_word, rt.own_place, src.pulls, src.runs_images) == ("process dir", False, False, False)
    assert rt.devices(node) == [] and rt.existing(node, Place(node.name, "x")) is None
    preflight = rt.preflight(cluster)
    assert preflight == {} and not preflight.failed and preflight.values_or_raise() == []
    out = rt.one_off(node, None, ["python", "-c", "import sys; print(sys.executable)"], timeout=30)
    assert out.ok and out.stdout.strip() == sys.executable, out
    assert src.identity(node, sys.executable) is None  # no vLLM in this interpreter

    place = Place(node.name, f"sparkbook-unit-{uuid.uuid4().hex[:8]}", None, {"SB_UNIT": "x y"})
    log = f"/tmp/sparkbook/{place.name}/out.log"
    rt.start(node, rt.start_spec(node, place, gpus=False, devices=rt.devices(node)))
    try:
        assert rt.exec(node, place, ["sh", "-c", 'printf %s "$SB_UNIT"'], timeout=30).stdout == "x y"
        found = rt.existing(node, place)  # what 04's keep compares: the record start wrote, nothing spawned yet
        assert found is not None and found.status == "exited" and found.image_id == "" and found.env["SB_UNIT"] == "x y"
        assert rt.alive(node, place), "a started place stands with nothing running in it (vLLM's own launch, 04 to 05)"
        spawned = rt.spawn(node, place, ["python", "-c", "import time; print('up', flush=True); time.sleep(60)"], log)
        end = time.monotonic() + 20
        while "up" not in rt.read(node, place, log) and time.monotonic() < end:
            time.sleep(0.2)
        assert rt.read(node, place, log).strip() == "up" and rt.running(node, place, spawned)
        assert rt.alive(node, place) and rt.existing(node, place).status == "running"  # type: ignore[union-attr]
        rt.kill(node, place, spawned, grace_s=2)
        assert not rt.running(node, place, spawned)
    finally:
        assert rt.stop(node, place)
    assert not rt.alive(node, place)


def test_a_python_place_keeps_no_secret_and_a_spawn_gets_them_from_stdin_only(local) -> None:  # type: ignore[no-untyped-def]
    """04 keeps a Python runtime's Ray by the record its start wrote (issue 40: on one H200 a second deploy's 04
    restarted it and stopped the server); the record holds no secret, and a spawned process gets the params' and
    its own secrets in its environment, on no command line (issue 43, item 3)."""
    cluster = local({"kind": "python", "python": sys.executable})
    node = cluster.head
    rt = PythonNodes(cluster.params.runtime, {"HF_TOKEN": "hf_unit_secret_value"})  # type: ignore[arg-type]
    place = Place(node.name, f"sparkbook-unit-{uuid.uuid4().hex[:8]}", None, {"SB_UNIT": "1"})
    rt.start(node, rt.start_spec(node, place, gpus=False))
    try:
        record = rt.read(node, place, f"/tmp/sparkbook/{place.name}/place.json")
        assert "SB_UNIT" in record and "HF_TOKEN" not in record and "hf_unit" not in record
        log = f"/tmp/sparkbook/{place.name}/env.log"
        script = 'printf "%s|%s" "$HF_TOKEN" "$VLLM_API_KEY"; cat /proc/$$/cmdline /proc/$PPID/cmdline; sleep 30'
        spawned = rt.spawn(node, place, ["sh", "-c", script], log, secrets={"VLLM_API_KEY": "sk-unit-key"})
        end = time.monotonic() + 20
        while "|" not in rt.read(node, place, log) and time.monotonic() < end:
            time.sleep(0.2)
        text = rt.read(node, place, log)
        assert text.startswith("hf_unit_secret_value|sk-unit-key") and text.count("sk-unit-key") == 1, text
        rt.kill(node, place, spawned, grace_s=2)
    finally:
        rt.stop(node, place)
    assert rt.existing(node, place) is None


def test_session_ids_in_a_place_dir_others_may_write_are_never_trusted(local) -> None:  # type: ignore[no-untyped-def]
    """Issue 43 (read, not run): the IDs behind `pkill -s` came from world-writable /tmp. A place dir someone else could
    write (planted, mode 777) naming a live session is neither alive nor stopped; its session lives on. In a dir of
    our own a record naming the session with another start time (issue 56) is refused, said, and it lives on too."""
    import subprocess

    cluster = local({"kind": "python", "python": sys.executable})
    rt, node = runtime_for(cluster.params), cluster.head
    place = Place(node.name, f"sparkbook-unit-{uuid.uuid4().hex[:8]}")
    victim = subprocess.Popen(["setsid", "sleep", "30"])
    d = Path(ensure(node)) / place.name
    try:
        d.mkdir(parents=True)
        d.chmod(0o777)
        time.sleep(0.3)
        start = Path(f"/proc/{victim.pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
        (d / "sids").write_text(f"{victim.pid} {start}\n")
        assert not rt.alive(node, place)
        rt.stop(node, place)
        assert victim.poll() is None, "a planted session ID killed another session"
        d.mkdir(mode=0o700)  # stop removed the dir; ours, mode 0700: read
        (d / "sids").write_text(f"{victim.pid} {start}\n")
        assert rt.alive(node, place)
        (d / "sids").write_text(f"{victim.pid} {int(start) + 1}\n")  # the session, but not the leader recorded
        with pytest.raises(NodeStateError, match=f"pid {victim.pid} is not the session leader recorded"):
            rt.stop(node, place)
        assert victim.poll() is None, "a session whose leader is not the one recorded is not signalled"
    finally:
        victim.kill()
        victim.wait()
        subprocess.run(["rm", "-rf", str(d)], check=False)


def test_docker_runtime_cli_verbs_read_the_nodes_docker(local, fake_docker) -> None:  # type: ignore[no-untyped-def]
    cluster = local({"kind": "docker", "images": ["held:1", "other:2"], "env": {"E": "v w"}})
    rt, src, node = runtime_for(cluster.params), image_source_for(cluster.params), cluster.head
    assert src.candidates() == ["held:1", "other:2"] and src.copies_images and rt.not_reusable is None
    assert src.image(node, "held:1") == ("sha256:abc", 1234) and src.image(node, "other:2") is None
    assert src.identity(node, "held:1") == "sha256:abc" and src.identity(node, "other:2") is None
    assert rt.lacks(node, "held:1") is None and rt.lacks(node, "held:1", "sha256:abc") is None
    assert rt.lacks(node, "held:1", "sha256:def") == "holds another held:1 (sha256:abc; expected sha256:def)"
    assert rt.lacks(node, "other:2") == "holds no other:2 (absent; expected any)"
    assert src.installed() is None and "installed_image is not set" in src.no_installed_reason()
    assert src.installed("found:running") == "found:running", "the image 01 found running stands in for it"
    named = DockerImages(cluster.params.runtime.model_copy(update={"installed_image": "named:1", "pull": True}))
    assert named.installed("found:running") == "named:1" and named.pulls, "params' installed_image comes first"
    assert (rt.place_word, rt.own_place, src.pulls, src.runs_images) == ("container", True, False, True)
    argv = rt.one_off(node, "held:1", ["python3", "-c", "x"], env={"F": "1"}, timeout=7).stdout.splitlines()
    assert argv == ["run", "--rm", "--pull", "never", "--network", "none", "--label", "org.sparkbook.run=one-off",
                    "-v", "/srv/models:/srv/models:ro", "-e", "E=v w", "-e", "F=1", "--entrypoint", "timeout",
                    "held:1", "-k", "5", "7", "python3", "-c", "x"]  # the image's ENTRYPOINT is replaced
    preflight = rt.preflight(cluster)
    assert list(preflight.failed) == ["a", "b", "c"] and not preflight.succeeded
    with pytest.raises(SparkbookError) as raised:
        preflight.values_or_raise()
    for name in ("a", "b", "c"):
        assert f"{name}: its Docker daemon does not answer (Cannot connect to the Docker daemon" in str(raised.value)


def test_fan_out_result_is_the_dict_and_names_every_failed_node(local) -> None:  # type: ignore[no-untyped-def]
    cluster = local({"kind": "python", "python": sys.executable})

    def step(node: Node) -> str:
        if node.name == "c":
            raise ValueError("no such thing")
        return node.run(["sh", "-c", f'echo {node.name}; [ "{node.name}" = a ]'], check=True).stdout.strip()

    result = cluster.fan_out(step)
    assert isinstance(result, FanOut) and list(result) == ["a", "b", "c"]
    assert [o.ok for o in result.values()] == [True, False, False] and result["a"].value == "a"
    assert list(result.failed) == ["b", "c"] and list(result.succeeded) == ["a"]
    assert [name for name, o in result.items() if not o.ok] == list(result.failed)
    with pytest.raises(SparkbookError) as raised:
        result.values_or_raise()
    message = str(raised.value)
    assert message.startswith("b: `sh -c") and "exited 1" in message and message.endswith("; c: no such thing")
    assert "b: b:" not in message

    class StageError(Exception):
        pass

    with pytest.raises(StageError, match="c: no such thing"):
        result.values_or_raise(StageError)
    assert result.succeeded.values_or_raise() == ["a"]


def test_docker_one_off_passes_the_nodes_gpus_when_asked(local, fake_docker) -> None:  # type: ignore[no-untyped-def]
    cluster = local({"kind": "docker", "images": ["held:1"]})
    rt, node = runtime_for(cluster.params), cluster.head
    with_gpus = rt.one_off(node, "held:1", ["true"], timeout=7, gpus=True).stdout.splitlines()
    without = rt.one_off(node, "held:1", ["true"], timeout=7).stdout.splitlines()
    assert with_gpus[with_gpus.index("--gpus") + 1] == "all" and with_gpus.index("--gpus") < with_gpus.index("held:1")
    assert "--gpus" not in without


def test_status_reads_the_python_runtimes_sessions_and_names_a_disagreement_with_health(local) -> None:  # type: ignore[no-untyped-def]
    """Issue 40, item 5: on the Python runtime (no container) status reads the spawned sessions: a live server is
    running, not "container none"; and /health answering beside a server not seen is said as a problem."""
    from sparkbook.runbook import operate

    cluster = local({"kind": "python", "python": sys.executable})
    rt, node = runtime_for(cluster.params), cluster.head
    place = Place(node.name, f"sparkbook-unit-{uuid.uuid4().hex[:8]}")
    log = f"/tmp/sparkbook/{place.name}/serve-1.log"
    rt.start(node, rt.start_spec(node, place, gpus=False))
    try:
        spawned = rt.spawn(node, place, ["python", "-c", "import time; time.sleep(60)"], log)
        end = time.monotonic() + 20
        while not rt.running(node, place, spawned) and time.monotonic() < end:
            time.sleep(0.2)
        seen = operate._node_status(rt, node, place, log, "running")
        assert (seen.server, seen.container) == ("running", f"no container: the sessions of {place.name} run")
        rt.kill(node, place, spawned, grace_s=2)
        gone = operate._node_status(rt, node, place, log, "not running")
        assert gone.server == "not running" and gone.container == "exited"  # the place, none of its sessions
        status = operate.Status(None, [gone], None)  # type: ignore[arg-type]
        assert not status.serving and status.problems()[0].startswith("PROBLEM: /health answers, yet no recorded")
    finally:
        rt.stop(node, place)


def test_places_of_vllm_s_own_launch_stand_until_05_spawns_in_them(local) -> None:  # type: ignore[no-untyped-def]
    """Issue 45 on one H200: with serve.executor mp 04 starts the Python runtime's places and runs nothing in them;
    05's check that 04's cluster still stands called them 'not running' (by their sessions) and stopped. Without Ray
    the places stand; with Ray the missing Ray head is what is lost."""
    cluster = local({"kind": "python", "python": sys.executable})
    rt = runtime_for(cluster.params)
    where = topology.places(cluster.params, "")
    for node in cluster.nodes.values():
        rt.start(node, rt.start_spec(node, where[node.name], gpus=False))
    try:
        assert topology.lost(cluster.params, cluster, rt, ray=False) == {}
        gone = topology.lost(cluster.params, cluster, rt, ray=True)
        assert set(gone) == set(cluster.nodes) and "Ray head" in gone[cluster.head.name], gone
    finally:
        for node in cluster.nodes.values():
            rt.stop(node, where[node.name])
    assert set(topology.lost(cluster.params, cluster, rt, ray=False)) == set(cluster.nodes)


def test_on_the_python_runtime_the_front_outlives_the_heads_drain_and_its_record_goes_aside(local, tmp_path
                                                                                             ) -> None:  # type: ignore[no-untyped-def]
    """Issue 55 on one H100: the Python runtime's places share the node's log dir, so 04's drain of the head's server
    signalled the front's PID file too, and the head's record of what served stayed for the next place's 05. The drain
    leaves the front's own place alone; setting the head's place aside takes the record along, bringing it back
    returns it."""
    from sparkbook.core.cluster.context import Context
    from sparkbook.stages.raycluster import containers

    cluster = local({"kind": "python", "python": sys.executable})
    rt, head = runtime_for(cluster.params), cluster.head
    ctx = Context(cluster.params, cluster, rt, tmp_path, sys.executable)
    place, front = ctx.place(head.name), ctx.front
    sleeper = ["python", "-c", "import time; time.sleep(60)"]
    for p in (place, front):
        rt.start(head, rt.start_spec(head, p, gpus=False))
    try:
        server = rt.spawn(head, place, sleeper, f"{topology.LOG_DIR}/serve-1.log")
        door = rt.spawn(head, front, sleeper, topology.FRONT_LOG)
        rt.exec(head, place, ["sh", "-c", 'printf %s "$1" >"$0"', topology.SERVING, '{"run": "r1"}'], timeout=30)
        drained = containers.drain_head(ctx, 2)
        assert drained["signalled"] == [f"{topology.LOG_DIR}/serve-1.log"], drained
        assert not rt.running(head, place, server) and rt.running(head, front, door), "the front was not drained"
        assert rt.set_aside(head, place) and rt.read(head, place, topology.SERVING) == ""
        rt.start(head, rt.start_spec(head, place, gpus=False))  # 04's new place: no server stands in it
        assert rt.read(head, place, topology.SERVING) == "" and rt.running(head, front, door)
        assert rt.bring_back(head, place) and rt.read(head, place, topology.SERVING) == '{"run": "r1"}'
    finally:
        for p in (place, front):
            rt.stop(head, p)
