"""04's fabric test: all_reduce across the nodes in the Ray containers, with 05's env (one probe per rank:
core/cluster/probes/allreduce.py), which transport NCCL chose (its INFO log), the limits for the kind of nodes, the
verdict with its likely causes, its table and plot, and the figures 06 puts beside its decode time."""
from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass, field
from typing import Any, Literal

from matplotlib.figure import Figure

from ...core.analysis.fabric import size_label
from ...core.cluster import probes
from ...core.cluster.context import Context
from ...core.cluster.runtime import Spawned
from ...core.cluster.topology import LOG_DIR
from ...core.values.errors import ProbeOutputError, SparkbookError
from ...core.values.evidence import Alternative, Decision
from ...core.values.handoff import FabricProof
from ...core.values.params import NodeSpec, Params
from ...core.values.stagelist import RAYCLUSTER

EVENT = "fabric_allreduce"
POLL_S = 0.5
NodeKind = Literal["roce", "ethernet", "cpu"]
LinkKind = Literal["nvlink", "pcie", "roce", "ethernet", "cpu"]  # inside a node (GPU to GPU), then between nodes


# --- NCCL_DEBUG=INFO -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Transport:
    """What NCCL's INFO log says it used: the network (IB, Socket or none), its devices, and the channels' paths."""

    network: str
    hcas: list[str]
    socket_ifs: list[str]
    channels: list[str]
    ib_missing: bool
    intra: str = ""  # NCCL's path type inside the node for its rings (NVL, PIX, PXB, PHB, SYS...), "" where not logged

    @property
    def fell_back(self) -> bool:
        return self.network == "Socket" or "NET/Socket" in self.channels


_IB_USING = re.compile(r"NET/IB : Using (.*?)(?:;|$)")
_SOCKET_USING = re.compile(r"NET/Socket : Using (.*?)$")
_DEVICE = re.compile(r"\[\d+\]([^:\s]+)")
_NETWORK = re.compile(r"Using network (\w+)")
_VIA = re.compile(r"\bvia (NET/\w+|P2P|SHM|COLLNET)")
# graph/search.cc: "Pattern %d, crossNic %d, nChannels %d, bw %f/%f, type %s/%s, sameChannels %d" (intra/inter)
_GRAPH_TYPE = re.compile(r"Pattern \d+, crossNic \d+, nChannels \d+, .*type (\w+)/(\w+)")


def parse_nccl(log: str) -> Transport:
    """The transport in NCCL_DEBUG=INFO output (one rank's, or several ranks' interleaved)."""
    hcas: list[str] = []
    ifs: list[str] = []
    channels: list[str] = []
    network, intra = "", ""
    for line in log.splitlines():
        for regex, into in ((_IB_USING, hcas), (_SOCKET_USING, ifs)):
            m = regex.search(line)
            if m:
                into += [d for d in _DEVICE.findall(m[1]) if d not in into]
        m = _NETWORK.search(line)
        network = m[1] if m else network
        m = _VIA.search(line)
        if m and m[1] not in channels:
            channels.append(m[1])
        m = _GRAPH_TYPE.search(line)
        intra = m[1] if m and (not intra or m[1] != "NVL") else intra  # the slowest path any ring takes
    return Transport(network, hcas, ifs, channels, "NET/IB : No device found" in log, intra)


def transport_problems(node: str, spec: NodeSpec, t: Transport, across_nodes: bool) -> list[str]:
    """A fallback to sockets where params name HCAs, or HCAs other than roce_hcas; nothing on one node alone."""
    if not across_nodes:
        return []
    if spec.roce_hcas and t.fell_back:
        why = "NCCL found no usable HCA" if t.ib_missing else "NCCL chose sockets"
        return [f"{node}: NCCL fell back to NET/Socket over {', '.join(t.socket_ifs) or '?'} ({why}) although "
                f"roce_hcas names {', '.join(spec.roce_hcas)}: set roce_hcas (NCCL_IB_HCA) to the HCAs ibdev2netdev "
                f"shows Up for {spec.fabric_netdev} (02 lists them) and give the container /dev/infiniband"]
    if spec.roce_hcas and t.network == "IB":
        unused = [h for h in spec.roce_hcas if not any(u.startswith(h) for u in t.hcas)]
        prefixed = [u for u in t.hcas if u not in spec.roce_hcas and any(u.startswith(h) for h in spec.roce_hcas)]
        foreign = [u for u in t.hcas if not any(u.startswith(h) for h in spec.roce_hcas)]
        return ([f"{node}: NCCL does not use {', '.join(unused)} of roce_hcas (it uses {', '.join(t.hcas)})"]
                if unused else []) + \
               ([f"{node}: NCCL also uses {', '.join(prefixed)} (NCCL_IB_HCA matches names by prefix: write "
                 f"'={','.join(spec.roce_hcas)}' for exact names)"] if prefixed else []) + \
               ([f"{node}: NCCL uses {', '.join(foreign)}, which roce_hcas does not name (NCCL_IB_HCA did not reach "
                 "it: see the container's env)"] if foreign else [])
    return []



# --- 04's all_reduce test ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Limits:
    """What the test must show for its link kind: small all_reduce at most `max_us`, busbw at least `min_gbps`."""

    kind: LinkKind
    max_us: float
    min_gbps: float
    why: str


# link kind -> (small all_reduce limit in us, large size, busbw expected where the link rate is not used)
KINDS: dict[LinkKind, tuple[float, int, float]] = {
    "nvlink": (100.0, 256 << 20, 400.0),   # GPUs of one node over NVLink (2x H200 NV18: ~10-20 us, busbw > 2000 Gb/s)
    "pcie": (300.0, 256 << 20, 40.0),      # GPUs of one node over PCIe or the host bridge (NCCL type PIX..SYS)
    "roce": (150.0, 256 << 20, 100.0),     # RoCE 200G ConnectX-7 (DGX Spark): ~20-40 us, busbw ~160-190 Gb/s
    "ethernet": (1000.0, 256 << 20, 5.0),  # GPUs over NCCL sockets (no roce_hcas)
    # Gloo over the lab's veth bridge on 2 busy cores: 32 KiB in ~0.9-4.4 ms (8.2-8.5 ms for a pass under a load
    # burst), 0.35-5 Gb/s; a link shaped to 20 Mbit/s (test_04_fabric) takes 13 ms on the wire, 16.4 ms measured
    "cpu": (8000.0, 8 << 20, 0.1),
}


def node_kind(params: Params) -> NodeKind:
    """The weakest kind among the nodes: cpu (a node without GPUs), ethernet (GPUs, no RoCE HCAs), roce."""
    if any(not n.gpus for n in params.nodes):
        return "cpu"
    return "ethernet" if any(not n.roce_hcas for n in params.nodes) else "roce"


def link_kind(params: Params, transports: dict[str, Transport]) -> LinkKind:
    """The link the all_reduce is bound by: between nodes, the nodes' kind; ranks all on one node, its GPUs' link as
    NCCL's rings took it (NVL: NVLink; anything else or not logged: PCIe, the weaker)."""
    if len(transports) > 1 or node_kind(params) == "cpu":
        return node_kind(params)
    return "nvlink" if all(t.intra == "NVL" for t in transports.values()) else "pcie"


def single_rank(params: Params) -> str | None:
    """Why the test cannot run (one rank in all: nothing to reduce across, busbw is 0 by definition), else None."""
    rs = ranks(params)
    if len(rs) > 1:
        return None
    gpus = f"GPU {rs[0].device}" if rs[0].device >= 0 else "no listed GPU"
    return (f"one rank in all: the cluster is {rs[0].node} alone with {gpus}, so no link carries tensor-parallel "
            "traffic (an all_reduce of one rank moves nothing; its busbw is 0 by definition)")


def skip_decision(params: Params, why: str) -> Decision:
    """04's decision where `single_rank` gave a reason: the fabric test is skipped, and why."""
    return Decision("Does the fabric test run?", "skipped", why,
                    [Alternative("run the all_reduce test", "with one rank it measures nothing and would fail on a "
                                 "busbw of 0")],
                    [f"nodes: {', '.join(n.name for n in params.nodes)}",
                     f"GPUs listed: {sum(len(n.gpus) for n in params.nodes)}"], key="fabric_test")


def sizes(params: Params) -> list[int]:
    """The small size, then x8 steps up to the large one (params, else the node kind's)."""
    f = params.fabric
    large = f.allreduce_large_bytes or KINDS[node_kind(params)][1]
    out = [f.allreduce_small_bytes]
    while out[-1] * 8 < large:
        out.append(out[-1] * 8)
    return out + [large]


def limits(params: Params, link_mbps: int | None, kind: LinkKind | None = None) -> Limits:
    """params' limits, else the link kind's: busbw at least link_fraction of the link rate (where the kernel reports
    one for a real link between nodes), else the kind's figure."""
    kind = kind or node_kind(params)
    max_us, _, kind_gbps = KINDS[kind]
    f = params.fabric
    if f.expect_gbps:
        gbps, why = f.expect_gbps, "fabric.expect_gbps"
    elif link_mbps and kind in ("roce", "ethernet"):
        gbps, why = f.link_fraction * link_mbps / 1000, f"{f.link_fraction:g} x the {link_mbps / 1000:g} Gb/s link"
    else:
        gbps, why = kind_gbps, f"the default for {kind}"
    latency = "fabric.max_allreduce_us" if f.max_allreduce_us else f"the default for {kind}"
    return Limits(kind, f.max_allreduce_us or max_us, gbps, f"busbw: {why}; latency: {latency}")


@dataclass(frozen=True)
class Rank:
    node: str
    rank: int
    device: int  # CUDA index, -1 on CPU


def ranks(params: Params) -> list[Rank]:
    """One rank per listed GPU (one per node without GPUs), the head's first: rank 0 holds the store."""
    out: list[Rank] = []
    for spec in [params.head, *params.workers]:
        out += [Rank(spec.name, len(out) + i, gpu) for i, gpu in enumerate(spec.gpus or [-1])]
    return out


@dataclass(frozen=True)
class SizeResult:
    bytes: int
    us: float
    algbw_gbps: float
    busbw_gbps: float
    iters: int
    correct: bool
    passes_us: list[float] = field(default_factory=list)  # the latency size's two passes; `us` is the better


@dataclass(frozen=True)
class LinkResult:
    src: str
    dst: str
    gbps: float


@dataclass(frozen=True)
class AllReduceTest:
    """The test as it ran: figures (the slowest rank's), per-link rates, each node's NCCL transport and link rate."""

    backend: str
    world: int
    nodes: list[str]
    sizes: list[SizeResult]
    links: list[LinkResult]
    link_mbps: dict[str, int | None]
    transports: dict[str, Transport]
    seconds: float
    versions: str = ""
    error: str = ""


def config(params: Params, r: Rank, world: int, leaders: list[int], port: int) -> dict[str, Any]:
    """One rank's probe config: NCCL on GPUs where every node has them, else Gloo on CPU tensors everywhere."""
    f, nccl = params.fabric, node_kind(params) != "cpu"
    return {"backend": "nccl" if nccl else "gloo", "rank": r.rank, "world": world,
            "master": f"{params.head.fabric_ip}:{port}", "device": r.device if nccl else -1, "sizes": sizes(params),
            "iters": f.allreduce_iters, "budget_s": f.allreduce_budget_s, "warmup": 3,
            "timeout_s": f.allreduce_timeout_s, "netdev": params.node(r.node).fabric_netdev, "leaders": leaders}


def serve_env(params: Params, node: str) -> dict[str, str]:
    """The env 05 serves with on this node (over the container's fabric env), plus NCCL's INFO log of its transport."""
    return {**params.serve.env, **params.serve.node_env.get(node, {}), "NCCL_DEBUG": "INFO",
            "NCCL_DEBUG_SUBSYS": "INIT,NET,GRAPH"}  # GRAPH: the path type of the rings inside a node


def run_allreduce(ctx: Context) -> AllReduceTest:
    """Spawn one probe per rank in the nodes' containers (rank 0 on the head) with 05's env, wait for them (bounded
    by fabric.allreduce_timeout_s, which each rank also enforces on itself), read their logs, and end every process
    spawned (by its session), whatever happened. `check(verdict(...))` stops 04 on a fallback, a slow link or a
    failed test."""
    params, cluster, runtime, where = ctx.params, ctx.cluster, ctx.runtime, ctx.places
    rs, t0 = ranks(params), time.monotonic()
    leaders = [next(r.rank for r in rs if r.node == n) for n in dict.fromkeys(r.node for r in rs)]
    port = params.serve.master_port + 1
    spawned: dict[int, Spawned] = {}
    try:
        for r in rs:
            argv = ["python3", "-c", probes.source("allreduce"), json.dumps(config(params, r, len(rs), leaders, port))]
            spawned[r.rank] = runtime.spawn(cluster.nodes[r.node], where[r.node], argv,
                                            f"{LOG_DIR}/allreduce-{r.rank}.log", env=serve_env(params, r.node))
        deadline = t0 + params.fabric.allreduce_timeout_s + 10
        while time.monotonic() < deadline and any(
                runtime.running(cluster.nodes[r.node], where[r.node], spawned[r.rank]) for r in rs):
            time.sleep(POLL_S)
        logs = {r.rank: runtime.read(cluster.nodes[r.node], where[r.node], spawned[r.rank].log) for r in rs}
    finally:
        for r in rs:
            if r.rank in spawned:
                runtime.kill(cluster.nodes[r.node], where[r.node], spawned[r.rank], grace_s=2)
    return collect(params, rs, logs, time.monotonic() - t0)


def collect(params: Params, rs: list[Rank], logs: dict[int, str], seconds: float) -> AllReduceTest:
    """The test from each rank's log: its probe document and NCCL's INFO lines; a rank without a whole document
    makes the test an error naming its node, with its log's tail."""
    docs, failed = {}, []
    for r in rs:
        try:
            docs[r.rank] = probes.parse(logs[r.rank], node=r.node, probe=f"all_reduce rank {r.rank}")
        except ProbeOutputError:
            tail = "\n".join(line for line in logs[r.rank].splitlines() if "NCCL INFO" not in line)[-600:]
            failed.append(f"{r.node} (rank {r.rank}): {tail.strip() or 'no output'}")
    nodes = list(dict.fromkeys(r.node for r in rs))
    transports = {n: parse_nccl("\n".join(logs[r.rank] for r in rs if r.node == n)) for n in nodes}
    first = docs.get(0) or next(iter(docs.values()), {})
    by_rank = {r.rank: r.node for r in rs}
    links = [LinkResult(by_rank[x["src_rank"]], by_rank[x["dst_rank"]], x["gbps"])
             for d in docs.values() for x in d["links"]]
    return AllReduceTest(first.get("backend", ""), len(rs), nodes, [SizeResult(**s) for s in first.get("sizes", [])],
                         links, {r.node: docs[r.rank]["link_mbps"] for r in rs if r.rank in docs}, transports, seconds,
                         f"torch {first['torch']}" + (f", NCCL {first['nccl']}" if first.get("nccl") else "")
                         if first else "", "; ".join(failed))


@dataclass(frozen=True)
class FabricVerdict:
    """The test against its limits: what fails (naming nodes and figures) and the likely causes."""

    limits: Limits
    problems: list[str] = field(default_factory=list)
    causes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


CAUSES = {
    "fallback": "NCCL on sockets instead of RoCE: NCCL_IB_HCA (roce_hcas) names a wrong or Down HCA, or the "
                "container lacks /dev/infiniband",
    "twin": "only one of a DGX Spark port's two PCIe twins in use: about half the port (list both in roce_hcas)",
    "stale": "a ConnectX-7 stuck in its degraded initialization (8-25 Gb/s): reboot both nodes, or power-cycle them "
             "(NVIDIA dgx-spark-playbooks check-connectx-bandwidth)",
    "link": "the link itself: negotiated below its rate (ethtool), MTU mismatch, errors or another job on it",
    "shaped": "a traffic-control qdisc on a node's fabric netdev (`tc qdisc show dev NETDEV`): delay or a rate limit",
}


def verdict(params: Params, test: AllReduceTest) -> FabricVerdict:
    """Small all_reduce latency and the large size's busbw against `limits`, NCCL's transport against params, each
    link's rate against the expected busbw; every failure with its figures, the likely causes after them."""
    rates = [m for m in test.link_mbps.values() if m]
    lim = limits(params, min(rates) if rates else None, link_kind(params, test.transports))
    if test.error:
        return FabricVerdict(lim, [f"the all_reduce test did not complete: {test.error}"],
                       [f"port {params.serve.master_port + 1} on {params.head.name} taken (rank 0's store)",
                        "a node's Gloo/NCCL cannot reach the head's fabric IP (firewall, wrong fabric_netdev)",
                        CAUSES["fallback"]])
    problems = [p for n in test.nodes for p in transport_problems(n, params.node(n), test.transports[n],
                                                                   len(test.nodes) > 1)]
    small, large = test.sizes[0], test.sizes[-1]
    if small.us > lim.max_us:
        passes = f" in both passes ({', '.join(f'{p:,.0f}' for p in small.passes_us)} us)" if small.passes_us else ""
        problems.append(f"a {small.bytes // 1024} KiB all_reduce takes {small.us:,.0f} us{passes}, the limit is "
                        f"{lim.max_us:,.0f} us")
    if large.busbw_gbps < lim.min_gbps:
        problems.append(f"busbw at {large.bytes >> 20} MiB is {large.busbw_gbps:.2f} Gb/s, expected at least "
                        f"{lim.min_gbps:.2f} Gb/s ({lim.why.split(';')[0].removeprefix('busbw: ')})")
    problems += [f"the link {x.src} -> {x.dst} carries {x.gbps:.2f} Gb/s (expected at least {lim.min_gbps:.2f}): "
                 f"{x.src}'s side is the likely one" for x in test.links if x.gbps < lim.min_gbps]
    problems += [f"a {s.bytes}-byte all_reduce returned a wrong sum" for s in test.sizes if not s.correct]
    if not problems:
        return FabricVerdict(lim)
    fell_back = any(t.fell_back for t in test.transports.values())
    causes = [CAUSES["fallback"]] if fell_back else []
    match lim.kind:
        case "roce":
            causes += [CAUSES["twin"]] * any(len(params.node(n).roce_hcas) < 2 for n in test.nodes)
            causes += [CAUSES["stale"]] * (8 <= large.busbw_gbps <= 25)
    return FabricVerdict(lim, problems, causes + [CAUSES["link"], CAUSES["shaped"]])


class FabricTestFailed(SparkbookError):
    """04's all_reduce test found the fabric unfit to serve over; the message has the figures."""

    stage = RAYCLUSTER.name

    def __init__(self, result: FabricVerdict):
        self.verdict = result
        super().__init__("fabric test failed: " + "; ".join(result.problems),
                         remediation="likely causes: " + "; ".join(result.causes))


def check(result: FabricVerdict) -> FabricVerdict:
    if not result.ok:
        raise FabricTestFailed(result)
    return result


# --- display ----------------------------------------------------------------------------------------
def rows(test: AllReduceTest, result: FabricVerdict) -> list[dict[str, object]]:
    """One row per size: time, algbw, busbw, against the limits."""
    lim = result.limits
    out = []
    for i, s in enumerate(test.sizes):
        limit = (f"<= {lim.max_us:,.0f} us" if i == 0 else "") + (f">= {lim.min_gbps:.2f} Gb/s busbw"
                                                                     if i == len(test.sizes) - 1 else "")
        out.append({"size": size_label(s.bytes), "time (us)": round(s.us, 1), "algbw (Gb/s)": round(s.algbw_gbps, 3),
                    "busbw (Gb/s)": round(s.busbw_gbps, 3), "iterations": s.iters, "sum correct": s.correct,
                    "limit": limit or "-"})
    return out


def transport_rows(test: AllReduceTest) -> list[dict[str, object]]:
    """Per node: the link rate the kernel reports, NCCL's network and devices, and each link's measured rate."""
    out: list[dict[str, object]] = [
           {"node": n, "link rate": f"{mbps / 1000:g} Gb/s" if (mbps := test.link_mbps.get(n)) else "unknown",
            "NCCL network": t.network or ("-" if test.backend == "gloo" else "not logged"),
            "devices": ", ".join(t.hcas or t.socket_ifs) or "-", "channels via": ", ".join(t.channels) or "-"}
           for n, t in test.transports.items()]
    return out + [{"node": f"{x.src} -> {x.dst}", "link rate": f"measured {x.gbps:.2f} Gb/s", "NCCL network": "-",
                   "devices": "-", "channels via": "-"} for x in test.links]


def figure(test: AllReduceTest, result: FabricVerdict) -> Figure:
    """Latency and busbw by size (log axes) with the limits drawn."""
    fig = Figure(figsize=(9, 3.2))
    lat, bw = fig.subplots(1, 2)
    x = [s.bytes for s in test.sizes]
    lat.loglog(x, [s.us for s in test.sizes], "o-")
    lat.axhline(result.limits.max_us, color="tab:red", ls="--", label="limit (small size)")
    lat.set(xlabel="bytes", ylabel="all_reduce time (us)", title="latency")
    bw.semilogx(x, [s.busbw_gbps for s in test.sizes], "o-")
    bw.axhline(result.limits.min_gbps, color="tab:red", ls="--", label="expected (large size)")
    bw.set(xlabel="bytes", ylabel="busbw (Gb/s)", title=f"bus bandwidth ({test.backend}, {test.world} ranks)")
    for ax in (lat, bw):
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig



def proof(test: AllReduceTest) -> FabricProof:
    """What 06 puts beside its decode time: the small size's latency and the large size's busbw."""
    small, large = test.sizes[0], test.sizes[-1]
    return FabricProof(backend=test.backend, world=test.world, small_bytes=small.bytes, small_us=small.us,
                       large_bytes=large.bytes, large_busbw_gbps=large.busbw_gbps)
