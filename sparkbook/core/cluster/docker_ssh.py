"""docker-py clients for nodes: `ssh://` over paramiko with the cluster's key and host-key policy."""
from __future__ import annotations

import threading
import weakref
from typing import cast

import docker
from docker.transport import SSHHTTPAdapter

from .nodes import Node, SSHNode

MIN_API = "1.24"
# what a node without Docker answers: no socket locally; no `docker` CLI or no daemon over SSH
NO_DOCKER = ("No such file or directory", "docker: not found", "command not found",
             "Cannot connect to the Docker daemon", "Is the docker daemon running")


def unavailable(exc: Exception) -> str:
    """How a node's Docker failed to answer, as a fact: "no Docker daemon on this node" where there is none."""
    text = str(exc)
    if any(s in text for s in NO_DOCKER):
        return f"no Docker daemon on this node ({text[:160]})"
    return f"unavailable: {text}"


class _NodeSSHAdapter(SSHHTTPAdapter):  # type: ignore[misc]  # docker-py ships no types
    """docker-py's SSH adapter riding on the node's own SSH connection: no second handshake per client,
    the same key, known_hosts and strict policy; closing the client leaves the node's connection open."""

    def __init__(self, node: SSHNode, timeout: float):
        self._node = node
        super().__init__(f"ssh://{node.spec.host}", timeout=timeout, max_pool_size=4)

    def _create_paramiko_client(self, base_url: str) -> None:
        self.ssh_client = self._node.client()

    def _connect(self) -> None:
        self.ssh_client = self._node.client()  # reconnects the node if its transport has gone

    def get_connection(self, url, proxies=None):  # type: ignore[no-untyped-def]
        """A pool on a live transport: the node's connection may have been closed (its run closed) or dropped
        since this client was made; pools made on the old transport would answer "Socket is closed"."""
        transport = self.ssh_client.get_transport() if self.ssh_client else None
        if transport is None or not transport.is_active():
            self._connect()
            self.pools.clear()
        return super().get_connection(url, proxies)

    def close(self) -> None:
        super(SSHHTTPAdapter, self).close()


_clients: weakref.WeakKeyDictionary[Node, dict[float, docker.DockerClient]] = weakref.WeakKeyDictionary()
_clients_lock = threading.Lock()


def docker_client(node: Node, timeout: float = 120) -> docker.DockerClient:
    """A DockerClient for the node's own daemon (reached through `docker system dial-stdio` over SSH), one per
    node and timeout for as long as the node lives: the steps of a run share its `dial-stdio` connection."""
    with _clients_lock:
        per_node = _clients.setdefault(node, {})
    if timeout not in per_node:
        per_node[timeout] = _new_client(node, timeout)
    return per_node[timeout]


def _new_client(node: Node, timeout: float) -> docker.DockerClient:
    if node.local:
        return docker.DockerClient(base_url="unix:///var/run/docker.sock", timeout=int(timeout))
    api = docker.APIClient(base_url="tcp://127.0.0.1:9", version=MIN_API, timeout=int(timeout))
    adapter = _NodeSSHAdapter(cast(SSHNode, node), timeout)  # not local: an SSH node
    api.mount("http+docker://ssh", adapter)
    api._custom_adapter = adapter
    api.base_url = "http+docker://ssh"
    api._version = api.version(api_version=False)["ApiVersion"]
    client = docker.DockerClient.__new__(docker.DockerClient)
    client.api = api
    return client
