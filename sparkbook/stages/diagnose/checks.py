"""Diagnosis: node facts, fabric links, the model on the nodes, and the findings before anything launches."""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

from ...core.analysis.fabric import hca_findings
from ...core.analysis.hostfacts import FANOUT_TIMEOUT_S, NO_GPU, Memory, meminfo, memory_from, sections
from ...core.cluster.context import Context
from ...core.cluster.docker_ssh import docker_client, unavailable
from ...core.cluster.nodes import Node, bash, shell
from ...core.cluster.topology import LiveServer
from ...core.values.errors import ProbeOutputError, SparkbookError
from ...core.values.evidence import Alternative, Decision, Finding, unreachable
from ...core.values.fanout import Outcome
from ...core.values.handoff import Diagnosis
from ...core.values.imagefacts import RegistryProbe
from ...core.values.modelinfo import GIB, MTP_FIELDS, SEED_SHARE, FitRow, ModelFacts, NodeMemory
from ...core.values.params import ModelSpec, NodeSpec, Params, Speculative
from ...core.values.stagelist import DIAGNOSE, IMAGES

PROBE_TIMEOUT_S = 20


@dataclass(frozen=True)
class Gpu:
    name: str
    compute_capability: str
    driver: str
    cuda: str


@dataclass(frozen=True)
class NodeFacts:
    node: str
    os: str
    kernel: str
    arch: str
    cpu: str
    cpus: int
    memory: Memory
    disk_free_bytes: int | None
    disk_path: str
    docker: str
    gpus: list[Gpu]
    gpu: str  # "2 x NVIDIA GB10" or the fact that there is none
    fabric_netdev: str
    fabric_ip_found: list[str]
    mtu: int | None
    link_state: str
    roce: str
    oom_daemons: list[str]  # earlyoom / systemd-oomd running: they kill before the kernel does, by their own rules

    def row(self) -> dict[str, object]:
        g = self.gpus[0] if self.gpus else None
        return {"node": self.node, "os": self.os, "kernel": f"{self.kernel} {self.arch}",
                "cpu": f"{self.cpu} x{self.cpus}", "memory": self.memory.describe(),
                "free disk": f"{(self.disk_free_bytes or 0) / GIB:.1f} GiB at {self.disk_path}",
                "docker": self.docker, "gpu": self.gpu,
                "cc / driver / CUDA": f"{g.compute_capability} / {g.driver} / {g.cuda}" if g else "-",
                "fabric": f"{self.fabric_netdev} {','.join(self.fabric_ip_found) or 'no IPv4'} "
                          f"mtu {self.mtu} {self.link_state}", "RoCE": self.roce,
                "OOM daemon": ", ".join(self.oom_daemons) or "none (the kernel's OOM killer only)"}


@dataclass(frozen=True)
class Link:
    src: str
    dst: str
    dst_ip: str
    reachable: bool
    rtt_ms: float | None
    mtu_ok: bool
    tcp_ok: bool


@dataclass(frozen=True)
class ModelFiles:
    node: str
    dir: str
    config: dict[str, Any] | None
    index: dict[str, Any] | None
    file_sizes: list[int]
    error: str = ""

    @property
    def config_sha(self) -> str:
        return hashlib.sha256(json.dumps(self.config, sort_keys=True).encode()).hexdigest()[:12] if self.config \
            else "-"


class DiagnosisError(SparkbookError):
    """The diagnosis cannot go on; the message names what no node has."""

    stage = DIAGNOSE.name


# --- node facts -------------------------------------------------------------------------------------
FACTS = r"""
echo ==os==; . /etc/os-release 2>/dev/null; echo "$PRETTY_NAME"
echo ==kernel==; uname -r; uname -m
echo ==cpu==; lscpu 2>/dev/null | sed -n 's/^Model name: *//p' | head -1; nproc
echo ==disk==; d={path}; while [ ! -e "$d" ]; do d=$(dirname "$d"); done; df -B1 --output=avail,target "$d" | tail -1
echo ==gpu==; nvidia-smi --query-gpu=name,compute_cap,driver_version --format=csv,noheader 2>/dev/null
echo ==cuda==; nvidia-smi 2>/dev/null | sed -n 's/.*CUDA Version: *\([0-9.]*\).*/\1/p'
echo ==gpumem==; nvidia-smi --query-gpu=memory.total,memory.used --format=csv,noheader,nounits 2>/dev/null
echo ==hasgpu==; command -v nvidia-smi || echo none
if command -v ip >/dev/null; then
echo ==net==; ip -o -4 addr show dev {netdev} 2>&1; echo ==link==; ip -o link show dev {netdev} 2>&1
else  # no iproute2: the host's local IPv4 addresses (not per device) and the device's sysfs entries
echo ==net==; awk '/\/32 host LOCAL/ {{print "0: ip-absent inet " p "/32"}} {{p=$2}}' /proc/net/fib_trie 2>/dev/null \
  | sort -u
echo ==link==; echo "0: {netdev}: mtu $(cat /sys/class/net/{netdev}/mtu 2>/dev/null) \
state $(tr a-z A-Z </sys/class/net/{netdev}/operstate 2>/dev/null)"
fi
echo ==roce==; if command -v ibdev2netdev >/dev/null; then ibdev2netdev; else echo "ibdev2netdev not present"; fi
echo ==oomd==; for d in earlyoom systemd-oomd; do pgrep -x "$d" >/dev/null 2>&1 && echo "$d"; done
echo ==meminfo==; cat /proc/meminfo
echo ==end==
"""


def node_facts(node: Node, spec: NodeSpec, params: Params) -> NodeFacts:
    """OS, kernel, CPU, memory, disk where models live, Docker, GPU, fabric and RoCE of one node."""
    r = node.run(shell(FACTS, path=params.model.cache_dir, netdev=spec.fabric_netdev), timeout=PROBE_TIMEOUT_S,
                 check=True)
    s = sections(r.stdout, node.name, "node facts", ("kernel", "meminfo"))
    try:
        docker = f"Docker {docker_client(node, timeout=PROBE_TIMEOUT_S).version()['Version']}"
    except Exception as exc:  # absence of Docker is a fact of the node
        docker = unavailable(exc)
    cuda = (s.get("cuda") or ["?"])[0] or "?"
    gpus = [Gpu(name.strip(), cc.strip(), driver.strip(), cuda)
            for name, cc, driver, *_ in (line.split(",") for line in s.get("gpu", []) if line.count(",") >= 2)]
    has_gpu = s.get("hasgpu", ["none"])[0] != "none"
    gpu = f"{len(gpus)} x {gpus[0].name}" if gpus else ("nvidia-smi lists no GPU" if has_gpu else NO_GPU)
    disk = (s.get("disk") or [""])[0].split()
    link = " ".join(s.get("link", [])).split()  # netlink, not /sys: sysfs may show another netns
    mtu = link[link.index("mtu") + 1] if "mtu" in link else ""
    state = link[link.index("state") + 1] if "state" in link else "missing"
    ips = [w.split("/")[0] for line in s.get("net", []) if " inet " in f" {line} " for w in line.split()[3:4]]
    cpu = s.get("cpu", ["?", "0"])
    return NodeFacts(node.name, (s.get("os") or ["?"])[0], s["kernel"][0], s["kernel"][1], cpu[0], int(cpu[-1]),
                     memory_from(meminfo(s["meminfo"]), s.get("gpumem", [])),
                     int(disk[0]) if disk and disk[0].isdigit() else None, disk[1] if len(disk) > 1 else "?",
                     docker, gpus, gpu, spec.fabric_netdev, ips, int(mtu) if mtu.isdigit() else None, state,
                     "; ".join(s.get("roce", [])) or "-", s.get("oomd", []))


def facts_all(ctx: Context) -> dict[str, Outcome[NodeFacts]]:
    return ctx.cluster.fan_out(lambda n: node_facts(n, n.spec, ctx.params), timeout=FANOUT_TIMEOUT_S)


# --- fabric links -----------------------------------------------------------------------------------
# The TCP probe goes to the Ray port: Ray and NCCL need TCP between nodes on ports beyond SSH's. An answer, accepted
# or refused (a reset from the peer's kernel), proves TCP passes both ways; silence means filtered. A refused port
# costs the peer no process, where a connection to sshd costs it a fork per peer (N*(N-1) on an N-node fabric).
# The RTT is the fabric-MTU ping's; a plain ping runs only when that one fails (unreachable, or the MTU is smaller).
# Three programs per peer (ping, timeout, bash): on a lab of N nodes on one machine, N*(N-1) of each run at once.
LINKS = r"""
size={size}; port={port}; ips={ips}
echo ==peers==
for ip in $ips; do (
  if p=$(ping -c 1 -W 1 -M do -s "$size" "$ip" 2>&1); then m=1; else m=0; p=$(ping -c 1 -W 1 "$ip" 2>&1); fi
  [[ $p =~ time=([0-9.]+) ]] && r=${{BASH_REMATCH[1]}} || r=none
  e=$(timeout 3 bash --norc --noprofile -c "exec 3<>/dev/tcp/$ip/$port" 2>&1); c=$?
  [[ $c == 0 || $e == *refused* ]] && t=1 || t=0
  echo "PEER $ip $r $m $t"
) & done; wait
echo ==end==
"""


def links(node: Node, params: Params) -> list[Link]:
    """From this node to every other on its fabric IP: ping, a no-fragment ping at the fabric MTU, TCP to the
    Ray port."""
    peers = {str(p.fabric_ip): p.name for p in params.nodes if p.name != node.name}
    if not peers:
        return []
    r = node.run(bash(LINKS, size=params.fabric.mtu - 28, port=params.ray.port, ips=" ".join(peers)),
                 timeout=PROBE_TIMEOUT_S, check=True)
    return _links(node.name, peers, r.stdout)


def _links(node: str, peers: dict[str, str], text: str) -> list[Link]:
    """The links probe's output (`PEER ip rtt mtu_ok tcp_ok` per peer) -> one Link per peer, each peer required."""
    rows = {f[1]: f for f in map(str.split, sections(text, node, "links").get("peers", []))
            if len(f) == 5 and f[0] == "PEER" and f[1] in peers}
    missing = [name for ip, name in peers.items() if ip not in rows]
    if missing:
        raise ProbeOutputError(node, "links", f"line for {', '.join(missing)}", len(text.encode()))
    out = [Link(node, peers[ip], ip, rtt != "none", None if rtt == "none" else float(rtt), mtu_ok == "1",
                tcp_ok == "1") for ip, (_, _, rtt, mtu_ok, tcp_ok) in rows.items()]
    return sorted(out, key=lambda link: link.dst)


def links_all(ctx: Context) -> dict[str, Outcome[list[Link]]]:
    return ctx.cluster.fan_out(lambda n: links(n, ctx.params), timeout=FANOUT_TIMEOUT_S)


# --- the model on the nodes -------------------------------------------------------------------------
MODEL_DIR = r"""
for base in {cache}/hub {cache}; do
  if [ -f "$base/{repo}/refs/main" ]; then echo "$base/{repo}/snapshots/$(cat "$base/{repo}/refs/main")"; exit 0; fi
done
ls -d {cache}/hub/{repo}/snapshots/* {cache}/{repo}/snapshots/* 2>/dev/null | tail -1
"""
MODEL_FILES = r"""
d={dir}; echo ==config==; cat "$d/config.json" || exit 3; echo
echo ==index==; cat "$d/model.safetensors.index.json" 2>/dev/null; echo
echo ==sizes==; for f in "$d"/*.safetensors; do [ -e "$f" ] && stat -L -c %s "$f"; done
echo ==end==
"""


def model_dir(node: Node, model: ModelSpec) -> str:
    """model.path, or the snapshot dir of model.hf_id in the node's Hugging Face cache ("" if absent)."""
    if model.path:
        return model.path
    repo = "models--" + (model.hf_id or "").replace("/", "--")
    return node.run(shell(MODEL_DIR, cache=model.cache_dir, repo=repo), timeout=PROBE_TIMEOUT_S).stdout.strip()


def model_files(node: Node, model: ModelSpec) -> ModelFiles:
    """config.json, the safetensors index and the weight files' sizes, as this node has them."""
    where = model_dir(node, model)
    if not where:
        return ModelFiles(node.name, "", None, None, [], f"{model.hf_id} is not in {model.cache_dir}")
    r = node.run(shell(MODEL_FILES, dir=where), timeout=PROBE_TIMEOUT_S)
    if r.timed_out:
        return ModelFiles(node.name, where, None, None, [],
                          f"reading {where} did not return within {PROBE_TIMEOUT_S} s (a hung mount or file?): "
                          "ended on the node")
    if not r.ok:
        return ModelFiles(node.name, where, None, None, [], f"no config.json in {where}")
    return _model_files(node.name, where, r.stdout)


def _model_files(node: str, where: str, text: str) -> ModelFiles:
    """The model-files probe's output (config.json, the index, the weight files' sizes) -> ModelFiles."""
    s = sections(text, node, "model files", ("config",))
    config, index = ("\n".join(s.get(name, [])).strip() for name in ("config", "index"))
    try:
        return ModelFiles(node, where, json.loads(config), json.loads(index) if index else None,
                          [int(x) for x in s.get("sizes", [])])
    except ValueError as exc:  # the reply is whole (it has its end marker): the file itself is broken
        return ModelFiles(node, where, None, None, [], f"config.json or the safetensors index in {where} "
                                                       f"is not valid JSON: {exc}")


def model_files_all(ctx: Context) -> dict[str, Outcome[ModelFiles]]:
    return ctx.cluster.fan_out(lambda n: model_files(n, ctx.params.model), timeout=FANOUT_TIMEOUT_S)


def config_source(files: dict[str, Outcome[ModelFiles]], head: str) -> ModelFiles:
    """The copy 02 reads the model's facts from: the head's, else the first node that has a config.json."""
    have = [o.ok_value for n, o in sorted(files.items(), key=lambda i: i[0] != head) if o.ok and o.ok_value.config]
    if not have:
        raise DiagnosisError("no node has the model's config.json: " + "; ".join(
            f"{n}: {o.ok_value.error if o.ok else o.error}" for n, o in files.items()))
    return have[0]


def model_rows(files: dict[str, Outcome[ModelFiles]]) -> list[dict[str, object]]:
    return [{"node": n, "dir": o.ok_value.dir if o.ok else "-", "config sha": o.ok_value.config_sha if o.ok else "-",
             "weight files GiB": round(sum(o.ok_value.file_sizes) / GIB, 4) if o.ok else "-",
             "problem": (o.ok_value.error if o.ok else str(o.error))} for n, o in files.items()]


# --- findings ---------------------------------------------------------------------------------------
def node_findings(facts: dict[str, Outcome[NodeFacts]], params: Params) -> list[Finding]:
    out = unreachable(facts)
    for n, o in facts.items():
        if not o.ok:
            continue
        f, spec = o.ok_value, params.node(n)
        if spec.fabric_ip.is_loopback:
            out.append(Finding("warning", "fabric", f"{n}: fabric_ip {spec.fabric_ip} is a loopback address: Ray "
                                                    "reports the host's own address instead (04's gate) and vLLM's "
                                                    "placement group asks for node:<VLLM_HOST_IP>; name the host's "
                                                    "address, even on a single box"))
        if str(spec.fabric_ip) not in f.fabric_ip_found:
            out.append(Finding("blocker", "fabric", f"{n}: {spec.fabric_ip} is not on {f.fabric_netdev} "
                                                    f"(found {f.fabric_ip_found or 'no IPv4'})"))
        if f.mtu != params.fabric.mtu:
            out.append(Finding("warning", "fabric", f"{n}: {f.fabric_netdev} MTU is {f.mtu}, the fabric is meant "
                                                    f"to have {params.fabric.mtu}"))
        if not f.gpus:
            out.append(Finding("fact", "gpu", f"{n}: {f.gpu}"))
        out += hca_findings(spec, f.roce.split("; "))  # roce_hcas against ibdev2netdev (its lines joined by "; ")
    return out


def link_findings(results: dict[str, Outcome[list[Link]]], params: Params) -> list[Finding]:
    out = [Finding("blocker", "fabric", f"{n}: links not tested: {o.error}") for n, o in results.items() if not o.ok]
    head = params.head.name
    for o in results.values():
        for link in o.value or []:
            to = f"{link.src} -> {link.dst}{' (head)' if link.dst == head else ''} at {link.dst_ip}"
            if not link.reachable:
                out.append(Finding("blocker", "fabric", f"{to}: no answer to ping: {link.src} cannot reach "
                                                        f"{link.dst} on the fabric"))
            elif not link.mtu_ok:
                out.append(Finding("warning", "fabric", f"{to}: a {params.fabric.mtu}-byte packet does not pass "
                                                        "unfragmented: the path MTU is below the fabric's"))
            if link.reachable and not link.tcp_ok:
                out.append(Finding("blocker", "fabric", f"{to}: TCP to port {params.ray.port} gets no answer: a "
                                                       "firewall filters it (Ray and NCCL need TCP between nodes)"))
    return out


def model_findings(files: dict[str, Outcome[ModelFiles]]) -> list[Finding]:
    out = unreachable(files)
    shas = {o.ok_value.config_sha for o in files.values() if o.ok and o.ok_value.config}
    for n, o in files.items():
        if o.ok and o.ok_value.error:
            holder = next((m for m, h in files.items() if h.ok and h.ok_value.config and not h.ok_value.error), None)
            out.append(Finding("warning", "model", f"{n}: {o.ok_value.error}; 03 copies it from {holder}") if holder
                       else Finding("blocker", "model", f"{n}: {o.ok_value.error}"))
    if len(shas) > 1:
        out.append(Finding("blocker", "model", f"the nodes hold different config.json files: {sorted(shas)}"))
    return out


def speculation_problem(model: ModelFacts, spec: Speculative | None) -> str | None:
    """Why the model cannot speculate as serve.speculative asks (None: it can, or nothing is asked). Only method mtp
    depends on the served model: its draft is the model's own MTP layers, and vLLM fails at load, after the
    weights, where the config declares none."""
    if spec is None or spec.method != "mtp" or model.mtp_layers:
        return None
    arch = ", ".join(model.architectures) or "the model"
    return (f"serve.speculative.method: mtp, but {arch}'s config.json declares no multi-token-prediction layers "
            f"({' or '.join(MTP_FIELDS)}): use method ngram, or eagle3 / draft_model with a draft of its own")


def speculation_findings(model: ModelFacts, params: Params) -> list[Finding]:
    """serve.speculative asking of the model what its config does not have (method mtp without MTP layers): a
    blocker, since vLLM would say so only after loading every weight."""
    problem = speculation_problem(model, params.serve.speculative)
    return [Finding("blocker", "speculation", problem)] if problem else []


def fit_memory(memory: dict[str, Memory], server: LiveServer | None) -> dict[str, NodeMemory]:
    """Each node's memory for the fit once 05 has stopped this runbook's answering server (replaced or kept, its
    memory is the plan's): what 05 measured it holding counts free. A server whose record has no measure counts
    nothing."""
    out = {}
    for n, m in memory.items():
        now, held = m.for_fit(n), server.held.get(n, 0) if server is not None else 0
        after = m.without(held).for_fit(n)
        out[n] = after.holding(after.cuda_bytes - now.cuda_bytes, server.run) if server is not None and held \
            else now
    return out


def fit_findings(rows: list[FitRow]) -> list[Finding]:
    """A plan that does not fit in what CUDA can allocate is a blocker; one that takes more than SEED_SHARE of it
    a warning."""
    out = []
    for r in rows:
        if not r.fits:
            out.append(Finding("blocker", "memory", f"{r.node}: the plan does not fit: {r.why} "
                                                    f"({r.allocatable_source})"))
        elif r.tight:
            out.append(Finding("warning", "memory", f"{r.node}: the plan takes {r.planned_gib} GiB, {r.share:.0%} of "
                                                    f"the {r.allocatable_gib} GiB CUDA can allocate "
                                                    f"({r.allocatable_source}), above the {SEED_SHARE:.0%} at which "
                                                    "the seed's serve ran out of memory in CUDA graph capture"))
    return out


def image_finding(probe: RegistryProbe | None, reason: str = "") -> Finding:
    """The seed's first discovery: does the installed image's vLLM know the model's architecture?
    (None: there is no installed image, for `reason`.)"""
    if probe is None:
        return Finding("fact", "image", f"installed image not probed: {reason or 'none in params'}")
    image, arch, version = probe.image, probe.architecture, probe.vllm_version
    if probe.error:
        return Finding("blocker", "image", f"{image}: the registry probe failed: {probe.error}")
    if probe.registered:
        return Finding("fact", "image", f"{image} (vLLM {version}) registers {arch}")
    fallback = (" (its transformers knows the model, so `--model-impl auto` would fall back to the Transformers "
                "backend: that is not support)") if probe.transformers_backend else ""
    return Finding("blocker", "image", f"{image} (vLLM {version}) does not register {arch}: the installed "
                                       f"deployment's image cannot serve this model{fallback}")


def question_for_03(probe: RegistryProbe | None, architecture: str = "") -> str:
    if probe is None:
        return (f"Does the runtime's vLLM register {architecture} AND load it (inspection passes, not a grafted "
                "name), on every node?")
    arch, image = probe.architecture, probe.image
    if probe.registered:
        return (f"{image} registers {arch}; does it really load it (inspection, not just the name), "
                "or is another candidate image needed?")
    return (f"Which candidate image's vLLM registers {arch} AND loads it (inspection passes, not a grafted name), "
            f"since the installed {image} does not — and is that image (same ID) on every node?")


def diagnosis(findings: list[Finding], probe: RegistryProbe | None, architecture: str,
              memory: dict[str, NodeMemory]) -> Diagnosis:
    """What 02 leaves in the run state: every finding, the question 03 must answer, the installed image's probe,
    and each node's total memory (05 lowers gpu_memory_utilization by it)."""
    return Diagnosis(findings=findings, question_for_03=question_for_03(probe, architecture), installed_image=probe,
                     node_memory={n: m.total_bytes for n, m in memory.items()})


# --- what stops 02 ----------------------------------------------------------------------------------
# A blocker stops 02 unless a later stage resolves it. One topic is resolved later: the installed image (its vLLM
# does not register the model, or its registry probe failed): 03 probes every candidate image and chooses one whose
# own vLLM registers and loads the model. Every other blocker would only fail the run later, after the image copy
# and a long load: a node that does not answer, the fabric (the fabric IP not on its netdev, no ping, TCP filtered),
# the model (on no node, or different config.json files on the nodes: 03 copies the model only to nodes that lack
# it, from one that holds it) and the memory fit.
RESOLVED_LATER = {"image": f"{IMAGES.name} probes every candidate image and chooses one whose own vLLM registers "
                           "and loads the model"}
REMEDIATION = {
    "node": "bring the node back (sshd running, its address in params right) or take it out of params.nodes",
    "fabric": "put fabric_ip on fabric_netdev (or correct them in params), let ping and TCP pass between the nodes' "
              "fabric IPs",
    "model": "put the model on one node, the head (model.path, or model.hf_id in model.cache_dir): 03 copies it "
             "from there to every node that lacks it; a node that holds different files must have them removed first",
    "speculation": "set serve.speculative to a method this model has (ngram needs nothing; eagle3 or draft_model "
                   "a draft of their own), or remove it",
    "layout": "set serve.layout: tp (the model split over the nodes), or for a copy per node a smaller model, "
              "serve.max_num_seqs or serve.max_model_len",
    "memory": "lower serve.max_model_len, kv_cache_memory_bytes or gpu_memory_utilization, spread the model over more "
              "GPUs (tensor/pipeline parallel), or free memory on the node",
}
OVERRIDE = "proceed_despite_blockers"  # 02's notebook parameter (sparkbook run PARAMS -p NAME=true)


@dataclass(frozen=True)
class Blocker:
    """A blocker that stops 02: the node it concerns (None: several or the cluster), what, and what to do."""

    node: str | None
    topic: str
    text: str
    remediation: str

    def line(self) -> str:
        return f"[{self.topic}] {self.text} -> {self.remediation}"


class Blocked(DiagnosisError):
    """02 found blockers that no later stage resolves."""


def stopping(findings: list[Finding], params: Params) -> list[Blocker]:
    """The blockers that stop 02 (a topic a later stage resolves does not), each with its node and remediation."""
    names = [n.name for n in params.nodes]
    return [Blocker(next((n for n in names if f.text.startswith((f"{n}:", f"{n} ->"))), None), f.topic, f.text,
                    REMEDIATION.get(f.topic, "fix it and run 02 again"))
            for f in findings if f.severity == "blocker" and f.topic not in RESOLVED_LATER]


def left_to_later(findings: list[Finding]) -> list[str]:
    """The blockers a later stage resolves (they do not stop 02), each with the stage that does."""
    return [f"[{f.topic}] {f.text} -> {RESOLVED_LATER[f.topic]}" for f in findings
            if f.severity == "blocker" and f.topic in RESOLVED_LATER]


def gate(findings: list[Finding], params: Params, proceed_despite_blockers: bool = False) -> Decision | None:
    """None when nothing stops the run; raises Blocked listing every stopping blocker; with the override, the
    decision to go on (for run.decide) that lists what was overridden."""
    blockers = stopping(findings, params)
    if not blockers:
        return None
    lines = [b.line() for b in blockers]
    if not proceed_despite_blockers:
        nodes = {b.node for b in blockers}
        raise Blocked(f"{len(blockers)} blocker(s) would fail the run after the image copy and the model load:\n- "
                      + "\n- ".join(lines), node=nodes.pop() if len(nodes) == 1 else None,
                      remediation=f"fix each as said and run 02 again, or run with -p {OVERRIDE}=true to go on "
                                  "anyway (recorded as a decision)")
    return Decision("Go on despite 02's blockers?", "go on", f"the notebook parameter {OVERRIDE} is True: the "
                    f"engineer overrides {len(blockers)} blocker(s), each of which may fail a later stage",
                    [Alternative("stop at 02", f"overridden by {OVERRIDE}")], lines)
