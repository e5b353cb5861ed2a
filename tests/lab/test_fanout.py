"""Fan-out benchmark (issue 4): inventory plus diagnosis on a 1-node and an 8-node lab, measured in one run.

Two levels, each timed on both sizes, alternating 1, 8, 1, 8 so that the machine's load drifts over both:
- `steps`: the functions 01 and 02 fan out over the nodes (cleanup inventory, node facts, links, model files);
- `notebooks`: 01-cleanup (plan only) and 02-diagnosis executed headless with papermill, as a user runs them.
Also the CPU the steps cost: this process's (sparkbook's side) and the machine's (every node's sshd, dockerd and
shell tools share its cores). Prints a table; speed targets are reported, not asserted (shared, noisy machine).
Leaves the default 2-node lab up again.
"""
from __future__ import annotations

import json
import os
import resource
import statistics
import time
from pathlib import Path

import papermill
import pytest

import sparkbook
import sparkbook.lab as sblab
from sparkbook.stages.cleanup import inventory
from sparkbook.stages.diagnose import checks

pytestmark = [pytest.mark.lab, pytest.mark.benchmark]
REPO = Path(__file__).resolve().parents[2]
SIZES = (1, 8, 1, 8)
STEP_REPEATS = 3


def _machine_cpu_s() -> float:
    fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    busy = sum(int(v) for i, v in enumerate(fields) if i not in (3, 4))  # all but idle and iowait
    return busy / os.sysconf("SC_CLK_TCK")


def _own_cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _steps(params_file: Path, run_dir: Path) -> dict[str, float]:
    run = sparkbook.open_run(params_file, run_dir, stage="fan-out bench")
    t0, own0, all0 = time.monotonic(), _own_cpu_s(), _machine_cpu_s()
    outcomes = [inventory.inventory_all(run.context()), checks.facts_all(run.context()),
                checks.links_all(run.context()), checks.model_files_all(run.context())]
    wall, own, machine = time.monotonic() - t0, _own_cpu_s() - own0, _machine_cpu_s() - all0
    run.close()
    failed = [f"{n}: {o.error}" for step in outcomes for n, o in step.items() if not o.ok]
    assert not failed, failed
    return {"wall_s": wall, "sparkbook_cpu_s": own, "machine_cpu_s": machine}


def _notebooks(params_file: Path, run_dir: Path) -> float:
    run_dir.mkdir(parents=True)
    t0 = time.monotonic()
    for name in ("01-cleanup.ipynb", "02-diagnosis.ipynb"):
        papermill.execute_notebook(str(REPO / "notebooks" / name), str(run_dir / name), kernel_name="python3",
                                   parameters={"params_file": str(params_file), "run_dir": str(run_dir)},
                                   cwd=str(REPO / "notebooks"), progress_bar=False, execution_timeout=600)
    return time.monotonic() - t0


def test_fan_out_8_nodes_against_1(lab, lab_progress, tmp_path: Path) -> None:
    os.environ["SPARKBOOK_HEADLESS"] = "1"
    rows = []
    try:
        for i, n in enumerate(SIZES):
            sblab.down(lab_progress)
            assert sblab.up(n, lab_progress).healthy
            params_file = sblab.params_file(n)
            steps = [_steps(params_file, tmp_path / f"steps-{i}-{k}") for k in range(STEP_REPEATS)]
            notebooks_s = _notebooks(params_file, tmp_path / f"notebooks-{i}")
            row = {"nodes": n, "load_1min": os.getloadavg()[0], "notebooks_s": notebooks_s,
                   **{k: statistics.median(s[k] for s in steps) for k in steps[0]}}
            lab_progress(json.dumps(row))
            rows.append(row)
    finally:
        sblab.down(lab_progress)
        sblab.up(2, lab_progress)

    def median(n: int, key: str) -> float:
        return statistics.median(r[key] for r in rows if r["nodes"] == n)

    print("| nodes | steps wall s | sparkbook CPU s | machine CPU s | notebooks 01+02 s | load |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['nodes']} | {r['wall_s']:.2f} | {r['sparkbook_cpu_s']:.2f} | {r['machine_cpu_s']:.2f} "
              f"| {r['notebooks_s']:.1f} | {r['load_1min']:.1f} |")
    for key in ("wall_s", "notebooks_s", "machine_cpu_s"):
        print(f"8 nodes / 1 node, {key}: {median(8, key) / median(1, key):.2f}x")
    (tmp_path / "fanout.json").write_text(json.dumps(rows, indent=1))
    assert len(rows) == len(SIZES)
