"""The fabric as more than one stage sees it: which RoCE HCAs drive the fabric netdev (ibdev2netdev: 02 checks
params against it), and 04's all_reduce figures beside 06's decode time (04 hands them on as FabricProof)."""
from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

from ..values.evidence import Finding
from ..values.handoff import FabricProof
from ..values.params import NodeSpec


# --- ibdev2netdev (02) -------------------------------------------------------------------------------
@dataclass(frozen=True)
class Hca:
    """One line of `ibdev2netdev`: an RDMA device's port, the netdev it drives, and whether that is Up."""

    name: str
    port: int
    netdev: str
    up: bool


_IBDEV = re.compile(r"^\s*(\S+)\s+port\s+(\d+)\s+==>\s+(\S+)\s+\((\w+)\)")


def parse_ibdev2netdev(lines: Iterable[str]) -> list[Hca]:
    """`ibdev2netdev` output (e.g. `rocep1s0f1 port 1 ==> enp1s0f1np1 (Up)`) -> one Hca per line that has that shape."""
    return [Hca(m[1], int(m[2]), m[3], m[4] == "Up") for m in map(_IBDEV.match, lines) if m]


def port_key(name: str) -> str:
    """The PCI bus/slot/function in a predictable RDMA or netdev name, without its PCI domain: rocep1s0f1,
    roceP2p1s0f1, enp1s0f1np1 and enP2p1s0f1np1 all give p1s0f1. On a DGX Spark the two domains are the two PCIe
    halves ("twins") of one QSFP port; a name without that shape (mlx5_0) is its own key."""
    m = re.fullmatch(r"(?:roce|en)(?:P\d+)?(p\d+s\d+f\d+)(?:np\d+)?", name)
    return m[1] if m else name


def fabric_hcas(hcas: list[Hca], netdev: str) -> list[Hca]:
    """The HCAs Up on the fabric netdev or on its twin (the same port through the other PCIe domain)."""
    return [h for h in hcas if h.up and port_key(h.netdev) == port_key(netdev)]


def hca_findings(spec: NodeSpec, ibdev2netdev: Iterable[str]) -> list[Finding]:
    """02's check of params' `roce_hcas` against the node's `ibdev2netdev`: each exists, is Up and drives the fabric
    netdev (or its twin); both twins reported where the node has them, and a half-used port."""
    n, hcas = spec.name, parse_ibdev2netdev(ibdev2netdev)
    found = {h.name: h for h in hcas}
    usable = fabric_hcas(hcas, spec.fabric_netdev)
    fix = (f"set roce_hcas to the HCAs ibdev2netdev shows Up for {spec.fabric_netdev}: "
           f"{', '.join(h.name for h in usable)}" if usable else
           f"ibdev2netdev shows no HCA Up for {spec.fabric_netdev}: check the cable and link, then roce_hcas")
    if not hcas:
        return [Finding("warning", "fabric", f"{n}: roce_hcas {spec.roce_hcas} cannot be checked: ibdev2netdev lists "
                                             "no RDMA device (not installed, or no RDMA driver); NCCL falls back to "
                                             "sockets without one")] if spec.roce_hcas else []
    out = []
    for name in spec.roce_hcas:
        hca = found.get(name)
        if hca is None:
            out.append(Finding("blocker", "fabric", f"{n}: roce_hcas names {name}, which ibdev2netdev does not list "
                                                    f"(it lists {', '.join(found)}): NCCL would fall back to sockets; "
                                                    + fix))
        elif not hca.up:
            out.append(Finding("blocker", "fabric", f"{n}: {name} (port {hca.port} ==> {hca.netdev}) is Down; {fix}"))
        elif port_key(hca.netdev) != port_key(spec.fabric_netdev):
            out.append(Finding("blocker", "fabric", f"{n}: {name} drives {hca.netdev}, not the fabric netdev "
                                                    f"{spec.fabric_netdev}; {fix}"))
    if len(usable) > 1:
        pair = " and ".join(f"{h.name} ({h.netdev})" for h in usable)
        out.append(Finding("fact", "fabric", f"{n}: {pair} are Up on one port of {spec.fabric_netdev} "
                                             "(its PCIe twins)"))
        unused = [h.name for h in usable if h.name not in spec.roce_hcas]
        if spec.roce_hcas and unused:
            out.append(Finding("warning", "fabric", f"{n}: roce_hcas leaves {', '.join(unused)} unused: NCCL reaches "
                                                    "about half the port (98 against 161 Gb/s measured on two GB10); "
                                                    f"add {', '.join(unused)} to roce_hcas"))
    elif not spec.roce_hcas and usable:
        out.append(Finding("fact", "fabric", f"{n}: {usable[0].name} is Up on {spec.fabric_netdev} but roce_hcas is "
                                             "empty: NCCL picks its HCAs itself"))
    return out


# --- 04's figures beside 06's decode ------------------------------------------------------------------
def beside_decode(proof: FabricProof | None, single_stream_tpot_ms: float | None) -> list[dict[str, object]]:
    """06: 04's fabric figures beside the single-stream decode time (median TPOT at concurrency 1)."""
    if proof is None:
        return [{"figure": "fabric test", "value": "not recorded in this run (04 records it)"}]
    out: list[dict[str, object]] = [
        {"figure": f"all_reduce {size_label(proof.small_bytes)} (04)", "value": f"{proof.small_us:,.1f} us"},
        {"figure": f"busbw at {size_label(proof.large_bytes)} (04)", "value": f"{proof.large_busbw_gbps:.2f} Gb/s"}]
    if single_stream_tpot_ms:
        tpot = single_stream_tpot_ms
        out += [{"figure": "median TPOT at concurrency 1 (06)", "value": f"{tpot:.2f} ms"},
                {"figure": "small all_reduces that fit in one TPOT", "value": f"{tpot * 1000 / proof.small_us:,.0f}"}]
    return out


def size_label(n: int) -> str:
    """A byte count as the fabric test's tables write it (MiB, KiB or B)."""
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB" if n >= 1 << 10 else f"{n} B"
