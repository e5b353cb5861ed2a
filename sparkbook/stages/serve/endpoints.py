"""Where clients reach the API on each network the params name: the management network (the head's SSH address,
`host`) and the fabric (its fabric_ip). Which of them answers follows from serve.host, the address vLLM binds."""
from __future__ import annotations

import ipaddress
from dataclasses import dataclass

from ...core.values.params import Params

EVERY_INTERFACE = ipaddress.IPv4Address("0.0.0.0")


@dataclass(frozen=True)
class ClientAddress:
    """One network's address for clients: its URL, and why it does not answer there (None when it does)."""

    network: str  # "management", "fabric", or "management and fabric" where they are one address
    url: str
    not_listening: str | None

    def row(self) -> dict[str, str]:
        return {"network": self.network, "URL": self.url, "answers": self.not_listening or "yes"}


def has_management_network(params: Params) -> bool:
    """Whether some node is reached by SSH at another address than its fabric IP (a network of its own)."""
    return any(n.host != str(n.fabric_ip) for n in params.nodes)


def client_addresses(params: Params) -> list[ClientAddress]:
    """The URL clients use on each network; a network the API does not listen on says so, naming serve.host."""
    head, port, bind = params.head, params.serve.port, params.serve.host
    fabric = str(head.fabric_ip)

    def answers(address: str) -> str | None:
        if bind == EVERY_INTERFACE or str(bind) == address:
            return None
        return f"no: serve.host is {bind}"

    if not has_management_network(params):
        return [ClientAddress("management and fabric", f"http://{fabric}:{port}", answers(fabric))]
    return [ClientAddress("management", f"http://{head.host}:{port}", answers(head.host)),
            ClientAddress("fabric", f"http://{fabric}:{port}", answers(fabric))]


def listen_warning(params: Params) -> str | None:
    """The warning `check` prints when the API would listen on every interface of a cluster with a management
    network (None when it binds one address, or there is no such network)."""
    if params.serve.host != EVERY_INTERFACE or not has_management_network(params):
        return None
    return (f"serve.host: 0.0.0.0 makes the API listen on every interface of {params.head.name}, its management "
            f"address {params.head.host} included (anyone there can use it: without serve.api_key_env, and with it "
            f"through a server's own port, where vLLM's /invocations asks no key); set serve.host to "
            f"{params.head.fabric_ip} (fabric only) or {params.head.host} (management only)")
