"""05's memory checks as pure logic: the kernel's recent lines picked by dmesg's own clock, the settle verdict with
the figures and holders it names, and the refit that stops 05 before any weight loads."""
from __future__ import annotations

import pytest

from sparkbook.core.values.modelinfo import GIB, FitRow
from sparkbook.stages.serve import commands, memory

# LMCache/LMCache#4759's two kernel lines (mm/oom_kill.c), with dmesg's default clock (seconds since boot) in place
# of the issue's `dmesg -T` dates; the uptime line is /proc/uptime's format.
KERNEL = """\
90123.45 170000.00
[90000.100000] eth0: link up
[90110.200000] oom-kill:constraint=CONSTRAINT_NONE,...,task_memcg=/system.slice/docker-9751845b....scope,task=lmcache,pid=3742074,uid=0
[90110.200100] Out of memory: Killed process 3742074 (lmcache) total-vm:81306880kB, anon-rss:1058560kB, file-rss:21412kB, shmem-rss:428kB, UID:0 pgtables:28484kB oom_score_adj:0
"""  # noqa: E501 (kernel lines as written)


def test_only_the_kernel_lines_of_the_attempt_are_kept():
    lines = memory.recent_kernel_lines(KERNEL, since_s=60)
    assert len(lines) == 2 and lines[1].startswith("Out of memory: Killed process 3742074 (lmcache)")
    assert memory.recent_kernel_lines(KERNEL, since_s=5) == []
    assert memory.recent_kernel_lines("dmesg: read kernel buffer failed: Operation not permitted", 60) == []


def _settle(after: float) -> memory.Settle:
    before = {"spark-0": int(100 * GIB), "spark-1": int(100 * GIB)}
    return memory.Settle(2, before, {"spark-0": int(40 * GIB), "spark-1": int(99 * GIB)},
                         {"spark-0": int(after * GIB), "spark-1": int(99.5 * GIB)}, 120.0, 2.0,
                         {"spark-0": ["container sparkbook-ray: pid 77 61.00 GiB vllm serve"]})


def test_memory_back_within_settle_gib_settles():
    s = _settle(98.5)
    assert s.ok and s.problem() is None
    assert [r["settled"] for r in s.rows()] == [True, True]


def test_memory_still_held_names_the_node_figures_and_holder():
    s = _settle(61.0)
    assert s.unsettled() == ["spark-0"]
    problem = s.problem()
    assert problem is not None and "after attempt 2 within 120 s" in problem
    assert "spark-0: MemAvailable 61.00 GiB against 100.00 before the launch" in problem
    assert "pid 77 61.00 GiB vllm serve" in problem and "spark-1" not in problem
    rows = s.rows()
    assert (rows[0]["after failure GiB"], rows[0]["after settle GiB"], rows[0]["settled"]) == (40.0, 61.0, False)


def _row(node: str, fits: bool) -> FitRow:
    return FitRow(node, 1, 121.7, 95.2 if fits else 40.1, 97.4, 1.0, 59.5, 30.0, 300000, 32768, fits,
                  "" if fits else "planned 97.40 GiB, CUDA can allocate 40.10 GiB", "unified memory")


def test_a_fit_that_no_longer_holds_stops_05_with_both_figures():
    memory.check_fit(memory.BeforeLaunch({"a": 1}, ["a"], [], [_row("a", True)]))
    with pytest.raises(commands.ServeError, match="b: the plan takes 97.4 GiB, CUDA can allocate 40.1 GiB now"):
        memory.check_fit(memory.BeforeLaunch({"a": 1, "b": 1}, ["a", "b"], [], [_row("a", True), _row("b", False)]))
