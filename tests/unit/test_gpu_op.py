"""03's GPU operation: a kernel launch that finds no code for the GPU blocks the image, naming the GPU and its
sm_xx; any other failure (the node's driver, a busy GPU) is a finding, not held against the image. Error texts are
real (tests/unit/data/kernel-image-errors.txt, cuda-driver-errors.txt)."""
from __future__ import annotations

from pathlib import Path

import pytest

from sparkbook.core.cluster import probes
from sparkbook.stages.images.choice import ImageVerdict, with_gpu_op
from sparkbook.stages.images.gpuop import GpuOp, kernel_mismatch

DATA = Path(__file__).parent / "data"


def lines(name: str) -> list[str]:
    return [ln for ln in (DATA / name).read_text().splitlines() if ln and not ln.startswith("#")]


def op(error: str | None = None, vllm_op: str | None = "ran", warnings: tuple[str, ...] = ()) -> GpuOp:
    return GpuOp(image="img:1", node="spark-1", device="NVIDIA GB10", capability="12.1", matmul_ms=None if error else
                 2.5, vllm_op=None if error else vllm_op, vllm_op_ms=0.4 if vllm_op == "ran" else None, error=error,
                 warnings=warnings, duration_s=3.2)


VERDICT = ImageVerdict("img:1", "loads", "vLLM 0.17 resolves X natively", [], [])


@pytest.mark.parametrize("text", lines("kernel-image-errors.txt"))
def test_every_recorded_kernel_error_of_torch_blocks_the_image_naming_gpu_and_sm(text):
    why = kernel_mismatch(op(error=text))
    assert why is not None and "NVIDIA GB10 of spark-1 (sm_121)" in why and "torch's kernels" in why
    verdict = with_gpu_op(VERDICT, op(error=text))
    assert not verdict.usable and verdict.blocking == [why]


def test_vllm_kernel_without_code_for_the_gpu_is_named_as_vllms():
    trace = ("Traceback (most recent call last):\n  File \"<string>\", line 58, in vllm_op\n"
             "torch.AcceleratorError: CUDA error: no kernel image is available for execution on the device\n")
    why = kernel_mismatch(op(vllm_op=trace))
    assert why is not None and "vLLM's compiled kernels" in why and "sm_121" in why
    assert "failed: torch.AcceleratorError" in op(vllm_op=trace).cell()


@pytest.mark.parametrize("text", [*lines("cuda-driver-errors.txt"),
                                  "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 MiB"])
def test_other_failures_are_a_finding_not_a_rejection(text):
    assert kernel_mismatch(op(error=text)) is None
    verdict = with_gpu_op(VERDICT, op(error=text))
    assert verdict.usable and verdict.flags[0].startswith("the GPU operation on spark-1 failed, not for want of")


def test_the_compatibility_warning_alone_does_not_block_when_the_kernels_ran():
    warned = op(warnings=("NVIDIA GB10 with CUDA capability sm_121 is not compatible with the current PyTorch "
                          "installation.",))
    assert kernel_mismatch(warned) is None and with_gpu_op(VERDICT, warned) == VERDICT


def test_an_image_without_vllm_ops_ran_its_matmul():
    cpu_build = op(vllm_op="absent: ModuleNotFoundError: No module named 'vllm._C'")
    assert cpu_build.failure is None and cpu_build.cell().startswith("matmul 2.5 ms, no vLLM op in the image")


def test_probe_program_is_whole_python_printing_one_document():
    source = probes.source("gpu_op")
    compile(source, "gpu_op", "exec")
    assert "SPARKBOOK-JSON" in source and "silu_and_mul" in source
