"""03's GPU operation: launch kernels of a candidate image on a node's GPU before choosing it.

    probe_gpu_op(ctx, image, node) -> GpuOp      a small matmul (the image's torch) and one vLLM kernel (vllm._C)
    kernel_mismatch(op) -> str | None            "this image's kernels do not run on <GPU> (sm_xx)", or None

Why: the architecture list torch was built with can be unreadable, lie (a TORCH_CUDA_ARCH_LIST set in the image
but not honoured by every extension), or cover torch but not vLLM's own kernels; then `vllm serve` loads the weights
for minutes and dies with "no kernel image is available for execution on the device". One kernel launch says it in
seconds. Real error texts: tests/unit/data/kernel-image-errors.txt.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

from ...core.cluster.context import Context
from ...core.cluster.imageprobes import run_probe
from ...core.cluster.nodes import Node

GPU_OP_TIMEOUT_S = 300  # a first CUDA context plus torch's lazy module loading; minutes on a cold GB10 page cache
# What CUDA and torch say when a binary holds no code for the device's architecture (and no PTX the driver could
# compile for it). "invalid device function" is the same failure from older CUDA runtimes and from kernels that
# exist for another architecture only.
KERNEL_ERRORS = ("no kernel image is available for execution on the device", "cudaErrorNoKernelImageForDevice",
                 "is not compatible with the current PyTorch installation", "invalid device function")


@dataclass(frozen=True)
class GpuOp:
    """One candidate's GPU operation on one node: the device, each step's time, and what failed (None: nothing)."""

    image: str
    node: str
    device: str | None
    capability: str | None
    matmul_ms: float | None
    vllm_op: str | None  # "ran" | "absent: ..." | the error text | None (torch failed first)
    vllm_op_ms: float | None
    error: str | None  # torch's error or the probe's own (timeout, no document)
    warnings: tuple[str, ...]
    duration_s: float

    @property
    def failure(self) -> str | None:
        """The operation's first error (torch's, the probe's, or vLLM's kernel); None where it ran. An image
        without vllm._C (a CPU build) or without the op is not a failure: there is no vLLM kernel to launch."""
        if self.error is not None:
            return self.error
        if self.vllm_op is None or self.vllm_op == "ran" or self.vllm_op.startswith("absent"):
            return None
        return self.vllm_op

    def cell(self) -> str:
        """The candidates table's cell: what ran, in how long."""
        if self.failure is not None:
            return f"failed: {self.failure.strip().splitlines()[-1][:160]} ({self.duration_s:.1f} s)"
        vllm = "vLLM op ran" if self.vllm_op == "ran" else "no vLLM op in the image"
        return f"matmul {self.matmul_ms} ms, {vllm}" + (f" {self.vllm_op_ms} ms" if self.vllm_op == "ran" else "") + \
            f" ({self.duration_s:.1f} s)"


def probe_gpu_op(ctx: Context, image: str, node: Node) -> GpuOp:
    """The GPU operation in a fresh container of `image` on `node` (with its GPUs, as every probe of 03)."""
    t0 = time.monotonic()
    doc, error = run_probe(ctx, image, "gpu_op", [], node=node, timeout=GPU_OP_TIMEOUT_S)
    return GpuOp(image=image, node=node.name, device=doc.get("device"), capability=doc.get("capability"),
                 matmul_ms=doc.get("matmul_ms"), vllm_op=doc.get("vllm_op"), vllm_op_ms=doc.get("vllm_op_ms"),
                 error=error or doc.get("torch_error"), warnings=tuple(doc.get("warnings") or ()),
                 duration_s=round(time.monotonic() - t0, 2))


def kernel_mismatch(op: GpuOp) -> str | None:
    """Why the image cannot run on the node's GPU, where a kernel launch (torch's or vLLM's) found no code for its
    architecture; None where the kernels ran or failed for another reason."""
    failure = op.failure
    if failure is None:
        return None
    line = next((ln.strip() for text in (failure, *op.warnings) for ln in text.splitlines()
                 if any(sig in ln for sig in KERNEL_ERRORS)), None)
    if line is None:
        return None
    sm = f"sm_{op.capability.replace('.', '')}" if op.capability else "its architecture"
    which = "vLLM's compiled kernels" if op.error is None else "torch's kernels"
    return f"this image's kernels do not run on {op.device or 'the GPU'} of {op.node} ({sm}): {which} failed with " \
           f"\"{line[:200]}\""
