"""Fixtures for tests that need the lab (a real multi-node cluster on this machine; see sparkbook.lab).

The session fixture ``lab`` brings the default 2-node lab up (cold: builds images; warm: < 60 s) and
LEAVES IT UP at the end, so later test sessions and the stage tests reuse it. Tests that take it down
(test_cluster.py's down/scale tests) bring the 2-node lab up again before they finish.
"""
from __future__ import annotations

import os
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml


def pytest_configure(config):
    config.addinivalue_line("markers", "lab: needs the lab (root; brings it up when it is down)")


def _progress(line: str) -> None:
    print(f"[lab {time.strftime('%H:%M:%S')}] {line}", file=sys.stderr, flush=True)


@pytest.fixture(scope="session")
def lab_progress():
    return _progress


@pytest.fixture(scope="session")
def lab(lab_progress):
    """The 2-node lab, up and in its initial state but for the images a worker holds (a LabStatus). Left up after
    the session."""
    if os.geteuid() != 0:
        pytest.skip("the lab needs root")
    import sparkbook.lab as sblab
    t0 = time.monotonic()
    st = sblab.up(2, progress=lab_progress)
    if not st.actions:  # it was up already, as an earlier session left it (old deployment stopped, runs' containers)
        # the workers keep their images: after `make runbook` test_04_05 finds 0.32.0 on the worker instead of copying
        # 3.3 GB again (test_cluster's reset takes them away, and test_faults copies the whole image back, verified)
        st = sblab.reset(progress=lab_progress, keep_worker_images=True)
    lab_progress(f"lab up took {time.monotonic() - t0:.1f}s; changed: {st.actions or 'nothing'}")
    assert st.healthy, str(st)
    return st


@pytest.fixture(scope="session")
def planted() -> str:
    """A token-shaped secret that the full run holds in HF_TOKEN (named in params.secrets)."""
    return "hf_" + "Pl4nted" * 4


REPO = Path(__file__).resolve().parents[2]


def hf_params(lab_params: Path) -> dict:
    """This lab's params on the path real hardware takes (params/lab-hf.yaml for the default lab): the candidate
    shaped like vLLM's official image (ENTRYPOINT `vllm serve`), the model by hf_id out of a hub cache that is not
    root's and that only the head holds after a reset."""
    data = yaml.safe_load(lab_params.read_text())
    hf = yaml.safe_load((REPO / "params" / "lab-hf.yaml").read_text())
    data["cluster"] = f"{data['cluster']}-hf"
    data["model"] = hf["model"]
    data["runtime"].update(images=hf["runtime"]["images"], env=hf["runtime"]["env"])
    return data


@pytest.fixture(scope="session")
def full_run(lab, lab_progress, planted, tmp_path_factory):
    """The session's one whole run of all six notebooks, confirmed, on the path real hardware takes (hf_params:
    the entrypoint image, the model by hf_id, copied to the worker over the fabric by 03), with a planted secret
    in the environment as HF_TOKEN and as the API key vLLM requires of every /v1 request (serve.api_key_env:
    VLLM_API_KEY, served without a front). test_runbook_lab, test_runbook_offline, test_idempotence and test_lab_ab read it; params/lab.yaml's
    own path (the plain image, the model by path) is `make runbook`'s and nbval's whole run. The old deployment
    (the old vLLM too) answers before 01 inventories it, as the issue's cluster did, so 01 records every port and
    health URL that restore checks. The workers keep their images: the entrypoint image goes to a worker that
    holds the plain 0.32.0 build (test_faults copied it) as the delta of the layers it lacks."""
    import sparkbook.lab as sblab
    from sparkbook.runbook import driver
    from sparkbook.runbook.driver import RunOptions

    sblab.reset(keep_worker_images=True)
    sblab.wait_old_deployment(progress=lab_progress)
    os.environ["HF_TOKEN"] = os.environ["VLLM_API_KEY"] = planted
    data = hf_params(sblab.params_file(2))
    data["secrets"] = ["HF_TOKEN", "VLLM_API_KEY"]
    data["serve"]["api_key_env"] = "VLLM_API_KEY"
    data["serve"]["front"] = "none"  # vLLM asks the key itself here (copies of these params that want the front set
    # serve.front again); the keyed front is test_replicas_lab's
    params = tmp_path_factory.mktemp("params") / "lab-hf.yaml"
    params.write_text(yaml.safe_dump(data, sort_keys=False))
    t0 = time.monotonic()
    try:
        return driver.execute(params, RunOptions(out_root=tmp_path_factory.mktemp("outputs"),
                                                 parameters={"confirm_cleanup": True}), say=print)
    finally:
        del os.environ["HF_TOKEN"], os.environ["VLLM_API_KEY"]
        lab_progress(f"the session's full run took {time.monotonic() - t0:.0f} s")


@dataclass
class NodeShell:
    """A strict-host-key paramiko connection to one lab node; reconnects when the lab was taken down and up
    again since (test_cluster.py does that), with the same strict known_hosts."""
    name: str
    ip: str
    client: object
    known_hosts: str = ""
    key_file: str = ""

    def run(self, cmd, timeout: float = 120, check: bool = True) -> tuple[int, str, str]:
        if not isinstance(cmd, str):
            cmd = shlex.join(cmd)
        import paramiko
        try:
            _, out, err = self.client.exec_command(cmd, timeout=timeout)
        except (paramiko.SSHException, EOFError, OSError):  # the node's sshd of before a lab down/up
            if not self.known_hosts:
                raise
            self.client = connect(self.ip, known_hosts=self.known_hosts, key_file=self.key_file)
            _, out, err = self.client.exec_command(cmd, timeout=timeout)
        o, e = out.read().decode(), err.read().decode()
        rc = out.channel.recv_exit_status()
        if check and rc != 0:
            raise AssertionError(f"{self.name}: {cmd!r} exited {rc}\n{o[-2000:]}\n{e[-2000:]}")
        return rc, o, e


def connect(ip: str, *, known_hosts: str, key_file: str, timeout: float = 10):
    """paramiko with RejectPolicy and ONLY the lab's known_hosts (no system host keys)."""
    import paramiko
    for attempt in range(3):  # a 2-core machine under load can drop a connection before the banner
        c = paramiko.SSHClient()
        c.load_host_keys(known_hosts)
        c.set_missing_host_key_policy(paramiko.RejectPolicy())
        try:
            c.connect(ip, port=22, username="root", key_filename=key_file, timeout=timeout, allow_agent=False,
                      look_for_keys=False, banner_timeout=timeout, auth_timeout=timeout)
            return c
        except paramiko.BadHostKeyException:
            raise
        except (paramiko.SSHException, OSError) as e:
            c.close()
            if "not found in known_hosts" in str(e) or attempt == 2:
                raise
            time.sleep(1)


@pytest.fixture(scope="session")
def lab_connect():
    """connect(ip, known_hosts=, key_file=) -> paramiko client (strict); NodeShell wraps one."""
    return connect


@pytest.fixture(scope="session")
def node_shell_cls():
    return NodeShell


@pytest.fixture(scope="session")
def node_shells(lab):
    """name -> NodeShell for every node of the session's lab."""
    shells = {}
    for n in lab.nodes:
        shells[n.name] = NodeShell(n.name, n.ip, connect(n.ip, known_hosts=lab.known_hosts, key_file=lab.key_file),
                                   str(lab.known_hosts), str(lab.key_file))
    yield shells
    for s in shells.values():
        s.client.close()
