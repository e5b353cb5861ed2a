"""Nodes named by ssh config aliases, as engineers reach their Sparks (`ssh spark-2`): the Host entry's HostName,
User, IdentityFile and UserKnownHostsFile, and a worker reached only through a ProxyJump via the head, all with
strict host keys; a known_hosts that does not vouch for the node stops the connection naming it (issue 22)."""
from __future__ import annotations

from pathlib import Path

import paramiko
import pytest
import yaml

from sparkbook.core.cluster.nodes import Cluster, HostKeyMismatch
from sparkbook.core.values.params import load_params

pytestmark = pytest.mark.lab


def _aliased(tmp_path: Path, known_hosts: Path) -> Path:
    """The lab's params with each node's host an alias of a fresh ssh config (lab-1 only via lab-0), and the SSH
    key, user and known_hosts left to that config."""
    import sparkbook.lab as sblab
    lab = load_params(sblab.params_file(2))
    head, worker = lab.nodes
    config = tmp_path / "ssh_config"
    config.write_text(
        f"Host head-alias\n  HostName {head.host}\n  User root\n  IdentityFile {lab.ssh.key_file}\n"
        f"  UserKnownHostsFile {known_hosts}\n"
        f"Host worker-alias\n  HostName {worker.host}\n  User root\n  IdentityFile {lab.ssh.key_file}\n"
        f"  UserKnownHostsFile {known_hosts}\n  ProxyJump head-alias\n")
    data = yaml.safe_load(sblab.params_file(2).read_text())
    data["ssh"] = {"config_file": str(config), "host_key_policy": "strict"}
    data["nodes"][0]["host"], data["nodes"][1]["host"] = "head-alias", "worker-alias"
    path = tmp_path / "aliased.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def test_aliases_and_a_proxy_jump_reach_the_lab_nodes_with_strict_host_keys(lab, tmp_path: Path) -> None:
    import sparkbook.lab as sblab
    known = Path(load_params(sblab.params_file(2)).ssh.known_hosts)
    cluster = Cluster(load_params(_aliased(tmp_path, known)))
    try:
        got = {n.name: n.run(["hostname"], check=True).stdout.strip() for n in cluster}
        assert got == {"lab-0": "lab-0", "lab-1": "lab-1"}
        worker = cluster.nodes["lab-1"]
        assert worker.target.jump is not None and "via root@" in repr(worker)
        # the worker's connection really is a channel through the head's sshd, not a TCP connection of its own
        assert isinstance(worker.client().get_transport().sock, paramiko.Channel)
    finally:
        cluster.close()


def test_a_known_hosts_that_does_not_vouch_for_the_node_stops_it_named(lab, tmp_path: Path) -> None:
    empty = tmp_path / "empty_known_hosts"
    empty.write_text("")
    cluster = Cluster(load_params(_aliased(tmp_path, empty)))
    try:
        with pytest.raises(HostKeyMismatch, match="lab-0: .* is not in .*empty_known_hosts"):
            cluster.nodes["lab-0"].run(["true"])
        with pytest.raises(HostKeyMismatch, match="lab-1: "):  # its jump host is refused first: named as lab-1's
            cluster.nodes["lab-1"].run(["true"])
    finally:
        cluster.close()
