"""The out-of-memory signatures of a unified-memory node (issue 33 item 3), each on real log text with its source,
and the ladder they share: one serve.utilization_step at a time while 02's fit holds, then eager."""
from __future__ import annotations

import pytest

from sparkbook.core.values.params import ServeSettings
from sparkbook.stages.serve.failures import FREE_MEMORY, GRAPH_OOM, OOM_KILL, REG_MR, classify, remedy

# pytorch/pytorch#175666 (vLLM's start-up check, vllm/v1/worker/utils.py), verbatim.
FREE = ("[2026-02-24T20:21:58Z] (EngineCore_DP0 pid=6940) ValueError: Free memory on device cuda:1 (19.77/22.05 GiB) "
        "on startup is less than desired GPU memory utilization (0.9, 19.84 GiB). Decrease GPU memory utilization or "
        "reduce GPU memory used by other processes.")
# LMCache/LMCache#4759: dmesg of a GB10 head during a vLLM cold boot (the victim there is `lmcache`), verbatim.
DMESG_OTHER = (
    "[Thu Aug 27 00:39:44 2026] oom-kill:constraint=CONSTRAINT_NONE,...,task_memcg=/system.slice/docker-9751845b....s"
    "cope,task=lmcache,pid=3742074,uid=0\n"
    "[Thu Aug 27 00:39:44 2026] Out of memory: Killed process 3742074 (lmcache) total-vm:81306880kB, "
    "anon-rss:1058560kB, file-rss:21412kB, shmem-rss:428kB, UID:0 pgtables:28484kB oom_score_adj:0")
# The same kernel lines (mm/oom_kill.c's formats) with the victim a vLLM process: its comm as the kernel truncates it.
DMESG_VLLM = DMESG_OTHER.replace("lmcache", "VLLM::EngineCor")
# NVIDIA/nccl-tests#206, the title (NCCL's misc/ibvwrap.cc), verbatim.
REG = "misc/ibvwrap.cc:278 NCCL WARN Call to ibv_reg_mr_iova2 failed with error Cannot allocate memory"
# vllm-project/vllm#19186 (a V1 worker's graph capture ending in the CUDA driver's OOM), verbatim excerpt.
GRAPH = ("(VllmWorker rank=3 pid=1090) ERROR 06-05 06:18:13 [multiproc_executor.py:470]     with "
         "torch.cuda.graph(cudagraph, pool=self.graph_pool):\n"
         "(VllmWorker rank=3 pid=1090) ERROR 06-05 06:18:13 [multiproc_executor.py:470] RuntimeError: CUDA error: out "
         "of memory")
WORKER_DIED = "RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}"


@pytest.mark.parametrize("text, cause, words", [
    (FREE, FREE_MEMORY, ("page cache", "gpu_memory_utilization")),
    (DMESG_VLLM, OOM_KILL, ("unified memory", "runtime.memory_limit")),
    (REG, REG_MR, ("memlock", "gpu_memory_utilization")),
    (GRAPH, GRAPH_OOM, ("enforce-eager",)),
], ids=["free-memory", "oom-kill", "ibv_reg_mr", "graph-capture"])
def test_each_memory_signature_beats_the_worker_death_it_causes(text, cause, words):
    d = classify({"spark-0": WORKER_DIED, "spark-1": "INFO loading\n" + text + "\n" + WORKER_DIED})
    assert (d.cause, d.node) == (cause, "spark-1")
    assert d.evidence in text.splitlines()[-1] or d.evidence in text
    assert all(w in d.remediation for w in words), d.remediation


def test_an_oom_kill_of_another_process_is_not_the_servers():
    assert classify({"spark-0": DMESG_OTHER + "\n" + WORKER_DIED}).cause == "worker died"


@pytest.mark.parametrize("text", [FREE, DMESG_VLLM, REG, GRAPH])
def test_every_memory_cause_steps_down_while_the_fit_holds_then_goes_eager(text):
    cause = classify({"spark-0": text})
    settings, changes = ServeSettings(gpu_memory_utilization=0.8), []
    while (fix := remedy(cause, settings, floor=0.7)) is not None:
        changes.append(fix.change)
        settings = fix.settings
    assert changes == [{"gpu_memory_utilization": 0.75}, {"gpu_memory_utilization": 0.7}, {"enforce_eager": True}]
