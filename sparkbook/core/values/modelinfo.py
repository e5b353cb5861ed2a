"""What a model is, from its config.json alone: architecture, dtype, parameters, KV size, and memory fit."""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from .params import Params, ServeSettings
from .stagelist import DIAGNOSE
from .state import Handoff

GIB = 1 << 30
DTYPE_BYTES = {"float32": 4.0, "float": 4.0, "bfloat16": 2.0, "float16": 2.0, "half": 2.0,
               "float8_e4m3fn": 1.0, "fp8": 1.0}
VLLM_DEFAULT_UTILIZATION = 0.9
# Per rank, beside weights and KV cache inside gpu_memory_utilization: the profile run's activation peak, memory
# outside torch (NCCL, CUDA context) and the CUDA graph pool; vLLM's own startup lines put these at 1-3 GiB on
# one GPU ("PyTorch activation peak memory takes 2.53GiB", "CUDA graphs can take additional 1~3 GiB memory per
# GPU"; vllm-project/vllm#11251, #7593), doubled for margin.
RESERVE_BYTES = 4 * GIB
# What CUDA can allocate is less than what nvidia-smi or /proc/meminfo report:
# - a discrete GPU: nvidia-smi's memory.total counts memory CUDA never hands out, and the CUDA context takes its
#   share. Measured on an idle H200 (tests/unit/data/nvidia-smi-h200.txt): memory.total 143771 MiB, used 0,
#   torch.cuda.mem_get_info() free 142629 MiB: 1142 MiB per GPU out of reach.
# - GB10 (DGX Spark) unified memory: nvidia-smi reports no memory ("Not Supported" / [N/A]); CUDA's free memory
#   caps at 101.3-102.2 of 121.69 GiB (MemTotal) even headless with caches dropped (MiaAI-Lab/GLM-5.3-Flash-EXL3-
#   2x-DGX-Sparks#47), so MemTotal less 20.4 GiB, at most MemAvailable.
CUDA_UNSEEN_PER_GPU_BYTES = 1142 << 20
UNIFIED_UNSEEN_BYTES = int(20.4 * GIB)
# Warn when the plan takes more than this share of what CUDA can allocate: the seed's first serve at
# gpu_memory_utilization 0.8 ran out of memory in CUDA graph capture (params/spark-duo.yaml).
SEED_SHARE = 0.8


class ModelFacts(Handoff):
    """The model as its config and weight files describe it (parameter counts are estimates)."""

    key = "model"
    notebook = DIAGNOSE.name

    architectures: list[str]
    model_type: str
    dtype: str
    quantization: str | None
    bytes_per_param: float
    total_params: int
    active_params: int
    weight_bytes: int
    weight_source: str  # "safetensors index" | "safetensors files" | "estimate"
    num_layers: int
    kv_bytes_per_token: int  # all attention layers, whole model, at the model dtype
    kv_latent: bool  # MLA: one latent per layer, replicated on every tensor-parallel rank
    dir_on_nodes: str
    experts: int = 0  # routed experts per MoE layer (0: a dense model)
    experts_per_token: int = 0  # routed experts each token picks (top-k)
    moe_layers: int = 0  # layers with routed experts
    expert_params: int = 0  # parameters of one routed expert in one layer
    mtp_layers: int = 0  # multi-token-prediction layers (serve.speculative method mtp drafts with them)

    @property
    def is_moe(self) -> bool:
        return self.active_params < self.total_params

    def summary(self) -> dict[str, object]:
        return {"architectures": ", ".join(self.architectures), "model_type": self.model_type, "dtype": self.dtype,
                "quantization": self.quantization or "none", "bytes per parameter": self.bytes_per_param,
                "parameters (estimate)": human_params(self.total_params),
                "active parameters (estimate)": human_params(self.active_params) + (" (MoE)" if self.is_moe else ""),
                "weight bytes": f"{self.weight_bytes:,} ({self.weight_bytes / GIB:.3f} GiB, {self.weight_source})",
                "layers": self.num_layers,
                "KV bytes per token": f"{self.kv_bytes_per_token:,}" + (" (MLA latent)" if self.kv_latent else ""),
                "dir on nodes": self.dir_on_nodes}


@dataclass(frozen=True)
class NodeMemory:
    """Memory one node can give the model: GPU memory where reported, else system memory (unified/CPU); and of it
    what CUDA can allocate (`cuda_bytes`, how it was found in `cuda_source`)."""

    node: str
    total_bytes: int
    available_bytes: int
    source: str  # "GPU" | "MemTotal/MemAvailable"
    cuda_bytes: int
    cuda_source: str
    held_bytes: int = 0  # of cuda_bytes: what this runbook's running server holds now, freed when 05 stops it
    held_by: str | None = None  # the run whose server holds it

    def holding(self, freed: int, run: str | None) -> NodeMemory:
        """This node's memory measured once 05 has stopped the runbook's running server of `run`, marked with what
        that server holds of what CUDA could allocate (`freed`): a redeploy measured with the old server still up
        would find its own server's memory missing."""
        return dataclasses.replace(self, held_bytes=freed, held_by=run or "an earlier run",
                                   cuda_source=f"{self.cuda_source}; with {freed / GIB:.2f} GiB counted that the "
                                               f"running server of {run or 'an earlier run'} holds, which 05 stops "
                                               "before it starts")


@dataclass(frozen=True)
class FitRow:
    """One node's share of the planned split against its memory."""

    node: str
    ranks: int
    memory_gib: float
    allocatable_gib: float  # what CUDA can allocate on the node (NodeMemory.cuda_bytes)
    planned_gib: float  # what the plan takes: utilization x memory, or weights + fixed KV + reserve
    share: float  # planned / allocatable
    weights_gib: float
    kv_gib: float
    kv_tokens: int
    needed_tokens: int
    fits: bool
    why: str
    allocatable_source: str
    held_gib: float = 0.0  # of allocatable_gib: held by the runbook's running server now (NodeMemory.held_bytes)
    held_by: str | None = None

    @property
    def allocatable_now_gib(self) -> float:
        """What CUDA can allocate with the running server still up."""
        return round(self.allocatable_gib - self.held_gib, 2)

    @property
    def tight(self) -> bool:
        """The plan fits but takes more than SEED_SHARE of what CUDA can allocate."""
        return self.fits and self.share > SEED_SHARE


def text_config(config: dict[str, Any]) -> dict[str, Any]:
    """The language model's part of a (possibly multimodal) config."""
    inner = config.get("text_config") or config.get("llm_config") or {}
    return {**config, **inner}


def quantization(config: dict[str, Any]) -> tuple[str | None, float | None]:
    """(method, bytes per weight) from quantization_config; (None, None) when unquantized."""
    q = config.get("quantization_config") or text_config(config).get("quantization_config")
    if not q:
        return None, None
    method = str(q.get("quant_method") or q.get("quant_algo") or "unknown").lower()
    algo = str(q.get("quant_algo") or "").lower()
    if "fp4" in method or "fp4" in algo:
        return method, 0.5
    if "fp8" in method or "fp8" in algo:
        return method, 1.0
    bits = q.get("bits") or q.get("w_bit")
    if bits is None:
        groups = q.get("config_groups") or {}
        bits = next((g.get("weights", {}).get("num_bits") for g in groups.values()), None)
    return method, (bits / 8 if bits else None)


def model_dtype(config: dict[str, Any]) -> str:
    return str(text_config(config).get("torch_dtype") or text_config(config).get("dtype") or "bfloat16")


def _sparse_layers(c: dict[str, Any], layers: int, experts: int) -> list[bool]:
    if not experts:
        return [False] * layers
    if isinstance(c.get("mlp_layer_types"), list):
        return [t != "dense" for t in c["mlp_layer_types"]][:layers]
    if "first_k_dense_replace" in c:
        return [i >= c["first_k_dense_replace"] for i in range(layers)]
    step, dense = c.get("decoder_sparse_step") or 1, set(c.get("mlp_only_layers") or [])
    return [i not in dense and (i + 1) % step == 0 for i in range(layers)]


def _attention_params(c: dict[str, Any], hidden: int, heads: int) -> int:
    if c.get("kv_lora_rank"):
        nope, rope, v = c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"]
        qr = c.get("q_lora_rank")
        q = hidden * qr + qr * heads * (nope + rope) if qr else hidden * heads * (nope + rope)
        kv = hidden * (c["kv_lora_rank"] + rope) + c["kv_lora_rank"] * heads * (nope + v)
        return int(q + kv + heads * v * hidden)
    head_dim = c.get("head_dim") or hidden // heads
    kv_heads = c.get("num_key_value_heads") or heads
    return 2 * hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim


def _experts(c: dict[str, Any]) -> tuple[int, int, int]:
    """(routed experts per MoE layer, experts per token, one expert's intermediate size); experts 0 when dense."""
    experts = c.get("n_routed_experts") or c.get("num_experts") or c.get("num_local_experts") or 0
    top_k = c.get("num_experts_per_tok") or c.get("moe_topk") or 0
    return int(experts), int(top_k), int(c.get("moe_intermediate_size") or c.get("intermediate_size") or 0)


def moe_shape(config: dict[str, Any]) -> tuple[int, int, int, int]:
    """(experts, experts per token, MoE layers, parameters of one expert in one layer); zeros for a dense model."""
    c = text_config(config)
    experts, top_k, expert_inter = _experts(c)
    if not experts:
        return 0, 0, 0, 0
    layers = sum(_sparse_layers(c, c["num_hidden_layers"], experts))
    return experts, top_k, layers, 3 * c["hidden_size"] * expert_inter


def estimate_params(config: dict[str, Any]) -> tuple[int, int]:
    """(total, active) parameters of the language model: embeddings, attention, dense or MoE MLPs."""
    c = text_config(config)
    hidden, layers, heads = c["hidden_size"], c["num_hidden_layers"], c["num_attention_heads"]
    experts, top_k, expert_inter = _experts(c)
    shared = (c.get("n_shared_experts") or 0) * 3 * hidden * expert_inter \
        + 3 * hidden * (c.get("shared_expert_intermediate_size") or 0)
    dense_mlp = 3 * hidden * c.get("intermediate_size", 0)
    attn = _attention_params(c, hidden, heads) + 2 * hidden
    total = active = 0
    for sparse in _sparse_layers(c, layers, experts):
        if sparse:
            router = hidden * experts
            total += attn + router + shared + experts * 3 * hidden * expert_inter
            active += attn + router + shared + top_k * 3 * hidden * expert_inter
        else:
            total += attn + dense_mlp
            active += attn + dense_mlp
    embed = c["vocab_size"] * hidden * (1 if c.get("tie_word_embeddings") else 2)
    return total + embed, active + embed


def kv_bytes_per_token(config: dict[str, Any], dtype_bytes: float) -> tuple[int, bool]:
    """(bytes of KV cache per token over all attention layers, whether it is an MLA latent)."""
    c = text_config(config)
    types = c.get("layer_types") or []
    layers = sum(1 for t in types if "linear" not in str(t)) if types else c["num_hidden_layers"]
    if c.get("kv_lora_rank"):
        return int(layers * (c["kv_lora_rank"] + c["qk_rope_head_dim"]) * dtype_bytes), True
    heads = c["num_attention_heads"]
    head_dim = c.get("head_dim") or c["hidden_size"] // heads
    kv_heads = c.get("num_key_value_heads") or heads
    return int(layers * 2 * kv_heads * head_dim * dtype_bytes), False


def weight_bytes_from(index: dict[str, Any] | None, file_sizes: list[int]) -> tuple[int | None, str]:
    """Weight bytes from model.safetensors.index.json, else the .safetensors files' sizes."""
    total = (index or {}).get("metadata", {}).get("total_size")
    if total:
        return int(total), "safetensors index"
    if file_sizes:
        return sum(file_sizes), "safetensors files"
    return None, "estimate"


def model_facts(config: dict[str, Any], index: dict[str, Any] | None, file_sizes: list[int],
                dir_on_nodes: str) -> ModelFacts:
    """Everything later stages need to know about the model, from its config and weight files."""
    method, qbytes = quantization(config)
    dtype = model_dtype(config)
    bpp = qbytes or DTYPE_BYTES.get(dtype, 2.0)
    total, active = estimate_params(config)
    weights, source = weight_bytes_from(index, file_sizes)
    kv, latent = kv_bytes_per_token(config, DTYPE_BYTES.get(dtype, 2.0))
    experts, top_k, moe_layers, expert_params = moe_shape(config)
    return ModelFacts(
        architectures=list(config.get("architectures") or []), model_type=str(config.get("model_type", "")),
        dtype=dtype, quantization=method, bytes_per_param=bpp, total_params=total, active_params=active,
        weight_bytes=weights if weights is not None else int(total * bpp), weight_source=source,
        num_layers=text_config(config)["num_hidden_layers"], kv_bytes_per_token=kv, kv_latent=latent,
        dir_on_nodes=dir_on_nodes, experts=experts, experts_per_token=top_k, moe_layers=moe_layers,
        expert_params=expert_params, mtp_layers=mtp_layers(config))


# Where a config.json declares its multi-token-prediction layers, as vLLM's SpeculativeConfig.hf_config_override
# reads them for method mtp: DeepSeek-V3, GLM-4.5, Qwen3-Next and others `num_nextn_predict_layers`; Qwen3.5 (and
# Qwen3.6, the same architecture) `mtp_num_hidden_layers`, under text_config in its multimodal configs.
MTP_FIELDS = ("num_nextn_predict_layers", "mtp_num_hidden_layers")


def mtp_layers(config: dict[str, Any]) -> int:
    """The multi-token-prediction layers the model's config declares (0: none, so method mtp has nothing to run)."""
    c = text_config(config)
    return max((int(c.get(f) or 0) for f in MTP_FIELDS), default=0)


def ranks_per_node(params: Params) -> dict[str, int]:
    """Where the TP x PP ranks land: one per listed GPU (one per node without GPUs), head first."""
    left = params.serve.tensor_parallel_size * params.serve.pipeline_parallel_size
    out = {}
    for node in [params.head, *params.workers]:
        out[node.name] = min(left, len(node.gpus) or 1)
        left -= out[node.name]
    return out


def _size_bytes(size: str) -> int:
    unit = size[-1].upper()
    factor = {"K": 1 << 10, "M": 1 << 20, "G": GIB}.get(unit, 1)
    return int(size.rstrip("KMGkmg")) * factor


def served_kv_bytes_per_token(facts: ModelFacts, serve_dtype: str) -> float:
    """KV cache bytes per token (whole model) at the dtype the server was given (`auto`: the model's own)."""
    model_bytes = DTYPE_BYTES.get(facts.dtype, 2.0)
    return facts.kv_bytes_per_token * (DTYPE_BYTES[serve_dtype] if serve_dtype != "auto" else model_bytes) / model_bytes


@dataclass(frozen=True)
class Share:
    """What every rank of one split holds: its weights and its KV bytes per token."""

    weights_rank: float
    kv_token_rank: float


def split_share(facts: ModelFacts, serve: ServeSettings, tp: int, pp: int) -> Share:
    """Each rank's share of a TP x PP split, at the serve dtype (an MLA latent is whole on every TP rank)."""
    weights = facts.weight_bytes
    if serve.dtype != "auto" and facts.quantization is None:
        weights = int(weights * DTYPE_BYTES[serve.dtype] / facts.bytes_per_param)
    kv_token_rank = served_kv_bytes_per_token(facts, serve.dtype) / pp
    if not facts.kv_latent:
        kv_token_rank /= tp
    return Share(weights / (tp * pp), kv_token_rank)


def plan_share(facts: ModelFacts, params: Params) -> Share:
    """Each rank's share of the plan's TP x PP split."""
    s = params.serve
    return split_share(facts, s, s.tensor_parallel_size, s.pipeline_parallel_size)


def node_fit(name: str, ranks: int, mem: NodeMemory, share: Share, serve: ServeSettings, gpu: bool,
             needed: int) -> FitRow:
    """One node's `ranks` of a split against what CUDA can allocate there. With the KV cache sized by
    gpu_memory_utilization, vLLM asks for utilization x memory at start-up and refuses to start when less is free;
    the KV cache is what is left after weights and the reserve. `needed`: the tokens the KV cache must hold."""
    utilization = serve.gpu_memory_utilization or VLLM_DEFAULT_UTILIZATION
    w = share.weights_rank * ranks
    reserve = RESERVE_BYTES * ranks if gpu else 0  # CPU ranks: no CUDA context or graph pool
    kv: float
    if serve.kv_cache_memory_bytes:
        kv = _size_bytes(serve.kv_cache_memory_bytes) * ranks
        planned = w + kv + reserve
    else:
        planned = utilization * mem.total_bytes
        kv = max(0.0, planned - w - reserve)
    tokens = int(kv / (share.kv_token_rank * ranks)) if share.kv_token_rank else 0
    fits = planned <= mem.cuda_bytes and tokens >= needed and kv > 0
    if fits:
        why = "fits"
    elif planned > mem.cuda_bytes:
        why = (f"the plan takes {planned / GIB:.2f} GiB (weights {w / GIB:.2f}, KV {kv / GIB:.2f}, reserve "
               f"{reserve / GIB:.2f}), CUDA can allocate {mem.cuda_bytes / GIB:.2f} GiB")
    elif kv <= 0:
        why = (f"the weights ({w / GIB:.2f} GiB) and the reserve ({reserve / GIB:.2f} GiB) leave no KV cache in the "
               f"{planned / GIB:.2f} GiB utilization {utilization} takes" + (
                   f"; they alone are more than the {mem.cuda_bytes / GIB:.2f} GiB CUDA can allocate"
                   if w + reserve > mem.cuda_bytes else ""))
    else:
        why = f"KV holds {tokens} tokens, {needed} are needed"
    return FitRow(name, ranks, round(mem.total_bytes / GIB, 2), round(mem.cuda_bytes / GIB, 2),
                  round(planned / GIB, 2), round(planned / mem.cuda_bytes, 3) if mem.cuda_bytes else math.inf,
                  round(w / GIB, 3), round(kv / GIB, 3), tokens, needed, fits, why, mem.cuda_source,
                  round(mem.held_bytes / GIB, 2), mem.held_by)


def split_fit(facts: ModelFacts, params: Params, memory: dict[str, NodeMemory], needed: int) -> list[FitRow]:
    """Each node's ranks of the plan's split (`node_fit`), head first, its KV cache held to `needed` tokens."""
    share, gpu_nodes = plan_share(facts, params), {n.name for n in params.nodes if n.gpus}
    return [node_fit(name, ranks, memory[name], share, params.serve, name in gpu_nodes, needed)
            for name, ranks in ranks_per_node(params).items() if ranks and name in memory]


def memory_fit(facts: ModelFacts, params: Params, memory: dict[str, NodeMemory]) -> list[FitRow]:
    """Weights, KV cache (for one sequence of max_model_len) and the per-rank reserve per node for the planned
    split, against what CUDA can allocate there."""
    return split_fit(facts, params, memory, params.serve.max_model_len or 0)


def utilization_floor(facts: ModelFacts, params: Params, memory_bytes: dict[str, int]) -> float | None:
    """The lowest gpu_memory_utilization at which every serving node still holds its weights, the KV cache of
    max_num_seqs (or 1) sequences of max_model_len tokens (or serve.kv_cache_memory_bytes) and RESERVE_BYTES
    per rank, rounded up to 0.01; above 1.0 when a node cannot hold them at all. None where it cannot be
    known: no max_model_len (the model's own may be far longer) or no memory for a serving node."""
    serve = params.serve
    if not serve.max_model_len:
        return None
    share = plan_share(facts, params)
    kv_rank = (_size_bytes(serve.kv_cache_memory_bytes) if serve.kv_cache_memory_bytes
               else share.kv_token_rank * serve.max_model_len * (serve.max_num_seqs or 1))
    floors = []
    for name, ranks in ranks_per_node(params).items():
        if ranks == 0:
            continue
        if not memory_bytes.get(name):
            return None
        floors.append(ranks * (share.weights_rank + kv_rank + RESERVE_BYTES) / memory_bytes[name])
    return math.ceil(round(max(floors) * 100, 6)) / 100 if floors else None


def human_params(n: int) -> str:
    """1234567890 -> '1.23B'."""
    if n <= 0:
        return "0"
    exp = min(int(math.log10(n)) // 3, 4)
    return f"{n / 10 ** (3 * exp):.3g}{['', 'K', 'M', 'B', 'T'][exp]}"
