"""Replies come back whole under load (issue 20): many commands at once on every node of an 8-node lab, each
printing a known amount to stdout and stderr and exiting at once, read through sparkbook's own `Node.run` and
compared byte for byte.

The 8 nodes are a separate lab beside the suite's own (SPARKBOOK_STRESS_LAB_ID, default SPARKBOOK_LAB_ID + 1),
brought up bare: the nodes' namespaces, sshd and dockerd only (`cluster.start`), no images, models or old
deployment, since the test needs nothing but SSH (about 1.5 s up and 1.5 s down on an idle machine). It is taken
down afterwards unless it was up before the test.
"""
from __future__ import annotations

import functools
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from sparkbook.core.cluster.nodes import Cluster, Node, shell
from sparkbook.core.values.params import load_params

pytestmark = pytest.mark.lab
# the lab beside the suite's own (SPARKBOOK_LAB_ID, default 0): by default the next id
LAB_ID = os.environ.get("SPARKBOOK_STRESS_LAB_ID", str(int(os.environ.get("SPARKBOOK_LAB_ID", "0")) + 1))
NODES = 8
PER_NODE = 24   # commands at once on each node (the overlap that cut 54 of 144 replies on 2 nodes)
SIZES = (2_000, 20_000, 120_000, 300_000)  # `seq 1 N` lines: 8.9 KB, 109 KB, 786 KB, 2.1 MB
ROUNDS = 3
REPLY = "seq 1 {out}; seq 1 {err} >&2"


def _in_lab(code: str, timeout: float) -> str:
    """Run python `code` with the stress lab's id (the lab module reads it at import) and return its stdout."""
    env = {**os.environ, "SPARKBOOK_LAB_ID": LAB_ID}
    return subprocess.run([sys.executable, "-c", code], env=env, check=True, capture_output=True, text=True,
                          timeout=timeout).stdout.strip()


@pytest.fixture(scope="module")
def stress_lab(lab_progress):
    """(params file, seconds the bring-up took) of a bare 8-node lab; taken down after unless it was up."""
    if os.geteuid() != 0:
        pytest.skip("the lab needs root")
    was_up = _in_lab("from sparkbook.lab import cluster; print(cluster.state_file().exists())", 30) == "True"
    t0 = time.monotonic()
    params = Path(_in_lab(f"import sparkbook.lab as lab; from sparkbook.lab import cluster, host\n"
                          f"host.ensure_host(); cluster.start({NODES}); print(lab.params_file({NODES}))", 600))
    setup_s = time.monotonic() - t0
    lab_progress(f"lab {LAB_ID}: {NODES} bare nodes up in {setup_s:.1f} s")
    yield params, setup_s
    if not was_up:
        t0 = time.monotonic()
        _in_lab("import sparkbook.lab as lab; lab.down()", 300)
        lab_progress(f"lab {LAB_ID}: down in {time.monotonic() - t0:.1f} s")


@functools.cache
def _expected(n: int) -> str:
    return "".join(f"{i}\n" for i in range(1, n + 1))


def _one(node: Node, out: int, err: int) -> str | None:
    """None when the reply is whole, else what was wrong with it."""
    r = node.run(shell(REPLY, out=out, err=err), timeout=60)
    if r.ok and r.stdout == _expected(out) and r.stderr == _expected(err):
        return None
    return (f"{node.name} seq {out}/{err}: exit {r.exit_code}, timed out {r.timed_out}, stdout "
            f"{len(r.stdout)}/{len(_expected(out))} B, stderr {len(r.stderr)}/{len(_expected(err))} B")


def test_replies_whole_under_load(stress_lab, lab_progress) -> None:
    params_file, _ = stress_lab
    cluster = Cluster(load_params(params_file))
    jobs = [(node, SIZES[i % len(SIZES)], SIZES[-1 - i % len(SIZES)]) for node in cluster for i in range(PER_NODE)]
    cut: list[str] = []
    try:
        with ThreadPoolExecutor(max_workers=len(jobs)) as pool:
            list(pool.map(lambda node: node.client(), cluster))  # connect first: the load is on the replies
            for k in range(ROUNDS):
                t0 = time.monotonic()
                bad = [b for b in pool.map(lambda job: _one(*job), jobs) if b]
                lab_progress(f"round {k + 1}: {len(bad)} of {len(jobs)} replies cut in {time.monotonic() - t0:.1f} s"
                             f", load {os.getloadavg()[0]:.1f}")
                cut += bad
    finally:
        cluster.close()
    assert not cut, f"{len(cut)} of {ROUNDS * len(jobs)} replies cut: {cut[:10]}"
