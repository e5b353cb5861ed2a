"""A copy of the session's full run in an outputs root of its own, for the lab tests that act on it (`up`, `watch`,
05 alone): what they record there leaves the full run its own outputs' deployment, which the tests after them read;
and a run from 04 on the full run's hand-offs under a cluster of its own (replicas, the layout A/B)."""
from __future__ import annotations

import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml
from pytest import TempPathFactory

from sparkbook.core.cluster.topology import container_names
from sparkbook.core.values.params import Params, load_params
from sparkbook.core.values.rundir import QUALITY
from sparkbook.core.values.stagelist import RAYCLUSTER
from sparkbook.runbook import driver
from sparkbook.runbook.driver import RunOptions
from sparkbook.runbook.manifest import Manifest


def outputs_copy(run_dir: Path, root: Path) -> Path:
    """`run_dir` and its cluster's quality/ references (05's answer checks read them beside the runs) copied under
    `root`/<cluster>/; the copy's run dir."""
    cluster = root / run_dir.parent.name
    shutil.copytree(run_dir.parent / QUALITY, cluster / QUALITY)
    return Path(shutil.copytree(run_dir, cluster / run_dir.name))


def seeded_from_04(full_run: tuple[Path, Manifest], node_shells: dict[str, Any], tmp: TempPathFactory, cluster: str,
                   serve: dict[str, Any], benchmark: dict[str, Any], secrets: tuple[str, ...] = ()
                   ) -> Iterator[tuple[Params, Path, Manifest]]:
    """A module fixture's body: the full run's params under another cluster name (its own containers and ports
    beside the full run's deployment), `serve` and `benchmark` changed, `secrets` its only secrets, run from 04 on the
    full run's hand-offs (image, model, diagnosis); yields the params, the run dir and its manifest, then removes the
    cluster's containers."""
    first_dir, first = full_run
    data = yaml.safe_load(Path(first.params_file).read_text())
    data.update(cluster=cluster, secrets=list(secrets))
    data["serve"].update(serve)
    data["benchmark"].update(benchmark)
    path = tmp.mktemp(f"{cluster}-params") / f"{cluster}.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    t0 = time.monotonic()
    run_dir, manifest = driver.execute(path, RunOptions(out_root=tmp.mktemp(f"{cluster}-outputs"), seed=first_dir,
                                                        start=RAYCLUSTER.id), say=print)
    print(f"{cluster}: from 04 in {time.monotonic() - t0:.0f} s; "
          + ", ".join(f"{nb.name} {nb.duration_s} s" for nb in manifest.notebooks if nb.status != "skipped"))
    params = load_params(path)
    yield params, run_dir, manifest
    for node, names in container_names(params).items():  # the front's own place on the head too
        node_shells[node].run(["docker", "rm", "-f", *names], check=False)
