"""The native path (issue 45): a whole run of params/lab-native.yaml (its nodes and SSH those of this lab), whose only
candidate that loads the model is shaped like the stock vLLM image since 0.19 (vLLM's ENTRYPOINT, no Ray module or
CLI). 03 chooses it and records Ray as absent and --nnodes as there, 04 forms no Ray, 05 serves the two ranks with
vLLM's own launch, 06 benchmarks it, and no Ray process runs in its containers. It runs beside the session's full run
(its own cluster name and ports), whose deployment keeps answering."""
from __future__ import annotations

import json
import os
import re
import statistics
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path

import httpx
import pytest
import yaml

from sparkbook import cli
from sparkbook.core.cluster.topology import container_name, container_names
from sparkbook.core.values.evidence import read_events
from sparkbook.core.values.params import Params, load_params
from sparkbook.lab.imagebuild import NO_RAY
from sparkbook.runbook import driver
from sparkbook.runbook.driver import RunOptions
from sparkbook.runbook.manifest import Manifest

pytestmark = pytest.mark.lab
NATIVE = Path(__file__).resolve().parents[2] / "params" / "lab-native.yaml"
# a Ray process's command line: raylet, the GCS, a `ray start`, a Ray worker (ray::...), Ray's dashboard or agents
RAY_PROCESS = re.compile(r"raylet|gcs_server|\bray(::|\s+start)|ray/(dashboard|_private)")


@pytest.fixture(scope="module")
def native(full_run, node_shells, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Params, Path, Manifest]]:
    """The whole native run; its containers removed after the module (the full run's deployment is left serving)."""
    import sparkbook.lab as sblab

    data = yaml.safe_load(NATIVE.read_text())
    lab_data = yaml.safe_load(sblab.params_file(2).read_text())
    data.update(nodes=lab_data["nodes"], ssh=lab_data["ssh"])
    data["serve"]["node_env"] = lab_data["serve"].get("node_env", {})
    # 06 runs and records; its full sweep (4 points, 2 depths: about 55 s) proves nothing here the full run's does not
    data["benchmark"].update(concurrency=[1, 2], num_prompts=4, warmup_requests=1, depths=[])
    path = tmp_path_factory.mktemp("native-params") / "lab-native.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    t0 = time.monotonic()
    run_dir, manifest = driver.execute(path, RunOptions(out_root=tmp_path_factory.mktemp("native-outputs"),
                                                        parameters={"confirm_cleanup": True}), say=print)
    print(f"native run: {time.monotonic() - t0:.0f} s; "
          + ", ".join(f"{nb.name} {nb.duration_s} s" for nb in manifest.notebooks))
    params = load_params(path)
    yield params, run_dir, manifest
    for node, names in container_names(params).items():  # the front's own place on the head too
        node_shells[node].run(["docker", "rm", "-f", *names], check=False)


def _decision(manifest: Manifest, prefix: str, key: str) -> dict:
    nb = next(n for n in manifest.notebooks if n.name.startswith(prefix))
    return next(d for d in nb.decisions if d.get("key") == key)


def test_all_six_ok_with_the_rayless_image_served_over_both_nodes(native, full_run) -> None:
    params, run_dir, manifest = native
    assert manifest.status == "ok", [(nb.name, nb.status, nb.exception) for nb in manifest.notebooks]
    state = json.loads((run_dir / "state.json").read_text())
    assert state["image"]["ref"] == NO_RAY and state["image"]["ray_version"] is None, state["image"]
    assert state["ray"]["address"] is None and set(state["ray"]["containers"]) == {"lab-0", "lab-1"}
    assert _decision(manifest, "04", "ray")["choice"] == "no Ray"
    executor = _decision(manifest, "05", "executor")
    assert executor["choice"] == "mp multi-node" and "without Ray" in executor["reason"], executor
    commands = state["endpoint"]["commands"]
    assert set(commands) == {"lab-0", "lab-1"} and "--headless" in commands["lab-1"], commands
    for argv in commands.values():
        text = " ".join(argv)
        assert "--nnodes 2" in text and "--distributed-executor-backend mp" in text, text
    reply = httpx.get(f"{state['endpoint']['base_url'].removesuffix('/v1')}/health", timeout=10)
    assert reply.status_code == 200
    first = json.loads((full_run[0] / "state.json").read_text())["endpoint"]
    assert httpx.get(f"{first['base_url'].removesuffix('/v1')}/health", timeout=10).status_code == 200, \
        "the other cluster's deployment was left alone"


def test_03_records_ray_and_nnodes_for_each_candidate(native) -> None:
    _, run_dir, _ = native
    probes = {e["data"]["facts"]["image"]: e["data"]["facts"] for e in read_events(run_dir, "image_probe")}
    stock = probes[NO_RAY]
    assert stock["ray_version"] is None and stock["ray_cli"] is None and stock["native_multinode"] is True, stock
    with_ray = next(f for image, f in probes.items() if image != NO_RAY)
    assert with_ray["ray_version"] and with_ray["ray_cli"], with_ray


def test_no_ray_process_runs_in_either_container(native, node_shells) -> None:
    """Read from /proc (the stock-shaped image has no `ps` to trust), every process of each node's container."""
    params, _, _ = native
    for spec in params.nodes:
        name = container_name(params, spec.name)
        _, cmdlines, _ = node_shells[spec.name].run([
            "docker", "exec", name, "sh", "-c",
            "for p in /proc/[0-9]*; do tr '\\0' ' ' <$p/cmdline 2>/dev/null; echo; done"])
        lines = [line for line in cmdlines.splitlines() if line.strip()]
        assert any("vllm" in line for line in lines), (spec.name, lines)
        assert not [line for line in lines if RAY_PROCESS.search(line)], (spec.name, lines)
        code, _, _ = node_shells[spec.name].run(["docker", "exec", name, "sh", "-c", "command -v ray"], check=False)
        assert code != 0, f"{spec.name}: a ray CLI in the stock-shaped image"


def test_status_reads_the_native_deployment(native, capsys: pytest.CaptureFixture[str]) -> None:
    params, run_dir, manifest = native
    code = cli.main(["status", manifest.params_file, "--outputs", str(run_dir.parent.parent)])
    out = capsys.readouterr()
    text = out.out + out.err
    print(text)
    assert code == 0 and "/health answers 200" in text and "Traceback" not in text, text
    assert text.count("not used") >= 2 and "PROBLEM" not in text, text


# pairs of runs, alternating which arm goes first (the machine's drift lands on both)
ROUNDS = int(os.environ.get("SPARKBOOK_BENCH_ROUNDS", "2"))


def _arm_figures(run_dir: Path, manifest: Manifest) -> dict[str, float]:
    """04's start to 05's server ready (05 records serve_attempts once /health answered), and 06's figures."""
    ran = [(nb.name, nb.status) for nb in manifest.notebooks if nb.name[:2] in ("04", "05", "06")]
    assert [status for _, status in ran] == ["ok"] * 3, manifest.notebooks  # a run --from 04 is partial by design
    started = next(nb.started for nb in manifest.notebooks if nb.name.startswith("04"))
    assert started is not None
    ready = read_events(run_dir, "serve_attempts")[-1]["at"]
    bench = json.loads((run_dir / "state.json").read_text())["benchmark"]
    return {"04 start to 05 ready (s)": (datetime.fromisoformat(ready) - datetime.fromisoformat(started)).seconds,
            "single-stream tok/s": bench["single_stream_output_tok_s"], "peak tok/s": bench["peak_output_tok_s"]}


@pytest.mark.benchmark
def test_ray_formed_against_vllm_s_own_launch(tmp_path: Path) -> None:
    """Issue 45, item 4: the same image, model and plan (params/lab.yaml's), 04 forming Ray (executor unset, the image
    has Ray) against forming none (serve.executor: mp); 05 serves with mp on both (the CPU build refuses the Ray
    executor), so what differs is Ray itself: its start in 04 and its processes beside the server. 01-03 first (their
    hand-offs, not measured), then ROUNDS pairs of `--from 04` runs, each after `stop` (containers gone, so 04 starts
    them), alternating which arm runs first. Reported, never asserted as timings."""
    import sparkbook.lab as sblab

    data = yaml.safe_load(sblab.params_file(2).read_text())
    arms = {"Ray formed": tmp_path / "ray.yaml", "own launch": tmp_path / "native.yaml"}
    arms["Ray formed"].write_text(yaml.safe_dump(data, sort_keys=False))
    data["serve"]["executor"] = "mp"
    arms["own launch"].write_text(yaml.safe_dump(data, sort_keys=False))
    out = tmp_path / "outputs"
    _, first = driver.execute(arms["Ray formed"], RunOptions(out_root=out, parameters={"confirm_cleanup": True},
                                                             upto="03"), say=print)
    assert [nb.status for nb in first.notebooks][:3] == ["ok"] * 3, first.notebooks
    figures: dict[str, list[dict[str, float]]] = {arm: [] for arm in arms}
    for i in range(ROUNDS):
        for arm in (list(arms) if i % 2 == 0 else list(arms)[::-1]):
            if i or arm != list(arms)[0]:  # the run before deployed a server: take it and its containers away
                assert cli.main(["stop", str(arms[arm]), "--outputs", str(out)]) == 0
            run_dir, manifest = driver.execute(arms[arm], RunOptions(out_root=out, start="04",
                                                                     parameters={"confirm_replace": True}),
                                                                     say=lambda line: None)
            figures[arm].append(_arm_figures(run_dir, manifest))
            ray = _decision(manifest, "04", "ray")["choice"]
            assert ray == ("form Ray" if arm == "Ray formed" else "no Ray"), (arm, ray)
            print(arm, figures[arm][-1])
    report = {}
    for metric in figures["Ray formed"][0]:
        ratios = sorted(b[metric] / a[metric] for a, b in zip(figures["Ray formed"], figures["own launch"],
                                                              strict=True))
        report[metric] = {arm: [f[metric] for f in figures[arm]] for arm in arms} | {
            "own launch / Ray formed: median, range": [round(statistics.median(ratios), 3), round(ratios[0], 3),
                                                       round(ratios[-1], 3)]}
    print("\n" + json.dumps(report, indent=1))
    assert cli.main(["stop", str(arms["own launch"]), "--outputs", str(out)]) == 0
