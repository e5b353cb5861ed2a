"""Injection and bad input against the lab: hostile values reach real nodes (SSH, Docker) as data, never as
shell; the stages run with the hostile values the schema allows; no /tmp/pwned* appears on any node or here;
a node whose host key does not match known_hosts stops `sparkbook run` before any command runs."""
from __future__ import annotations

import glob
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from sparkbook.core.cluster.nodes import Cluster, NodeError
from sparkbook.core.cluster.nodestate import DEFAULT_ROOT, LOCK
from sparkbook.core.cluster.runtime import Place
from sparkbook.core.cluster.runtimes import runtime_for
from sparkbook.core.values.params import load_params
from sparkbook.runbook import driver
from sparkbook.runbook.driver import RunOptions

pytestmark = pytest.mark.lab
HOSTILE = ["; touch /tmp/pwned-semi", "$(touch /tmp/pwned-subst)", "`touch /tmp/pwned-tick`",
           "| touch /tmp/pwned-pipe", "&& touch /tmp/pwned-and", "x\ntouch /tmp/pwned-nl",
           "a' ; touch /tmp/pwned-q ; '", '"; touch /tmp/pwned-dq; "']
ALLOWED = "x' \"y\" {z} [w] touch /tmp/pwned-allowed"  # what the schema lets through in an env value
BASE_IMAGE = "sparkbook-lab/base:bookworm"  # on every lab node
_PRINT_ENV = 'printf "%s\\0"' + "".join(f' "$V{i}"' for i in range(len(HOSTILE)))


def _pwned(node_shells) -> dict[str, list[str]]:
    found = {"host": glob.glob("/tmp/pwned*")}
    for name, shell in node_shells.items():
        found[name] = shell.run("ls -d /tmp/pwned* 2>/dev/null", check=False)[1].split()
    return {k: v for k, v in found.items() if v}


@pytest.fixture(scope="module")
def params_file(lab) -> Path:
    import sparkbook.lab as sblab
    return sblab.params_file(2)


@pytest.fixture(scope="module")
def cluster(params_file: Path, node_shells):
    assert _pwned(node_shells) == {}, "a /tmp/pwned* is left from before: remove it first"
    c = Cluster(load_params(params_file))
    yield c
    c.close()


def _split(out: str) -> list[str]:
    return out.split("\0")[:-1]


def test_values_reach_every_node_verbatim_over_ssh(cluster) -> None:
    env = {f"V{i}": v for i, v in enumerate(HOSTILE)}
    for node in cluster:
        assert _split(node.run(["printf", "%s\\0", *HOSTILE], check=True).stdout) == HOSTILE, node.name
        assert _split(node.run(["sh", "-c", _PRINT_ENV], env=env, check=True).stdout) == HOSTILE, node.name


def test_values_reach_containers_verbatim(cluster) -> None:
    """Through the Docker runtime's verbs: a one-off container, a long-lived place (its env), exec and spawn."""
    runtime = runtime_for(cluster.params)
    env = {f"V{i}": v for i, v in enumerate(HOSTILE)}
    for node in cluster:
        one_off = runtime.one_off(node, BASE_IMAGE, ["sh", "-c", _PRINT_ENV], env=env, timeout=60)
        assert _split(one_off.stdout) == HOSTILE, (node.name, one_off.stderr)
        place = Place(node.name, "sparkbook-injection-test", BASE_IMAGE, env)
        runtime.start(node, runtime.start_spec(node, place, gpus=False))
        try:
            assert _split(runtime.exec(node, place, ["sh", "-c", _PRINT_ENV]).stdout) == HOSTILE
            assert _split(runtime.exec(node, place, ["printf", "%s\\0", *HOSTILE]).stdout) == HOSTILE
            spawned = runtime.spawn(node, place, ["printf", "%s\\0", *HOSTILE], "/tmp/injection/out.log")
            end = time.monotonic() + 30
            while runtime.running(node, place, spawned) and time.monotonic() < end:
                time.sleep(0.5)
            assert _split(runtime.read(node, place, "/tmp/injection/out.log")) == HOSTILE
            assert runtime.exec(node, place, ["sh", "-c", "ls /tmp/pwned* 2>/dev/null"]).stdout == ""
        finally:
            runtime.stop(node, place)


def test_stages_run_with_the_hostile_values_the_schema_allows(params_file: Path, tmp_path: Path,
                                                              node_shells) -> None:
    """01 (cleanup plan) and 02 (diagnosis, which probes the installed image with runtime.env) on the lab,
    with quotes, braces and a `touch` in an environment value and in the cleanup allow-list."""
    data = yaml.safe_load(params_file.read_text())
    data["runtime"]["env"]["SPARKBOOK_INJECTION"] = ALLOWED
    data["cleanup"]["containers"] = ["old-*", "[o]ld-prox?"]
    hostile = tmp_path / "hostile.yaml"
    hostile.write_text(yaml.safe_dump(data, sort_keys=False))
    for stage in ("01", "02"):
        run_dir, manifest = driver.execute(hostile, RunOptions(out_root=tmp_path / "out", only=stage), say=print)
        ran = [nb for nb in manifest.notebooks if nb.name.startswith(stage)][0]
        assert ran.status == "ok", ran.exception
    assert _pwned(node_shells) == {}


def test_host_key_mismatch_is_refused_naming_the_node_before_any_command(params_file: Path, tmp_path: Path,
                                                                          node_shells) -> None:
    params = load_params(params_file)
    lines = Path(params.ssh.known_hosts).read_text().splitlines()
    keys = {line.split()[0]: line.split(None, 1)[1] for line in lines if line.strip()}
    head, worker = params.head, params.workers[0]
    known_hosts = tmp_path / "known_hosts"
    known_hosts.write_text(f"{head.host} {keys[head.host]}\n{worker.host} {keys[head.host]}\n")  # head's key for both
    data = yaml.safe_load(params_file.read_text())
    data["ssh"]["known_hosts"] = str(known_hosts)
    bad = tmp_path / "wrong-key.yaml"
    bad.write_text(yaml.safe_dump(data, sort_keys=False))
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "sparkbook.cli", "run", str(bad), "--outputs", str(tmp_path / "o")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    for text in (worker.name, str(known_hosts), "ssh.known_hosts", "does not match", "Nothing ran"):
        assert text in proc.stderr, (text, proc.stderr)
    assert f"{head.name}:" not in proc.stderr, "only the worker is named"
    assert not (tmp_path / "o").exists(), "no run dir"
    lock = f"/root/{DEFAULT_ROOT}/{head.name}/{LOCK}"  # in the head's state dir (root's ~/.sparkbook/NODE)
    assert node_shells[head.name].run(["test", "-e", lock], check=False)[0] == 1, "no lock taken"
    print(f"host-key mismatch refused in {time.monotonic() - t0:.1f} s: {proc.stderr.strip()}")


def test_no_pwned_file_anywhere(node_shells) -> None:
    assert _pwned(node_shells) == {}


def test_a_container_of_a_node_place_s_name_that_sparkbook_did_not_start_is_never_removed(cluster, params_file) \
        -> None:
    """Issue 43 (read, not run): 04 and `stop` removed containers by name alone. One planted under the name of this
    cluster's node place, without sparkbook's label, is refused and still there."""
    params = load_params(params_file)
    runtime, node = runtime_for(params), cluster.head
    name = f"sparkbook-{params.cluster}-planted-{int(time.time())}"
    node.run(["docker", "run", "-d", "--name", name, "--network", "none", "--entrypoint", "sleep", BASE_IMAGE,
              "60"], check=True, timeout=60)
    try:
        with pytest.raises(NodeError, match="was not started by sparkbook"):
            runtime.stop(node, Place(node.name, name, BASE_IMAGE))
        assert node.run(["docker", "inspect", "-f", "{{.State.Running}}", name], timeout=30).stdout.strip() == "true"
    finally:
        node.run(["docker", "rm", "-f", name], timeout=60)
