"""The runbook a second time on top of the first (the session's `full_run`), 01 to 05: it succeeds, keeps what is
already right (image on every node, the Ray cluster, the server) and says so in its records. 06 is left out of the
second run: it benchmarks the same server again and decides nothing about reuse (06's comparison with an earlier run
is nbval's 06 against `make runbook`'s and the A/B's)."""
from __future__ import annotations

import json
import os
import shutil
import tarfile
import time
from pathlib import Path

import httpx
import pytest
import yaml

from sparkbook.core.cluster.topology import container_name
from sparkbook.core.values.evidence import read_events
from sparkbook.core.values.params import load_params
from sparkbook.core.values.rundir import QUALITY
from sparkbook.runbook import driver
from sparkbook.runbook.driver import RunOptions
from sparkbook.runbook.manifest import Manifest

pytestmark = pytest.mark.lab
_INSPECT = "{{.Id}} {{.State.StartedAt}} {{.Image}}"


def _node_state(node_shells, params, run_dir: Path) -> dict[str, tuple[str, ...]]:
    """Per node: its container's ID, start time and image ID, and the PID of its `vllm serve` (if any)."""
    endpoint = json.loads((run_dir / "state.json").read_text())["endpoint"]
    out = {}
    for spec in params.nodes:
        name = container_name(params, spec.name)
        _, inspect, _ = node_shells[spec.name].run(["docker", "inspect", "-f", _INSPECT, name])
        log = endpoint["logs"].get(spec.name)
        pid = node_shells[spec.name].run(["docker", "exec", name, "cat", f"{log}.pid"])[1].strip() if log else "-"
        out[spec.name] = (*inspect.split(), pid)
    return out


@pytest.fixture(scope="module")
def second(full_run, node_shells, planted: str, tmp_path_factory: pytest.TempPathFactory):
    """The node state after the first run, the second run (same params, confirmed, secret planted), the state
    after it, and its wall time."""
    first_dir, first = full_run
    assert first.status == "ok", "the first run must succeed before a second can reuse it"
    params = load_params(first.params_file)
    before = _node_state(node_shells, params, first_dir)
    out_root = tmp_path_factory.mktemp("second")
    shutil.copytree(first_dir.parent / QUALITY, out_root / params.cluster / QUALITY)  # a later run of the cluster
    os.environ["HF_TOKEN"] = os.environ["VLLM_API_KEY"] = planted
    t0 = time.monotonic()
    try:
        run_dir, manifest = driver.execute(Path(first.params_file), RunOptions(out_root=out_root, upto="05",
                                                                               parameters={"confirm_cleanup": True}),
                                           say=print)
    finally:
        del os.environ["HF_TOKEN"], os.environ["VLLM_API_KEY"]
    seconds = time.monotonic() - t0
    print(f"second run: {seconds:.0f} s; " + ", ".join(f"{nb.name} {nb.duration_s} s" for nb in manifest.notebooks))
    return params, before, run_dir, manifest, _node_state(node_shells, params, run_dir), seconds


def _decision(manifest: Manifest, prefix: str, question: str) -> dict:
    nb = next(nb for nb in manifest.notebooks if nb.name.startswith(prefix))
    return next(d for d in nb.decisions if d["question"] == question)


def test_second_run_succeeds(second) -> None:
    _, _, _, manifest, _, _ = second
    assert [nb.status for nb in manifest.notebooks if not nb.status.startswith("skipped")] == ["ok"] * 5, \
        json.dumps([nb.exception for nb in manifest.notebooks], indent=1)
    assert [nb.name for nb in manifest.notebooks if nb.status == "ok"] == driver.notebook_names()[:5]


def test_the_second_run_s_answers_agree_with_the_first_run_s_reference(full_run, second) -> None:
    """Issue 41, item 2: the first run recorded the greedy tokens of its model and plan; the second (the same
    server, reused) compares with them and passes, every top-1 token the same."""
    first_dir, _ = full_run
    _, _, run_dir, _, _, _ = second
    (check,) = [e["data"] for e in read_events(run_dir, "quality_check")]
    assert check["problem"] is None and check["reference"]["run"] == first_dir.name and check["recorded"] is None
    assert check["agreement"] and all(r["share"] == "100%" for r in check["agreement"]), check["agreement"]


def test_02_counts_what_the_first_run_s_server_holds_as_free(full_run, second) -> None:
    """Issue 40, item 2: the server the second run would replace or keep is the runbook's own: 05 measured what it
    holds once ready (the lab's vLLM holds host RAM: MemAvailable), and the second 02 counts it free, naming it."""
    first_dir, _ = full_run
    _, _, run_dir, _, _, _ = second
    (held,) = [e["data"] for e in read_events(first_dir, "memory_held_by_server")]
    (fit,) = [e["data"] for e in read_events(run_dir, "memory_fit")]
    assert {r["node"]: r["held_by"] for r in fit} == {n: first_dir.name for n in held}, (fit, held)
    assert all(r["held_gib"] > 0 for r in fit) and all(b > 0 for b in held.values()), (fit, held)
    assert "held by our running server GiB" in (run_dir / "02-diagnosis.ipynb").read_text()


def test_same_image_id_on_every_node_and_nothing_copied(full_run, second) -> None:
    first_dir, _ = full_run
    _, _, run_dir, _, _, _ = second
    first_image = json.loads((first_dir / "state.json").read_text())["image"]
    image = json.loads((run_dir / "state.json").read_text())["image"]
    assert image["id"] == first_image["id"] and set(image["nodes"].values()) == {image["id"]}
    copied = [e["data"] for e in read_events(run_dir, "distribution")]
    assert copied and copied[-1]["copies"] == [] and copied[-1]["ids"] == image["nodes"], copied
    assert "nothing copied" in (run_dir / "03-image-selection.ipynb").read_text()


def test_ray_cluster_is_reused_not_recreated(second) -> None:
    _, before, run_dir, manifest, after, _ = second
    decision = _decision(manifest, "04", "Reuse the running Ray cluster or start a new one?")
    assert decision["choice"].startswith("reused"), decision
    assert json.loads((run_dir / "state.json").read_text())["ray"]["reused"] is True
    assert {n: v[:3] for n, v in after.items()} == {n: v[:3] for n, v in before.items()}, \
        "container IDs, start times and images are unchanged"
    assert "reused: the running cluster" in (run_dir / "04-ray-cluster.ipynb").read_text()


def test_server_is_reused_and_still_answers(second, planted: str) -> None:
    params, before, run_dir, manifest, after, _ = second
    decision = _decision(manifest, "05", "Reuse the running server or start a new one?")
    assert decision["choice"].startswith("reused"), decision
    endpoint = json.loads((run_dir / "state.json").read_text())["endpoint"]
    assert endpoint["reused"] is True
    assert {n: v[3] for n, v in after.items()} == {n: v[3] for n, v in before.items()}, "same vllm serve PIDs"
    assert "reused: the server already running" in (run_dir / "05-serve.ipynb").read_text()
    reply = httpx.post(f"{endpoint['base_url']}/v1/completions", timeout=120,
                       headers={"Authorization": f"Bearer {planted}"},
                       json={"model": params.model.served_name, "prompt": "Hello", "max_tokens": 8})
    assert reply.status_code == 200 and reply.json()["choices"][0]["text"]


def test_first_run_chose_the_new_image_and_copied_it_to_the_worker_only(full_run) -> None:
    """03 on the lab's three candidates, as its notebook shows them: the old image does not know the model's
    architecture, the grafted one registers it but fails inspection on a missing kernel; the new one is chosen and
    copied to the worker alone (as the delta of the layers it lacks). The second run copies nothing (above)."""
    run_dir, _ = full_run
    text = (run_dir / "03-image-selection.ipynb").read_text()
    assert "not registered" in text and "registered, fails inspection" in text
    assert "failed to be inspected" in text and "hpc_gated_mla_gemm" in text
    assert "Chosen: **sparkbook-lab/vllm-openai-cpu:0.32.0**" in text
    copied = [e["data"] for e in read_events(run_dir, "distribution")][-1]
    assert [c["node"] for c in copied["copies"]] == ["lab-1"] and len(set(copied["ids"].values())) == 1, copied
    image = json.loads((run_dir / "state.json").read_text())["image"]
    assert image["ref"] == "sparkbook-lab/vllm-openai-cpu:0.32.0" and set(image["nodes"].values()) == {image["id"]}


def test_first_run_records_that_it_started_afresh(full_run) -> None:
    _, manifest = full_run
    assert _decision(manifest, "04", "Reuse the running Ray cluster or start a new one?")["choice"] == \
        "start new containers and Ray"
    assert _decision(manifest, "05", "Reuse the running server or start a new one?")["choice"] == "start vllm serve"


def test_planted_secret_is_in_nothing_the_second_run_wrote(second, node_shells, planted: str) -> None:
    """Its run dir and archive (decompressed), the logs the runs left in the node containers, and (issue 43, item 3:
    the key and HF_TOKEN of the serving processes) no `ps` line on any node and no `docker inspect` of a node
    container."""
    params, _, run_dir, _, _, _ = second
    for path in run_dir.rglob("*"):
        if path.is_file():
            assert planted.encode() not in path.read_bytes(), path
    with tarfile.open(driver.pack_run(run_dir)) as tar:
        for member in tar.getmembers():
            if member.isfile():
                assert planted.encode() not in tar.extractfile(member).read(), member.name
    for spec in params.nodes:
        _, logs, _ = node_shells[spec.name].run(["docker", "exec", container_name(params, spec.name), "sh", "-c",
                                                  "cat /tmp/sparkbook/logs/*"])
        assert logs and planted not in logs, spec.name
        _, ps, _ = node_shells[spec.name].run(["ps", "-eo", "args"])
        _, inspected, _ = node_shells[spec.name].run(["docker", "inspect", container_name(params, spec.name)])
        assert "vllm" in ps and planted not in ps, spec.name
        assert container_name(params, spec.name) in inspected and planted not in inspected, spec.name


def _serves(endpoint: dict, planted: str) -> dict:
    """The head's serving record (reuse.SERVING) after a completion through the API with the key."""
    reply = httpx.post(f"{endpoint['base_url']}/v1/completions", timeout=120,
                       headers={"Authorization": f"Bearer {planted}"},
                       json={"model": endpoint["model"], "prompt": "Hello", "max_tokens": 4})
    assert reply.status_code == 200 and reply.json()["choices"][0]["text"], reply.text
    return reply.json()


def test_a_changed_plan_replaces_only_when_confirmed_and_rolls_back(full_run, node_shells, planted: str,
                                                                    tmp_path: Path) -> None:
    """05 alone, resumed on a copy of the first run's dir with a changed serve setting: without confirm_replace
    it stops with the diff and the first server untouched and answering; confirmed, with an argument vLLM
    refuses, it stops before the stop (the image's vLLM parsed the argv: 0 s without service, same PIDs); confirmed,
    with a max_model_len beyond the model's that only the engine's start refuses, the new plan fails after the stop
    and the first run's plan serves again, the record naming the rollback and the seconds without service. Last in
    this module but one: it restarts the server the tests above reuse."""
    first_dir, first = full_run
    params = load_params(first.params_file)
    copy = tmp_path / params.cluster / first_dir.name
    shutil.copytree(first_dir, copy)
    endpoint = json.loads((first_dir / "state.json").read_text())["endpoint"]
    before = _node_state(node_shells, params, first_dir)
    data = yaml.safe_load(Path(first.params_file).read_text())
    assert data["serve"]["max_num_seqs"] == 16
    data["serve"]["max_num_seqs"] = 8
    changed = _write(tmp_path / "changed.yaml", data)
    planted_flag = _write(tmp_path / "planted-flag.yaml", {**data, "serve": {
        **data["serve"], "extra_args": [*data["serve"]["extra_args"], "--planted-unknown-flag"]}})
    too_long = _write(tmp_path / "too-long.yaml", {**data, "serve": {**data["serve"], "max_model_len": 8192}})
    os.environ["HF_TOKEN"] = os.environ["VLLM_API_KEY"] = planted
    try:
        _, refused = driver.execute(changed, RunOptions(resume=copy, only="05"), say=print)
        after_refusal = _node_state(node_shells, params, first_dir)
        _serves(endpoint, planted)
        _, parsed = driver.execute(planted_flag, RunOptions(resume=copy, only="05",
                                                            parameters={"confirm_replace": True}), say=print)
        after_parse = _node_state(node_shells, params, first_dir)
        _serves(endpoint, planted)
        t0 = time.monotonic()
        _, rolled = driver.execute(too_long, RunOptions(resume=copy, only="05", parameters={"confirm_replace": True}),
                                   say=print)
        print(f"replace + rollback: {time.monotonic() - t0:.0f} s")
    finally:
        del os.environ["HF_TOKEN"], os.environ["VLLM_API_KEY"]
    nb = next(n for n in refused.notebooks if n.name.startswith("05"))
    assert nb.status == "failed" and "left untouched" in nb.exception["evalue"], nb.exception
    assert "serve.max_num_seqs: '16' -> '8'" in nb.exception["evalue"] and first_dir.name in nb.exception["evalue"]
    assert after_refusal == before, "the first server's vllm serve PIDs are unchanged"
    nb = next(n for n in parsed.notebooks if n.name.startswith("05"))
    assert nb.status == "failed" and "refuses the new `vllm serve` arguments" in nb.exception["evalue"], nb.exception
    assert "planted-unknown-flag" in nb.exception["evalue"] and after_parse == before, "nothing stopped"
    nb = next(n for n in rolled.notebooks if n.name.startswith("05"))
    assert nb.status == "failed" and f"rolled back to run {first_dir.name}" in nb.exception["evalue"], nb.exception
    checked = [e["data"] for e in read_events(copy, "serve_args_checked")]
    assert checked and checked[-1]["refused"] == {} and checked[-1]["why_unchecked"] is None, checked
    replaced = [e["data"] for e in read_events(copy, "serve_replaced")]
    assert replaced and replaced[-1]["run"] == first_dir.name, replaced
    (rollback,) = [e["data"] for e in read_events(copy, "serve_rollback")]
    assert rollback["ok"] is True and rollback["rolled_back_to_run"] == first_dir.name, rollback
    assert 0 < rollback["seconds_without_service"] < 900 and "max_model_len" in rollback["new_plan_failure"], rollback
    assert {d["key"] for d in nb.decisions} >= {"replace", "rollback"}
    _serves(endpoint, planted)
    head = params.head.name
    _, serving, _ = node_shells[head].run(["docker", "exec", container_name(params, head), "cat",
                                           "/tmp/sparkbook/logs/serving.json"])
    record = json.loads(serving)
    assert record["run"] == first_dir.name and record["requested"]["settings"]["max_num_seqs"] == 16, record
    for path in copy.rglob("*"):
        if path.is_file():
            assert planted.encode() not in path.read_bytes(), path


def _containers(node_shells, params) -> dict[str, tuple[str, list[str]]]:
    """Per node: its node container's ID, and the names of every container it holds."""
    out = {}
    for spec in params.nodes:
        shell = node_shells[spec.name]
        _, inspect, _ = shell.run(["docker", "inspect", "-f", "{{.Id}}", container_name(params, spec.name)])
        out[spec.name] = (inspect.strip(), shell.run(["docker", "ps", "-a", "--format", "{{.Names}}"])[1].split())
    return out


def test_new_containers_replace_a_live_server_only_when_confirmed_and_a_failure_brings_them_back(
        full_run, node_shells, planted: str, tmp_path: Path) -> None:
    """Issue 40, item 1: a second run whose 03 chooses a new image (the stock-shaped one without Ray, the only
    candidate; its hand-offs before 03 from the first run's copy), so 04 would replace the node containers that hold
    the first server: without confirm_replace 04 stops before touching them, the first server still answering;
    confirmed (from 04, on that run's image choice), with an argument the new plan's vLLM refuses at its start, 04
    keeps the old containers aside, 05 fails in the new ones, and the driver brings the old containers back (the same
    container IDs, nothing left aside) with the first run's plan serving, recorded as the failed run's rollback; the
    rollback run is the cluster's deployment. Last in this module: it restarts the server."""
    from sparkbook.lab.imagebuild import NO_RAY
    from sparkbook.runbook import operate

    first_dir, first = full_run
    params = load_params(first.params_file)
    shutil.copytree(first_dir, tmp_path / params.cluster / first_dir.name)
    endpoint = json.loads((first_dir / "state.json").read_text())["endpoint"]
    before = _containers(node_shells, params)
    data = yaml.safe_load(Path(first.params_file).read_text())
    data["runtime"]["images"] = [NO_RAY]  # 03 chooses it: 04's containers differ in their image
    changed = _write(tmp_path / "new-image.yaml", data)
    failing = _write(tmp_path / "new-image-planted-flag.yaml", {**data, "serve": {
        **data["serve"], "extra_args": [*data["serve"]["extra_args"], "--planted-unknown-flag"]}})
    os.environ["HF_TOKEN"] = os.environ["VLLM_API_KEY"] = planted
    try:
        chose_dir, refused = driver.execute(changed, RunOptions(out_root=tmp_path, start="03", upto="05"), say=print)
        after_refusal = _containers(node_shells, params)
        _serves(endpoint, planted)
        t0 = time.monotonic()
        failed_dir, failed = driver.execute(failing, RunOptions(out_root=tmp_path, start="04", upto="05",
                                                                parameters={"confirm_replace": True}), say=print)
        print(f"04 replaces, 05 fails, the driver rolls back: {time.monotonic() - t0:.0f} s")
    finally:
        del os.environ["HF_TOKEN"], os.environ["VLLM_API_KEY"]
    assert json.loads((chose_dir / "state.json").read_text())["image"]["ref"] == NO_RAY
    nb = next(n for n in refused.notebooks if n.name.startswith("04"))
    assert nb.status == "failed" and "04 would stop a live server" in nb.exception["evalue"], nb.exception
    assert after_refusal == before, "nothing touched without confirm_replace"
    assert [n.status for n in failed.notebooks if n.name[:2] in ("04", "05")] == ["ok", "failed"], failed.notebooks
    (aside,) = [e["data"] for e in read_events(failed_dir, "containers_set_aside")]
    assert aside["run"] == first_dir.name and sorted(aside["nodes"]) == sorted(before), aside
    (back,) = [e["data"] for e in read_events(failed_dir, "serve_rollback")]
    assert back["ok"] is True and back["rolled_back_to_run"] == first_dir.name, back
    assert sorted(back["containers_back"]) == sorted(before) and "planted-unknown-flag" in back["new_plan_failure"]
    assert 0 < back["seconds_without_service"] < 900, back
    via = tmp_path / params.cluster / back["via_run"]
    assert [n.status for n in Manifest.read(via).notebooks if n.name[:2] in ("04", "05")] == ["ok", "ok"]
    after = _containers(node_shells, params)
    assert {n: c[0] for n, c in after.items()} == {n: c[0] for n, c in before.items()}, "brought back, not new"
    assert not [c for _, names in after.values() for c in names if c.endswith("-replaced")], after
    _serves(endpoint, planted)
    (deployed, *_) = operate.deployments(tmp_path / params.cluster)
    assert deployed.run_dir == via and deployed.plan_hash == operate.deployments(first_dir.parent)[0].plan_hash
    for path in failed_dir.rglob("*"):
        if path.is_file():
            assert planted.encode() not in path.read_bytes(), path


def _write(path: Path, data: dict) -> Path:
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path
