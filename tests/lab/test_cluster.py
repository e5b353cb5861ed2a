"""The lab cluster's acceptance checks (run as root; the session fixture brings the lab up).

Order matters: the checks on the 2-node lab come first; then the Ray check; then the tests that take
the lab down (down/up comparison, 4 and 8 nodes), each of which leaves the 2-node lab up again.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import time
import urllib.request

import pytest
import yaml

import sparkbook.lab as sblab
from sparkbook import cli
from sparkbook.core.values.params import load_params
from sparkbook.lab import cluster, deployment

pytestmark = pytest.mark.lab

OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def http_get(url: str, timeout: float = 10) -> tuple[int, bytes]:
    with OPENER.open(url, timeout=timeout) as r:
        return r.status, r.read()


@pytest.fixture(scope="module")
def initial(lab, lab_progress):
    """The lab in its initial state (old deployment running, workers without vLLM images): what a
    previous runbook run left is removed first (reset)."""
    return sblab.reset(lab_progress)


def test_layout_matches_params():
    """params/lab.yaml (the authority on names and addresses) and the default lab agree."""
    if cluster.LAB_ID != 0:
        pytest.skip("SPARKBOOK_LAB_ID set: a second lab, described by params_file(), not params/lab.yaml")
    p = yaml.safe_load(sblab.REPO_PARAMS.read_text())
    specs = cluster.lab_nodes(len(p["nodes"]))
    assert [(n["name"], n["role"], n["host"], n["fabric_ip"], n["fabric_netdev"]) for n in p["nodes"]] == \
        [(s.name, s.role, s.ip, s.ip, cluster.NODE_NETDEV) for s in specs]
    if cluster.lab_home() == sblab.DEFAULT_LAB_HOME:
        assert p["ssh"]["key_file"] == str(cluster.key_file())
        assert p["ssh"]["known_hosts"] == str(cluster.known_hosts_file())
    assert p["model"]["cache_dir"] == cluster.NODE_MOUNTS["models"]


def test_params_file_for_other_sizes():
    for n in (1, 4, 8):
        p = yaml.safe_load(sblab.params_file(n).read_text())
        assert [x["host"] for x in p["nodes"]] == [f"{cluster.NODE_IP_BASE}{10 + i}" for i in range(n)]
        assert [x["role"] for x in p["nodes"]] == ["head"] + ["worker"] * (n - 1)
        assert set(p["serve"]["node_env"]) <= {x["name"] for x in p["nodes"]}
        assert p["ssh"]["known_hosts"] == str(cluster.known_hosts_file())
        assert load_params(sblab.params_file(n)).serve.tensor_parallel_size <= n


def test_ssh_strict_sees_own_ip_and_hostname(lab, node_shells):
    for n in lab.nodes:
        sh = node_shells[n.name]
        _, out, _ = sh.run("hostname; ip -o -4 addr show dev eth0; cat /etc/hostname")
        lines = out.split("\n")
        print(f"{n.name}: {out.strip()!r}")
        assert lines[0] == n.name
        assert f"inet {n.ip}/24" in lines[1]
        assert lines[2] == n.name


def test_ssh_rejects_unknown_host_key(lab, tmp_path, lab_connect):
    """Strictness is real: with a known_hosts that lacks the node, paramiko refuses to connect."""
    import paramiko
    other = tmp_path / "known_hosts"
    lines = cluster.known_hosts_file().read_text().splitlines()
    other.write_text("\n".join(line for line in lines if not line.startswith(lab.nodes[0].ip + " ")) + "\n")
    with pytest.raises(paramiko.SSHException):
        lab_connect(lab.nodes[0].ip, known_hosts=str(other), key_file=lab.key_file)


def test_pid_namespace_per_node(initial, lab, node_shells):
    """ps on a node shows only that node: its init is PID 1, and no process of another node appears."""
    seen = {}
    for n in lab.nodes:
        _, out, _ = node_shells[n.name].run(["ps", "-e", "-o", "pid=,args="])
        seen[n.name] = out
        first = out.strip().splitlines()[0].split(None, 1)
        assert first[0] == "1" and "node-init" in first[1] and f"{cluster.nodes_dir()}/{n.name}/" in first[1], out
    for n in lab.nodes:
        for other in lab.nodes:
            if other.name != n.name:
                assert f"{cluster.nodes_dir()}/{other.name}/" not in seen[n.name]
    assert "old_service.py embeddings" in seen["lab-1"] and "old_service.py embeddings" not in seen["lab-0"]
    assert "vllm serve" in seen["lab-0"] and "vllm serve" not in seen["lab-1"]


def test_own_shm_and_run_per_node(lab, node_shells):
    marks = {}
    for n in lab.nodes:
        sh = node_shells[n.name]
        sh.run(f"echo {n.name} > /dev/shm/sbk-test-mark")
        marks[n.name] = sh
    for n in lab.nodes:
        _, out, _ = marks[n.name].run("cat /dev/shm/sbk-test-mark; rm /dev/shm/sbk-test-mark; ls /run/docker.sock")
        assert out.split("\n")[0] == n.name
    assert not os.path.exists("/dev/shm/sbk-test-mark")


def test_docker_per_node(initial, lab, node_shells):
    """`ssh node docker ...` reaches that node's own daemon: its own images and containers only."""
    p = yaml.safe_load(sblab.REPO_PARAMS.read_text())
    vllm_images = set(p["runtime"]["images"])
    got = {}
    for n in lab.nodes:
        sh = node_shells[n.name]
        _, info, _ = sh.run(["docker", "info", "--format", "{{.Name}} {{.DockerRootDir}}"])
        assert info.split() == [n.name, "/var/lib/docker"]
        _, imgs, _ = sh.run(["docker", "images", "--format", "{{.Repository}}:{{.Tag}}"])
        _, ctrs, _ = sh.run(["docker", "ps", "-a", "--format", "{{.Names}}"])
        got[n.name] = (set(imgs.split()), set(ctrs.split()))
        print(n.name, sorted(got[n.name][0]), sorted(got[n.name][1]))
    head_imgs, head_ctrs = got["lab-0"]
    work_imgs, work_ctrs = got["lab-1"]
    assert vllm_images <= head_imgs
    assert not (vllm_images & work_imgs), "workers start without vLLM images (the runbook distributes them)"
    assert head_ctrs == {"old-vllm", "old-proxy", deployment.MANAGED_NAME}
    assert work_ctrs == {"old-embeddings", "old-reranker", deployment.MANAGED_NAME}
    # the same daemons as the host sees them through each node's socket
    for n in lab.nodes:
        spec = next(s for s in cluster.lab_nodes(len(lab.nodes)) if s.name == n.name)
        assert set(sblab.node_images(spec)) == got[n.name][0]


def test_worker_host_network_reaches_head_only_on_lab(lab, node_shells):
    """A --network host container on the worker reaches the head's IP; the worker has no other route."""
    p = yaml.safe_load(sblab.params_file(2).read_text())
    head = lab.nodes[0]
    base = [x for x in lab.nodes[1].images if x.startswith("sparkbook-lab/base")][0]
    probe = ("import socket,sys\n"
             "s=socket.create_connection((sys.argv[1],22),5); print(s.recv(8).decode().strip()); "
             "print(s.getsockname()[0])")
    _, out, _ = node_shells["lab-1"].run(["docker", "run", "--rm", "--network", "host", base, "python3", "-c",
                                          probe, head.ip])
    banner, src = out.split()
    assert banner.startswith("SSH-2.0") and src == lab.nodes[1].ip
    _, routes, _ = node_shells["lab-1"].run(["ip", "-4", "route"])
    assert "default" not in routes and routes.strip().startswith(f"{cluster.NODE_IP_BASE}0/24 dev eth0")
    assert p["nodes"][0]["host"] == head.ip


def test_old_deployment(initial, lab, node_shells, lab_progress):
    """The old deployment answers, holds memory, and is labelled for the cleanup stage."""
    waited = sblab.wait_old_deployment(progress=lab_progress)
    lab_progress(f"old deployment answers: {waited}")
    lab = sblab.status()
    p = yaml.safe_load(sblab.REPO_PARAMS.read_text())
    head, worker = lab.nodes[0].ip, lab.nodes[1].ip
    code, body = http_get(f"http://{head}:8000/v1/models")
    assert code == 200 and json.loads(body)["data"][0]["id"] == "qwen3-tiny"
    code, body = http_get(f"http://{head}:8080/v1/models")  # through old-proxy
    assert code == 200 and json.loads(body)["data"][0]["id"] == "qwen3-tiny"
    req = urllib.request.Request(f"http://{head}:8080/v1/completions", method="POST",
                                 headers={"Content-Type": "application/json"},
                                 data=json.dumps({"model": "qwen3-tiny", "prompt": "hello", "max_tokens": 4}).encode())
    with OPENER.open(req, timeout=120) as r:
        assert r.status == 200 and json.loads(r.read())["choices"]
    for port, role in ((8001, "embeddings"), (8002, "reranker")):
        code, body = http_get(f"http://{worker}:{port}/health")
        assert code == 200 and json.loads(body)["role"] == role
    by_name = {c["name"]: (n, c) for n in lab.nodes for c in n.containers}
    for name in ("old-vllm", "old-proxy", "old-embeddings", "old-reranker"):
        node, c = by_name[name]
        assert c["labels"][deployment.DEPLOYMENT_LABEL] == "old"
        assert any(__import__("fnmatch").fnmatchcase(name, pat) for pat in p["cleanup"]["containers"])
    assert by_name["old-proxy"][1]["labels"][deployment.DEPENDS_LABEL] == "old-vllm"
    assert by_name["old-vllm"][1]["image"] == p["runtime"]["installed_image"]
    # memory held (docker stats over ssh on the worker)
    _, out, _ = node_shells["lab-1"].run(["docker", "stats", "--no-stream", "--format", "{{.Name}} {{.MemUsage}}"])
    held = dict(line.split(None, 1) for line in out.strip().splitlines())
    for name in ("old-embeddings", "old-reranker"):  # the manager's vllm_node is a small service on purpose
        assert float(re.match(r"([\d.]+)MiB", held[name]).group(1)) >= 250, (name, held[name])
    _, out, _ = node_shells["lab-0"].run(["docker", "inspect", "--format", "{{.HostConfig.CpusetCpus}} "
                                          "{{.HostConfig.RestartPolicy.Name}}", "old-vllm"])
    assert out.split() == ["0", "no"]


def test_models_on_every_node(lab, node_shells):
    for n in lab.nodes:
        _, out, _ = node_shells[n.name].run("ls /srv/models; cat /srv/models/hyv4-tiny/config.json")
        names = out.split("\n")[:2]
        assert "hyv4-tiny" in names and "qwen3-tiny" in names
        assert "HYV4ForCausalLM" in out


def test_status(initial, lab):
    st = sblab.status()
    print(st)
    assert st.up and st.healthy and [n.name for n in st.nodes] == ["lab-0", "lab-1"]
    for n in st.nodes:
        assert n.sshd and n.dockerd and n.hostname == n.name and n.images and n.containers
    text = str(st)
    for word in ("lab-0", st.nodes[0].ip, "lab-1", st.nodes[1].ip, "sshd=up", "dockerd=up", "old-vllm"):
        assert word in text


def test_up_on_up_lab_changes_nothing(lab):
    before = sblab.status()
    t0 = time.monotonic()
    st = sblab.up(2)
    took = time.monotonic() - t0
    assert st.actions == [] and took < 20
    assert [n.init_pid for n in st.nodes] == [n.init_pid for n in before.nodes]
    assert [[(c["name"], c["state"]) for c in n.containers] for n in st.nodes] == \
        [[(c["name"], c["state"]) for c in n.containers] for n in before.nodes]


def test_lab_reset_on_the_command_line_takes_a_workers_extra_image_away(lab, node_shells):
    """`sparkbook lab reset` leaves a worker with its initial images only: an extra tag there goes (a runbook's
    copy would be one; Ray across the nodes in containers is what 04's tests form, test_04_05 and test_04_fabric)."""
    from sparkbook.lab import imagebuild
    extra = "sparkbook-lab/extra:reset-test"
    node_shells["lab-1"].run(["docker", "tag", imagebuild.BASE, extra])
    assert extra in sblab.status().nodes[1].images
    assert cli.main(["lab", "reset"]) == 0
    assert extra not in sblab.status().nodes[1].images and imagebuild.BASE in sblab.status().nodes[1].images


# --------------------------------------------------------------------------------------------------
# Tests that take the lab down. Each leaves the 2-node lab up when it ends.


def _lab_namespaces() -> set[str]:
    """The net and pid namespaces of this lab (its netns and its node inits), as `net:[inode]` strings."""
    out = set()
    for name in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split("\n"):
        if name.startswith(cluster.NETNS_PREFIX):
            out.add(f"net:[{os.stat('/var/run/netns/' + name.split()[0]).st_ino}]")
    for node in cluster.load_state().get("nodes", {}).values():
        try:
            out.add(os.readlink(f"/proc/{node['init_pid']}/ns/pid"))
        except OSError:
            pass
    return out


def _snapshot(lab_ns: set[str] = frozenset()) -> dict[str, set]:
    """Processes (in one of the lab's namespaces, or naming its node dirs), network namespaces, links,
    mounts and firewall rules of this machine."""
    procs = set()
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            cmd = open(f"/proc/{d}/cmdline", "rb").read().replace(b"\0", b" ").decode(errors="replace").strip()
            ns = {os.readlink(f"/proc/{d}/ns/pid"), os.readlink(f"/proc/{d}/ns/net")}
        except OSError:
            continue
        if cmd and (ns & lab_ns or f"{cluster.nodes_dir()}/" in cmd):
            procs.add(f"{d} {cmd[:100]}")
    run = lambda *c: subprocess.run(c, capture_output=True, text=True, timeout=30).stdout  # noqa: E731
    links = {line.split(":")[1].strip() for line in run("ip", "-o", "link").splitlines()}
    return {
        "processes": procs,
        "netns": set(run("ip", "netns", "list").splitlines()),
        "links": links,
        "mounts": set(open("/proc/self/mountinfo").read().splitlines()),
        "rules": {line for line in run("iptables-save").splitlines() if line.startswith("-A")},
    }


def _leftovers(before: dict, during: dict, after: dict) -> dict:
    """What appeared with the lab and is still there (robust to unrelated churn on a shared machine)."""
    return {k: sorted((after[k] - before[k]) & during[k]) for k in before}


def _check_nodes(st, n: int, connect, shell_cls):
    assert st.healthy and len(st.nodes) == n, str(st)
    for node in st.nodes:
        c = connect(node.ip, known_hosts=st.known_hosts, key_file=st.key_file)
        try:
            sh = shell_cls(node.name, node.ip, c)
            _, out, _ = sh.run("hostname; hostname -I; docker info --format '{{.Name}}'")
            assert out.split() == [node.name, node.ip, node.name]
        finally:
            c.close()


def test_down_leaves_nothing_and_warm_up(lab, lab_progress, lab_connect, node_shell_cls):
    sblab.down(lab_progress)
    sblab.down(lab_progress)  # safe twice
    before = _snapshot()
    t0 = time.monotonic()
    st = sblab.up(2, lab_progress)
    warm = time.monotonic() - t0
    lab_progress(f"warm lab up (2 nodes): {warm:.1f}s")
    _check_nodes(st, 2, lab_connect, node_shell_cls)
    lab_ns = _lab_namespaces()
    during = _snapshot(lab_ns)
    assert during["netns"] - before["netns"] and during["processes"] - before["processes"]
    lab_progress(f"during: {len(during['processes'])} lab processes, namespaces {sorted(lab_ns)}")
    t0 = time.monotonic()
    sblab.down(lab_progress)
    lab_progress(f"lab down: {time.monotonic() - t0:.1f}s")
    time.sleep(1)
    after = _snapshot(lab_ns)
    left = _leftovers(before, during, after)
    assert not any(left.values()), left
    assert not cluster.state_file().exists()
    st = sblab.up(2, lab_progress)
    _check_nodes(st, 2, lab_connect, node_shell_cls)
    assert warm <= 60, f"warm up took {warm:.0f}s (target 60s)"


@pytest.mark.slow  # 59 s in make test; there test_node_replies.py brings up 8 bare nodes (lab 1)
@pytest.mark.parametrize("n", [4, 8])
def test_more_nodes(n, lab, lab_progress, lab_connect, node_shell_cls):
    sblab.down(lab_progress)
    try:
        t0 = time.monotonic()
        st = sblab.up(n, lab_progress)
        lab_progress(f"lab up --nodes {n}: {time.monotonic() - t0:.1f}s")
        print(st)
        _check_nodes(st, n, lab_connect, node_shell_cls)
        assert {c["name"] for c in st.nodes[1].containers} == {"old-embeddings", "old-reranker",
                                                                deployment.MANAGED_NAME}
        assert all(not x.containers for x in st.nodes[2:])
        with pytest.raises(sblab.LabError):
            sblab.up(2)  # a lab of another size is up: refuse, change nothing
    finally:
        sblab.down(lab_progress)
        st = sblab.up(2, lab_progress)
    _check_nodes(st, 2, lab_connect, node_shell_cls)
