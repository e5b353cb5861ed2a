"""A node's host as an ssh config alias: resolved as `ssh HOST` would, params' explicit settings first (issue 22)."""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from sparkbook.core.cluster.sshconfig import target
from sparkbook.core.values.params import load_params

CONFIG = """\
Host spark-1
  HostName 192.168.1.11
  User engineer
  Port 2222
  IdentityFile ~/.ssh/spark_ed25519
  UserKnownHostsFile {known}
Host spark-2
  HostName 192.168.1.12
  User engineer
  IdentityFile ~/.ssh/spark_ed25519
  ProxyJump spark-1
Host spark-3
  HostName 192.168.1.13
  ProxyJump admin@bastion:2200,spark-1
Host *
  ServerAliveInterval 30
"""


def _params(base: dict[str, Any], write_params: Callable[..., Path], tmp_path: Path, ssh: dict[str, Any]):
    config = tmp_path / "ssh_config"
    config.write_text(CONFIG.format(known=tmp_path / "spark_known_hosts"))
    base["ssh"] = {"config_file": str(config), **ssh}
    for node, host in zip(base["nodes"], ("spark-1", "spark-2"), strict=True):
        node["host"] = host
    return load_params(write_params(base))


def test_an_alias_takes_hostname_user_port_key_and_known_hosts_from_the_config(base, write_params, tmp_path) -> None:
    params = _params(base, write_params, tmp_path, {})
    t = target(params.nodes[0], params.ssh)
    assert (t.hostname, t.port, t.user) == ("192.168.1.11", 2222, "engineer")
    assert t.key_files == (str(Path("~/.ssh/spark_ed25519").expanduser()),)
    assert t.known_hosts == tmp_path / "spark_known_hosts" and t.jump is None


def test_params_set_explicitly_come_first(base, write_params, tmp_path) -> None:
    params = _params(base, write_params, tmp_path, {"user": "root", "port": 22, "key_file": str(tmp_path / "id_test"),
                                                    "known_hosts": str(tmp_path / "known_hosts")})
    t = target(params.nodes[0], params.ssh)
    assert (t.hostname, t.port, t.user) == ("192.168.1.11", 22, "root"), "the alias still names the address"
    assert t.key_files == (str(tmp_path / "id_test"),) and t.known_hosts == tmp_path / "known_hosts"


def test_proxy_jump_goes_through_the_jump_host_resolved_by_the_config(base, write_params, tmp_path) -> None:
    params = _params(base, write_params, tmp_path, {})
    t = target(params.nodes[1], params.ssh)
    assert t.hostname == "192.168.1.12" and t.jump is not None
    assert (t.jump.hostname, t.jump.port, t.jump.user) == ("192.168.1.11", 2222, "engineer")
    assert t.where == "engineer@192.168.1.12:22 via engineer@192.168.1.11:2222"


def test_a_proxy_jump_list_is_a_chain_the_last_hop_nearest_the_node(base, write_params, tmp_path) -> None:
    base["nodes"][1]["name"] = "c"
    params = _params(base, write_params, tmp_path, {})
    spec = params.nodes[1].model_copy(update={"host": "spark-3"})
    t = target(spec, params.ssh)
    assert t.jump is not None and t.jump.hostname == "192.168.1.11", "spark-1 is the hop next to spark-3"
    assert t.jump.jump is not None and (t.jump.jump.hostname, t.jump.jump.port, t.jump.jump.user) == \
        ("bastion", 2200, "admin")


def test_a_host_no_entry_names_is_used_as_given(base, write_params, tmp_path) -> None:
    params = _params(base, write_params, tmp_path, {"user": "root"})
    spec = params.nodes[0].model_copy(update={"host": "10.0.0.5"})
    t = target(spec, params.ssh)
    assert (t.hostname, t.port, t.user, t.jump) == ("10.0.0.5", 22, "root", None)
