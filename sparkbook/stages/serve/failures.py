"""05's failures: known signatures in vLLM/Ray/NCCL logs and the kernel's (a named cause, the line that shows it, a
remediation) and the remediation ladder that retries a start without speculative decoding where it may have crashed it,
and an out-of-memory start with less memory, a step at a time, then eager."""
from __future__ import annotations

import re
from dataclasses import dataclass, field

from ...core.values.modelinfo import VLLM_DEFAULT_UTILIZATION
from ...core.values.params import ServeSettings, Speculative

GRAPH_OOM = "CUDA out of memory during graph capture"
FREE_MEMORY = "not enough free memory at start-up"
OOM_KILL = "killed by the kernel's OOM killer"
REG_MR = "NCCL could not register memory (ENOMEM)"
LADDER = (GRAPH_OOM, FREE_MEMORY, OOM_KILL, REG_MR)  # out of memory: less gpu_memory_utilization helps, then eager
ILLEGAL_ACCESS = "CUDA illegal memory access"
GRAPH_CRASH = "CUDA error in graph capture"
# Crashes that speculative decoding has caused (MTP in CUDA graph capture, vllm-project/vllm#48749; MTP's illegal
# memory access, #40756): with serve.speculative set, the first retry goes without it.
SPECULATION_SUSPECTS = (GRAPH_OOM, GRAPH_CRASH, ILLEGAL_ACCESS)
_VLLM_COMM = r"(python\S*|vllm\S*|VLLM\S*|pt_main_thread|ray::\S*|raylet|EngineCore\S*)"  # comm, <= 15 chars


@dataclass(frozen=True)
class Signature:
    """A cause and the log patterns that prove it (all of `requires` must match too, anywhere)."""

    cause: str
    patterns: tuple[str, ...]
    remediation: str
    requires: tuple[str, ...] = ()
    consequence: bool = False   # follows from another failure (a dead peer): a seen fact explains it better

    def first_match(self, text: str) -> str | None:
        if not all(re.search(p, text, re.I) for p in self.requires):
            return None
        for line in text.splitlines():
            if any(re.search(p, line, re.I) for p in self.patterns):
                return line.strip()
        return None


# Most specific first: a graph-capture OOM also says "worker died" further down.
SIGNATURES: tuple[Signature, ...] = (
    # the kernel's: mm/oom_kill.c (dump_oom_summary, __oom_kill_process), read from the node's dmesg when its
    # serve process is gone (launch.kernel_lines); a comm of vLLM, Ray or Python names the victim
    Signature(OOM_KILL,
              (rf"Out of memory: Killed process \d+ \({_VLLM_COMM}\)", rf"oom-kill:.*task={_VLLM_COMM},"),
              "the node ran out of memory and the kernel killed the server: on unified memory (GB10) the GPU's share "
              "and the OS's are one pool; lower serve.gpu_memory_utilization (the ladder does), stop what else holds "
              "memory (01), set runtime.memory_limit so the container, not sshd, is what goes"),
    Signature("architecture not supported",
              (r"Model architectures? \[.*\] (are|is) not supported",),
              "this image's vLLM does not register the architecture: pick an image whose vLLM does (03)"),
    Signature("architecture failed to be inspected",
              (r"failed to be inspected", r"Error in inspecting model architecture"),
              "the architecture is registered but its module does not import (grafted or mismatched files): "
              "use an image whose own vLLM ships the model (03)"),
    Signature("argument not recognized",
              (r"error: unrecognized arguments:", r"error: argument --\S+: invalid"),
              "this image's vLLM does not know an argument of the serve command (its argparse refused it): remove "
              "it from serve.extra_args, or choose an image whose vLLM has it (03)"),
    Signature("configuration refused",
              (r"^\s*Value error, ",),
              "vLLM refused the configuration when the engine built it (after its argument parser accepted the "
              "argv): correct the serve setting it names, e.g. a serve.max_model_len above the model's "
              "max_position_embeddings", requires=(r"validation error for \w*Config",)),
    Signature(GRAPH_OOM,
              (r"CUDA out of memory", r"OutOfMemoryError", r"CUDA error: out of memory"),
              "lower serve.gpu_memory_utilization to the lowest that still holds weights and KV cache (02's memory "
              "fit); if that is not enough, serve with --enforce-eager",
              requires=(r"captur\w* .*(cuda ?graph|cudagraph)|cuda ?graph.*captur|cudagraph",)),
    # torch's text for cudaErrorIllegalAddress (c10/cuda/CUDAException), an asynchronous kernel fault
    Signature(ILLEGAL_ACCESS,
              (r"CUDA error: an illegal memory access was encountered", r"cudaErrorIllegalAddress"),
              "a CUDA kernel read or wrote out of bounds; with serve.speculative set, serve without it (the ladder "
              "does); else report it with the log tail (a vLLM or kernel bug for this model, dtype and GPU)"),
    # cudaErrorStreamCaptureUnsupported and its kin, raised where torch.cuda.graph ends a capture
    Signature(GRAPH_CRASH,
              (r"CUDA error: operation not permitted when stream is capturing", r"cudaErrorStreamCapture\w+"),
              "a kernel that CUDA graphs cannot capture: with serve.speculative set, serve without it (the ladder "
              "does); else serve with --enforce-eager"),
    # vLLM's start-up check: vllm/v1/worker/utils.py (request_memory), raised before any weight loads
    Signature(FREE_MEMORY,
              (r"Free memory on device .* on startup is less than desired GPU memory utilization",),
              "CUDA could allocate less than gpu_memory_utilization x the GPU's memory when vLLM started: other "
              "processes hold it (01 stops them) or, on unified memory, the page cache does (05 drops it first); "
              "lower serve.gpu_memory_utilization (the ladder does, while 02's fit still holds)"),
    # NCCL's misc/ibvwrap.cc: registering (pinning) its buffers for RoCE failed
    Signature(REG_MR,
              (r"Call to ibv_reg_mr\w* failed with error Cannot allocate memory",
               r"ibv_reg_mr\w*.*Cannot allocate memory"),
              "NCCL could not pin memory for RoCE: the container's locked-memory limit (run it with --ulimit "
              "memlock=-1, as vLLM's run_cluster.sh does) or, on unified memory, the OS left without memory; lower "
              "serve.gpu_memory_utilization (the ladder does)"),
    # vLLM's own texts: vllm/v1/core/kv_cache_utils.py (_check_enough_kv_cache_memory) and, before V1,
    # vllm/worker/worker.py (raise_if_cache_size_invalid).
    Signature("no memory left for the KV cache",
              (r"No available memory for the cache blocks",
               r"KV cache is needed, which is larger than the available KV cache memory",
               r"larger than the maximum number of tokens that can be stored in KV cache"),
              "weights (and activations) leave too little for the KV cache of one max_model_len sequence: lower "
              "serve.max_model_len (or serve.max_num_seqs), raise serve.gpu_memory_utilization, or spread the "
              "model over more nodes (serve.tensor_parallel_size / pipeline_parallel_size); 02's memory fit shows "
              "what each node holds"),
    Signature("placement group not scheduled",
              (r"placement group.*(not|never|cannot|could not).*schedul", r"No available node types can fulfill",
               r"Waiting for creating a placement group"),
              "Ray and vLLM disagree on node IPs or a stale placement group holds the GPUs: set VLLM_HOST_IP per "
              "node, recreate the Ray containers (04); on 1-GPU nodes use the SPREAD strategy"),
    Signature("duplicate node IP",
              (r"Every node should have a unique IP address",),
              "two nodes report the same VLLM_HOST_IP: give each node its own fabric IP in params (04)"),
    Signature("NCCL timeout",
              (r"NCCL.*(timeout|timed out)", r"Watchdog caught collective operation timeout"),
              "NCCL picked the wrong interface or the fabric drops traffic: check NCCL_SOCKET_IFNAME / NCCL_IB_HCA "
              "and the fabric (02)"),
    Signature("rank never joined",
              (r"DistStoreError", r"waiting for clients", r"TCPStore.*(timed out|timeout)",
               r"Timed out .*(rendezvous|store)"),
              "a rank did not reach master_addr:master_port: check that every node's serve process started and "
              "the master port is open on the fabric", consequence=True),
    Signature("address already in use",
              (r"Address already in use", r"EADDRINUSE", r"\[Errno 98\]"),
              "the serve port is taken on the head: stop the service holding it (01) or change serve.port"),
    Signature("worker died",
              (r"Worker.*(died|exited unexpectedly|failed)", r"ActorDiedError", r"The actor died",
               r"Engine core initialization failed", r"EngineCore.*(died|failed)", r"engine core exited unexpectedly",
               r"\bKilled\b", r"SIGKILL"),
              "a worker process died: read its node's log tail for the first error; check memory (dmesg, OOM killer)",
              consequence=True),
)

UNKNOWN = "unknown failure"
TIMEOUT = "not ready in time"


@dataclass(frozen=True)
class FailureCause:
    """The classified cause of a failed start: where it was seen and the line that proves it."""

    cause: str
    node: str
    evidence: str
    remediation: str
    also: tuple[str, ...] = ()

    @property
    def known(self) -> bool:
        return self.cause != UNKNOWN

    def summary(self) -> str:
        return f"{self.cause} on {self.node}: {self.evidence!r} -> {self.remediation}"


def classify(logs: dict[str, str], observed: dict[str, str] | None = None) -> FailureCause:
    """The most specific known cause over every node's log tail.

    `observed` are facts seen without logs ({"lab-1": "container is not running"}): they explain a failure
    better than consequences in other logs (a rank that never joined), worse than a root cause in a log."""
    found: list[tuple[int, str, Signature, str]] = []
    for node, text in logs.items():
        for rank, sig in enumerate(SIGNATURES):
            line = sig.first_match(text)
            if line is not None:
                found.append((rank + len(SIGNATURES) * sig.consequence, node, sig, line))
    found.sort(key=lambda f: f[0])
    also = tuple(dict.fromkeys(f"{s.cause} on {n}" for _, n, s, _ in found))
    if found and not (found[0][2].consequence and observed):
        _, node, sig, line = found[0]
        return FailureCause(sig.cause, node, line, sig.remediation, also[1:])
    if observed:
        node, fact = next(iter(observed.items()))
        died = _by_cause("worker died")
        return FailureCause(died.cause, node, fact, died.remediation, also)
    node = next(iter(logs), "")
    last = next((ln.strip() for ln in reversed((logs.get(node) or "").splitlines()) if ln.strip()), "")
    return FailureCause(UNKNOWN, node, last, "read the log tails; add the signature to sparkbook.stages.serve.failures")


def not_ready(logs: dict[str, str], node: str, seconds: float) -> FailureCause:
    """A start that neither failed nor finished in time: a root cause from the logs if one shows,
    otherwise the phase it was in (the last line of `node`'s log)."""
    found = classify(logs)
    if found.known and not _by_cause(found.cause).consequence:
        return found
    last = next((ln.strip() for ln in reversed((logs.get(node) or "").splitlines()) if ln.strip()), "(no output)")
    return FailureCause(TIMEOUT, node, last[-300:], f"still starting after {seconds:.0f} s: raise "
                        "serve.ready_timeout_s if the last line shows progress (a loaded node, a large model), else "
                        "read the tails", (f"{found.cause} on {found.node}",) if found.known else ())


def _by_cause(cause: str) -> Signature:
    return next(s for s in SIGNATURES if s.cause == cause)


@dataclass(frozen=True)
class Remedy:
    """A change to the serve settings that addresses a diagnosed cause, and why."""

    cause: str
    change: dict[str, object]
    settings: ServeSettings
    reason: str
    alternatives: list[tuple[str, str]] = field(default_factory=list)


def remedy(cause: FailureCause, settings: ServeSettings, floor: float | None = None) -> Remedy | None:
    """The next automatic remediation for `cause` under `settings`, or None where there is none.

    A cause speculation is known to bring (SPECULATION_SUSPECTS) with serve.speculative set: serve without it first,
    since the steps below would give up memory or speed for a crash that may not be theirs.

    Out of memory (a cause in LADDER): lower gpu_memory_utilization by serve.utilization_step while the result still
    holds the weights and the KV cache on every node (`floor`, `modelinfo.utilization_floor` from 02's memory fit;
    each attempt reloads every weight, so one step at a time gives up no more KV cache than the start needs), then
    --enforce-eager (no CUDA graphs). Unknown floor (None: no fit): straight to eager. Every other cause needs a
    person (or an earlier stage)."""
    if cause.cause in SPECULATION_SUSPECTS and settings.speculative is not None:
        return _without_speculation(cause, settings, settings.speculative)
    if cause.cause not in LADDER or settings.enforce_eager:
        return None
    current = settings.gpu_memory_utilization or VLLM_DEFAULT_UTILIZATION
    lower = round(current - settings.utilization_step, 4)
    eager = ("enforce_eager", "costs decode speed; tried only once less memory no longer fits")
    if floor is not None and floor <= lower:
        change: dict[str, object] = {"gpu_memory_utilization": lower}
        reason = (f"{cause.cause} at gpu_memory_utilization {current}: one step of serve.utilization_step "
                  f"({settings.utilization_step:g}) down to {lower:g}, which still holds the weights and the KV cache "
                  f"for max_model_len on every node (02's memory fit needs at least {floor})")
        alts = [(f"straight to the fit's floor {floor}", "gives up more KV cache than the start may need"), eager]
    else:
        change = {"enforce_eager": True}
        reason = ("no memory fit from 02 to lower gpu_memory_utilization by" if floor is None
                  else f"no gpu_memory_utilization holds the weights and the KV cache (02's memory fit needs {floor})"
                  if floor > 1 else f"a step below gpu_memory_utilization {current} ({lower:g}) is under the memory "
                  f"fit's floor {floor}") + ": skip CUDA graph capture"
        alts = [("lower gpu_memory_utilization", "below the memory fit's floor the weights and the KV cache for "
                 "max_model_len no longer fit")]
    return Remedy(cause.cause, change, settings.model_copy(update=change), reason, alts)


def _without_speculation(cause: FailureCause, settings: ServeSettings, spec: Speculative) -> Remedy:
    change: dict[str, object] = {"speculative": None}
    reason = (f"{cause.cause} with speculative decoding on ({spec.method}, {spec.num_speculative_tokens} tokens): "
              "serve without it first, since speculation has crashed CUDA graph capture and made illegal memory "
              "accesses (vllm-project/vllm#48749, #40756) and its draft takes memory of its own; the memory steps "
              "follow if the cause stays")
    alts = [("lower gpu_memory_utilization first", "gives up KV cache for a crash that may be speculation's"),
            ("enforce_eager", "costs every request's decode speed; speculation is the likelier cause")]
    return Remedy(cause.cause, change, settings.model_copy(update=change), reason, alts)
