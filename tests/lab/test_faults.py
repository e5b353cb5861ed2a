"""The fault-injection suite (issue 7): ten faults, injected one at a time against the real lab, each through
the sparkbook calls the notebooks make. For each: detected, the node and cause named, within 60 s of the
injection, the call returned (a hard limit fails a hang), nothing the step started left running on any node
(checked over the lab's SSH), and the fault undone in a `finally`.

Order shares work: faults before 04 need no cluster (the worker's copy of the chosen image runs meanwhile);
the Ray cluster is formed once for the port, the benchmark and the worker faults; killing a worker container
breaks it, so it is formed again for the Ray-head fault, and its containers once more for the held Ray port.
The table (fault, time to detection, message, left running) goes to $SPARKBOOK_FAULT_REPORT (else the test's tmp
dir) as faults.json + faults.md, and is printed.
"""
from __future__ import annotations

import os
import socket
import time
from pathlib import Path

import faults
import pytest
import yaml
from faults import Row

import sparkbook.lab as sblab
from sparkbook.core.cluster import topology
from sparkbook.core.values import evidence
from sparkbook.runbook.session import open_run
from sparkbook.stages.bench import sweep as bench
from sparkbook.stages.bench.client import CompletionsServer
from sparkbook.stages.cleanup import inventory
from sparkbook.stages.diagnose import checks
from sparkbook.stages.images import distribute
from sparkbook.stages.raycluster import containers as node_containers
from sparkbook.stages.raycluster import formation
from sparkbook.stages.serve import bringup, commands, launch

pytestmark = pytest.mark.lab
IMAGE = "sparkbook-lab/vllm-cpu:0.32.0"  # what 03 chooses for the lab model
PORT = 8200
DETECT_S = 60
HANG_S = 240  # a call still running after this is a hang


# --- the lab, params, the watch and the table ------------------------------------------------------
@pytest.fixture(scope="module")
def nodes(lab):
    return {n.name: n for n in sblab.status().nodes}


@pytest.fixture(scope="module")
def params_file(lab, tmp_path_factory) -> Path:
    """The active lab's params, serving on PORT, with a short benchmark."""
    data = yaml.safe_load(sblab.params_file(2).read_text())
    data["serve"]["port"] = PORT
    data["benchmark"].update(concurrency=[1, 4], num_prompts=24, warmup_requests=1, output_len=64)
    path = tmp_path_factory.mktemp("faults-params") / "lab.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


@pytest.fixture(scope="module")
def runs(params_file, tmp_path_factory):
    """open_run(stage) -> a fresh Run (own SSH connections); every one is closed at the end."""
    opened = []

    def make(stage: str):
        opened.append(open_run(params_file, tmp_path_factory.mktemp(stage), stage=stage))
        return opened[-1]

    yield make
    for run in opened:
        run.close()


@pytest.fixture(scope="module")
def watch(node_shells) -> faults.Watch:
    return faults.Watch(node_shells)


@pytest.fixture(scope="module")
def at_start(watch) -> faults.Seen:
    return watch.seen()


@pytest.fixture(scope="module")
def report(request, tmp_path_factory):
    folder = Path(os.environ.get("SPARKBOOK_FAULT_REPORT") or tmp_path_factory.mktemp("fault-report"))
    table = faults.Report(folder)
    yield table
    with request.config.pluginmanager.getplugin("capturemanager").global_and_fixture_disabled():
        print(f"\nfault table ({folder}/faults.md):\n{table.markdown()}\n")


def _check(report, row: Row, must_name: tuple[str, ...]) -> None:
    """Record the row, then: detected in time, every part named, nothing left running."""
    report.add(row)
    print(row)
    assert row.detected_s < DETECT_S, f"{row.fault}: detected after {row.detected_s:.1f} s"
    for part in must_name:
        assert part in row.message, f"{row.fault}: {part!r} not in {row.message!r}"
    assert not row.left_running, f"{row.fault}: left running: {row.left_running}"


def _holders(nodes, ref: str) -> dict[str, bool]:
    specs = {s.name: s for s in sblab.cluster.lab_nodes(len(nodes))}
    return {name: ref in sblab.node_images(specs[name]) for name in nodes}


# --- faults before 04 ------------------------------------------------------------------------------
def test_image_missing_on_worker_and_copy_cannot_reach_it(nodes, runs, watch, at_start, report):
    run = runs("03-copy-unreachable")
    missing = next((ref for ref in [IMAGE, *run.params.runtime.images]
                    if (held := _holders(nodes, ref))["lab-0"] and not held["lab-1"]), None)
    assert missing, "every lab image is on lab-1 already: nothing to copy"
    before = watch.seen()
    with faults.firewall(nodes["lab-1"].netns, ["INPUT", "-p", "tcp", "--dport", "22", "--syn", "-j", "DROP"]):
        t0 = time.monotonic()
        call = faults.bounded(lambda: distribute.distribute(run.context(), missing), HANG_S)
    message = str(call.error) if call.error else call.value.message
    assert call.error or not call.value.verified, "the copy claims success to a node it cannot reach"
    assert not _holders(nodes, missing)["lab-1"], "lab-1 holds a half-copied image"
    _check(report, Row("chosen image missing on the worker, the copy cannot reach it", "lab-1",
                       call.returned_at - t0, f"{missing}: {message}", watch.left(before), "distribute.distribute"),
           ("lab-1", "cannot reach"))


@pytest.fixture(scope="module")
def copy_started(nodes, runs, watch):
    """The chosen image to every node (03's copy), in the background while the next faults run; returns once
    its `docker save` and `docker load` run, so that the faults' snapshots count them as already there."""
    if all(_holders(nodes, IMAGE).values()):
        return None
    run = runs("03-distribute")
    started = faults.start(lambda: distribute.distribute(run.context(), IMAGE))
    end = time.monotonic() + 120
    while not started[1].done() and time.monotonic() < end:
        seen = watch.seen().processes
        if any("docker save" in a for a in seen["lab-0"].values()) and \
                any("docker load" in a for a in seen["lab-1"].values()):
            break
        time.sleep(2)
    return started


def test_worker_sshd_stopped(nodes, runs, copy_started, watch, report):
    run = runs("01-02-sshd-stopped")
    before = watch.seen()
    with faults.stopped(faults.daemon_pid(nodes["lab-1"].init_pid, "sshd")):
        t0 = time.monotonic()
        inv = faults.bounded(lambda: inventory.inventory_all(run.context()), HANG_S)  # 01
        facts = faults.bounded(lambda: checks.facts_all(run.context()), HANG_S)  # 02
    found = [f.text for f in evidence.unreachable(inv.value) + evidence.unreachable(facts.value)]
    assert inv.value["lab-0"].ok and facts.value["lab-0"].ok
    assert len(found) == 2 and all(t.startswith("lab-1: ") for t in found), found
    assert inv.value["lab-1"].duration_s < 30 and facts.value["lab-1"].duration_s < 30, "issue 4: named within 30 s"
    _check(report, Row("a worker's sshd stopped", "lab-1", inv.returned_at - t0, " | ".join(found),
                       watch.left(before), "cleanup.inventory_all (01), then checks.facts_all (02)"), ("lab-1",))


def test_fabric_cut_between_head_and_worker(nodes, runs, copy_started, watch, report):
    run = runs("02-fabric-cut")
    head_ip = nodes["lab-0"].ip
    before = watch.seen()
    with faults.firewall(nodes["lab-1"].netns, ["OUTPUT", "-d", head_ip, "-j", "DROP"],
                         ["INPUT", "-s", head_ip, "-j", "DROP"]):
        t0 = time.monotonic()
        call = faults.bounded(lambda: checks.links_all(run.context()), HANG_S)
    found = [f.text for f in checks.link_findings(call.value, run.params)]
    cut = [t for t in found if t.startswith("lab-1 -> lab-0 (head)") and "cannot reach lab-0" in t]
    assert cut, found
    _check(report, Row("fabric link between head and worker cut", "lab-1", call.returned_at - t0, " | ".join(found),
                       watch.left(before), "checks.links_all + link_findings"), ("lab-1", "lab-0"))


def test_remote_command_that_never_returns_meets_its_timeout(runs, copy_started, watch, report):
    run = runs("02-hung-read")
    model_dir = Path(run.params.model.path).relative_to(run.params.model.cache_dir)
    worker = next(s for s in sblab.cluster.lab_nodes(2) if s.name == "lab-1")
    config = worker.dir / "models" / model_dir / "config.json"  # /srv/models inside the node
    before = watch.seen()
    with faults.fifo_instead(config):
        t0 = time.monotonic()
        call = faults.bounded(lambda: checks.model_files_all(run.context()), HANG_S)
    files = call.value
    found = [f.text for f in checks.model_findings(files)]
    assert files["lab-0"].ok and files["lab-0"].value.config, "the head's model files were read"
    assert any(t.startswith("lab-1: ") and "did not return within" in t for t in found), found
    _check(report, Row("a remote command that never returns meets its timeout", "lab-1", call.returned_at - t0,
                       " | ".join(found), watch.left(before), "checks.model_files_all + model_findings"),
           ("lab-1", "did not return within"))


@pytest.fixture(scope="module")
def copied(copy_started, nodes):
    """Waits for the background copy; every node holds the chosen image."""
    if copy_started is not None:
        call = faults.finish(copy_started, 1200)
        assert call.error is None and call.value.verified, call.error or call.value.message
    assert all(_holders(nodes, IMAGE).values())


def test_worker_dockerd_stopped(nodes, runs, copied, watch, report):
    run = runs("04-dockerd-stopped")
    ctx = run.context(IMAGE)
    before = watch.seen()
    try:
        with faults.stopped(faults.daemon_pid(nodes["lab-1"].init_pid, "dockerd")):
            t0 = time.monotonic()
            call = faults.bounded(lambda: node_containers.start_containers(ctx, node_containers.start_specs(ctx)),
                                  HANG_S)
    finally:
        ctx.runtime.close()
    assert isinstance(call.error, node_containers.RayStageError), call.error or call.value
    _check(report, Row("a worker's dockerd stopped", "lab-1", call.returned_at - t0, str(call.error),
                       watch.left(before), "raycluster.start_containers"), ("lab-1", "Docker daemon does not answer"))


# --- faults after 04 (one Ray cluster shared) --------------------------------------------------------
def _form(ctx) -> None:
    """04 as the notebook runs it: containers, Ray, the join wait, the gate."""
    containers = node_containers.start_containers(ctx, node_containers.start_specs(ctx))
    started = formation.start_ray(ctx)
    join = formation.wait_for_join(ctx, containers, started)
    formation.check(formation.gate(ctx, containers, join))


@pytest.fixture(scope="module")
def cluster(copied, runs):
    """(run, ctx, places, plan): the Ray cluster formed as 04 does; 05's plan; containers removed after."""
    run = runs("04-05-06")
    ctx = run.context(IMAGE)
    _form(ctx)
    platform = commands.detect_platform(ctx)
    executor, _ = commands.choose_executor(ctx, platform)
    yield run, ctx, ctx.places, commands.plan(ctx, executor)
    node_containers.stop(ctx)
    ctx.runtime.close()


def _in(shells, where, node: str, script: str, *args: str, check: bool = True, detach: bool = False):
    """A shell script in the node's sparkbook container, through the lab's SSH and the node's docker CLI
    (the injection goes around sparkbook's own connections)."""
    return shells[node].run(["docker", "exec", *(["-d"] if detach else []), where[node].name, "sh", "-c", script,
                             *args], timeout=60, check=check)


# the process group of a spawned process, from its pid file ("PID START": the runbook's identity record)
KILL_GROUP = 'read -r p _ <"$0" && kill -KILL -"$p"'


def test_serving_port_taken_on_the_head(nodes, cluster, node_shells, watch, report):
    run, ctx, where, plan = cluster
    ip, pid_file = nodes["lab-0"].ip, "/tmp/port-holder.pid"
    before = watch.seen()
    _in(node_shells, where, "lab-0", 'echo $$ >"$0"; exec python3 -m http.server "$1" --bind "$2"', pid_file,
        str(PORT), ip, detach=True)
    try:
        _in(node_shells, where, "lab-0", 'for i in $(seq 30); do python3 -c "import socket, sys; '
            'socket.create_connection((sys.argv[1], int(sys.argv[2])), 1)" "$0" "$1" && exit 0; sleep 1; done; exit 1',
            ip, str(PORT))
        t0 = time.monotonic()
        call = faults.bounded(lambda: bringup.bring_up(ctx, plan), HANG_S)
    finally:
        _in(node_shells, where, "lab-0", 'kill "$(cat "$0")"', pid_file)
    assert isinstance(call.error, commands.ServeError), call.error or call.value.table()
    _check(report, Row("serving port already taken on the head", "lab-0", call.returned_at - t0, str(call.error),
                       watch.left(before), "serve.bring_up"), ("address already in use on lab-0", f":{PORT}"))


def test_vllm_killed_while_the_benchmark_runs(nodes, cluster, node_shells, watch, report):
    run, ctx, where, plan = cluster
    before = watch.seen()
    up = bringup.bring_up(ctx, plan)
    assert up.ok, bringup.failure_message(up)
    try:
        target = CompletionsServer(plan.base_url, plan.model)
        sweep = faults.start(lambda: bench.run_sweep(target, run.params.benchmark))
        time.sleep(8)  # into the first point
        _in(node_shells, where, "lab-0", KILL_GROUP, up.launched.spawned["lab-0"].pid_file)
        t0 = time.monotonic()
        call = faults.finish(sweep, HANG_S)
        left = watch.left(before)
    finally:
        launch.stop_serving(ctx, up.launched)
    assert isinstance(call.error, bench.ServerGone), call.error or "the sweep finished against a killed server"
    _check(report, Row("vLLM server killed while the benchmark runs", "lab-0", call.returned_at - t0,
                       str(call.error), left, "bench.run_sweep"), (f"{nodes['lab-0'].ip}:{PORT}", "stopped answering"))


def test_worker_container_killed_while_vllm_starts(cluster, node_shells, watch, report):
    run, ctx, where, plan = cluster
    before = watch.seen()
    bring_up = faults.start(lambda: bringup.bring_up(ctx, plan))
    end = time.monotonic() + 120
    while _in(node_shells, where, "lab-1", 'read -r p _ <"$0" && kill -0 "$p"', launch.log_path(1) + ".pid", check=False)[0]:
        assert time.monotonic() < end, "lab-1's vllm serve never started"
        time.sleep(1)
    time.sleep(3)
    node_shells["lab-1"].run(["docker", "kill", where["lab-1"].name], timeout=60)
    t0 = time.monotonic()
    call = faults.finish(bring_up, HANG_S)
    up = call.value
    assert up is not None and not up.ok, call.error or up.table()
    d = up.readiness.cause
    # whichever the watcher sees first: the container gone, or the vllm serve process in it gone
    assert (d.cause, d.node) == ("worker died", "lab-1") and any(e in d.evidence for e in ("not running", "exited")), d
    _check(report, Row("worker container killed while vLLM starts", "lab-1", call.returned_at - t0,
                       bringup.failure_message(up), watch.left(before), "serve.bring_up"), ("worker died", "lab-1"))


def test_ray_head_killed_after_the_cluster_formed(cluster, node_shells, watch, report):
    run, ctx, where, plan = cluster
    _form(ctx)  # the worker fault took lab-1's container: 04 again
    before = watch.seen()
    _in(node_shells, where, "lab-0", KILL_GROUP, topology.RAY_LOG + ".pid")
    t0 = time.monotonic()
    call = faults.bounded(lambda: bringup.bring_up(ctx, plan), HANG_S)
    assert isinstance(call.error, commands.ServeError), call.error or call.value.table()
    _check(report, Row("Ray head killed after the cluster formed", "lab-0", call.returned_at - t0, str(call.error),
                       watch.left(before), "serve.bring_up (topology.lost)"), ("lab-0", "Ray head"))


def _answers(ip: str, port: int) -> bool:
    with socket.socket() as probe:
        probe.settimeout(1)
        return probe.connect_ex((ip, port)) == 0


def test_ray_port_held_by_another_cluster_on_the_head(nodes, cluster, node_shells, watch, report):
    """Another cluster's Ray on the same nodes (here a listener on the head's Ray port in a container of another
    name, as a second cluster's head would hold it): 04 refuses before its own Ray head starts and names the port and
    the process, where before the wait took the stranger's answer for its GCS and failed a minute later at the node
    table with "0 bytes received"."""
    run, ctx, where, plan = cluster
    node_containers.stop(ctx)  # this run's own Ray leaves the port
    node_containers.start_containers(ctx, node_containers.start_specs(ctx))
    ip, port, other = nodes["lab-0"].ip, ctx.params.ray.port, "other-cluster-ray-head"
    node_shells["lab-0"].run(["docker", "run", "-d", "--name", other, "--network", "host", "sparkbook-lab/base:bookworm",
                              "python3", "-m", "http.server", str(port), "--bind", ip], timeout=60, check=True)
    try:
        end = time.monotonic() + 30
        while not _answers(ip, port):
            assert time.monotonic() < end, f"the planted listener never answered on {ip}:{port}"
            time.sleep(0.5)
        before = watch.seen()
        t0 = time.monotonic()
        call = faults.bounded(lambda: formation.start_ray(ctx), HANG_S)
        left = watch.left(before)
    finally:
        node_shells["lab-0"].run(["docker", "rm", "-f", other], timeout=60)
    assert isinstance(call.error, node_containers.RayStageError), call.error or call.value
    _check(report, Row("Ray's port held by another cluster on the head", "lab-0", call.returned_at - t0,
                       str(call.error), left, "raycluster.start_ray (04)"),
           ("lab-0", f"{ip}:{port} (ray.port)", '"python3"', "another ray.port"))


def test_nothing_left_after_the_suite(cluster, watch, at_start):
    run, ctx, _, _ = cluster
    node_containers.stop(ctx)
    assert watch.left(at_start) == []
