"""serve.layout replicas on the lab (issue 42, item 3): a run of 04, 05 and 06 seeded from the session's full run
(its image, model and diagnosis), under a cluster name and ports of its own so that the full run's deployment keeps
serving beside it. vllm-router is installed in the head's container from wheels this machine fetched (the node
reaches no index), one replica serves on each node, 05 is ready only once both replicas and then the router list
the model, the smoke and answer checks and 06's sweep go through the router, one endpoint; `status` shows the
router and both replicas, `logs --router` the router's log; `stop` then `up` brings the replicas and the router
back. With the API key (serve.api_key_env, the full run's planted secret): the router asks it on every route, its
admin routes included, each replica asks it under /v1 and binds its own node's fabric address. The module's
containers are removed after it."""
from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml
from runcopy import seeded_from_04

from sparkbook import cli
from sparkbook.core.cluster import topology
from sparkbook.core.cluster.topology import container_name
from sparkbook.core.values.evidence import read_events
from sparkbook.core.values.params import Params, bearer, load_params
from sparkbook.runbook import operate
from sparkbook.runbook.manifest import Manifest
from sparkbook.stages.serve import router

pytestmark = pytest.mark.lab
# a copy per node of the lab's model: 8 sequences of 2048 tokens fit its KV cache (02's replicas fit); ports of its
# own beside the full run's 8000; the full run's API key, every replica on its own fabric address (serve.host the
# head's: check refuses 0.0.0.0 with a key)
KEY = "VLLM_API_KEY"
REPLICAS = {"layout": "replicas", "max_num_seqs": 8, "port": 8100, "replica_port": 8101, "master_port": 29601,
            "api_key_env": KEY, "front": "auto"}
SMALL_SWEEP = {"concurrency": [1, 4], "num_prompts": 8, "warmup_requests": 1, "depths": [], "soak_s": 0}


@pytest.fixture(scope="module")
def replicas(full_run, node_shells, planted, tmp_path_factory: pytest.TempPathFactory,
             ) -> Iterator[tuple[Params, Path, Manifest]]:
    head = load_params(Path(full_run[1].params_file)).head
    with pytest.MonkeyPatch.context() as env:  # the key in this controller's environment for the module's tests
        env.setenv(KEY, planted)
        yield from seeded_from_04(full_run, node_shells, tmp_path_factory, "lab-replicas",
                                  {**REPLICAS, "host": str(head.fabric_ip)}, SMALL_SWEEP, secrets=(KEY,))



def _cmdlines(node_shells, params: Params, node: str, container: str | None = None) -> list[str]:
    """Every process's command line in the node's container (or `container` on it), read from /proc."""
    script = "for f in /proc/[0-9]*/cmdline; do tr '\\0' ' ' <$f; echo; done"
    _, out, _ = node_shells[node].run(["docker", "exec", container or container_name(params, node), "sh", "-c",
                                       script])
    return [line for line in out.splitlines() if line.strip()]


def test_each_node_serves_a_copy_behind_the_router_and_06_measures_through_it(replicas, full_run, node_shells,
                                                                                planted) -> None:
    params, run_dir, manifest = replicas
    ran = {nb.name[:2]: nb.status for nb in manifest.notebooks if nb.status != "skipped"}
    assert ran == {"04": "ok", "05": "ok", "06": "ok"}, manifest.notebooks
    endpoint = json.loads((run_dir / "state.json").read_text())["endpoint"]
    assert endpoint["base_url"] == f"http://{params.head.fabric_ip}:8100", endpoint
    assert endpoint["replicas"] == {s.name: f"http://{s.fabric_ip}:8101" for s in params.nodes}, endpoint
    assert endpoint["router"][:3] == ["python3", "-m", router.KEYED], endpoint  # vllm-router asking the key
    (installed,) = read_events(run_dir, "router_installed")
    print("router install:", installed["data"])
    assert (installed["data"]["version"], installed["data"]["site"]) == (router.VERSION, router.site(params))
    (ray,) = [d for nb in manifest.notebooks if nb.name.startswith("04") for d in nb.decisions if d.get("key") == "ray"]
    assert ray["choice"] == "no Ray" and "serve.layout is replicas" in ray["reason"], ray
    for spec in params.nodes:  # one `vllm serve` per node on the replica port, no rank following another node's
        lines = _cmdlines(node_shells, params, spec.name)
        serves = [ln for ln in lines if "vllm serve" in ln or "vllm.entrypoints" in ln]
        assert serves and all("--port 8101" in ln for ln in serves if "--port" in ln), (spec.name, lines)
        assert all(f"--host {spec.fabric_ip} " in ln for ln in serves if "--host" in ln), (spec.name, lines)
        assert not [ln for ln in lines if "--nnodes" in ln or "--headless" in ln], (spec.name, lines)
    router_process = ("vllm::router", "vllm_router")  # its setproctitle name, or its argv before it is set
    front_place = topology.front_place(params, "").name
    assert [ln for ln in _cmdlines(node_shells, params, "lab-0", front_place) if any(m in ln for m in router_process)]
    assert not [ln for node in ("lab-0", "lab-1") for ln in _cmdlines(node_shells, params, node)
                if any(m in ln for m in router_process)], "the router runs in the front's own place on the head only"
    for url in [*endpoint["replicas"].values(), endpoint["base_url"]]:
        listed = httpx.get(f"{url}/v1/models", timeout=10, headers=bearer(KEY)).json()["data"]
        assert [m["id"] for m in listed] == [params.model.served_name], (url, listed)
    bench = json.loads((run_dir / "state.json").read_text())["benchmark"]
    points = [p for p in bench["points"] if p["failed"] == 0 and p["completed"] > 0]
    assert {p["max_concurrency"] for p in points} == {1, 4}, bench["points"]
    first_dir, _ = full_run
    first = json.loads((first_dir / "state.json").read_text())["endpoint"]
    assert operate.health(first["base_url"], first["api_key_env"]) is None, \
        "the full run's deployment serves beside the replicas"


def test_without_the_key_the_router_and_the_replicas_refuse(replicas, planted) -> None:
    """The keyed router refuses every route without the key, /add_worker (which would hand a stranger's server the
    clients' keys) and its own /health included; each replica refuses /v1 without it; the key alone is let in."""
    params, run_dir, _ = replicas
    endpoint = json.loads((run_dir / "state.json").read_text())["endpoint"]
    front, body = endpoint["base_url"], {"model": params.model.served_name, "prompt": "1", "max_tokens": 1}
    for headers in ({}, {"Authorization": "Bearer not-the-key"}, {"Authorization": planted}):
        asked = {"models": httpx.get(f"{front}/v1/models", headers=headers, timeout=10).status_code,
                 "completion": httpx.post(f"{front}/v1/completions", json=body, headers=headers,
                                          timeout=30).status_code,
                 "add_worker": httpx.post(f"{front}/add_worker", params={"url": "http://10.77.0.99:9"},
                                          headers=headers, timeout=10).status_code,
                 "health": httpx.get(f"{front}/health", headers=headers, timeout=10).status_code,
                 **{f"replica {n}": httpx.get(f"{url}/v1/models", headers=headers, timeout=10).status_code
                    for n, url in endpoint["replicas"].items()}}
        assert set(asked.values()) == {401}, (headers.keys(), asked)
    workers = httpx.get(f"{front}/list_workers", headers=bearer(KEY), timeout=10).json()
    assert "10.77.0.99" not in json.dumps(workers), workers
    done = httpx.post(f"{front}/v1/completions", json=body, headers=bearer(KEY), timeout=60)
    assert done.status_code == 200 and done.json()["choices"], done.text[:300]


def test_status_and_logs_show_the_router_and_both_replicas(replicas, capsys: pytest.CaptureFixture[str]) -> None:
    params, run_dir, manifest = replicas
    outputs = str(run_dir.parent.parent)
    code = cli.main(["status", manifest.params_file, "--outputs", outputs])
    text = capsys.readouterr().out
    print(text)
    assert code == 0 and "router on lab-0: running" in text and "Traceback" not in text, text
    assert text.count("/health answers 200") == 3, "the router's endpoint and each replica's own"
    assert cli.main(["logs", manifest.params_file, "--outputs", outputs, "--router"]) == 0
    log = capsys.readouterr().out
    assert "healthy" in log.lower() or "router" in log.lower(), log[-2000:]


def test_a_changed_plan_goes_blue_green_with_a_copy_beside_each_replica(replicas) -> None:
    """05 again, confirmed, with a serve setting changed: every node's new copy starts on serve.replica_port + 1
    beside the serving one, is ready, the head's is checked, the front adds both new copies before removing the old
    ones, which drain and stop; a client polling the front saw nothing refused or failed."""
    from sparkbook.runbook import driver
    from sparkbook.runbook.driver import RunOptions

    params, run_dir, manifest = replicas
    changed = yaml.safe_load(Path(manifest.params_file).read_text())
    changed["serve"]["max_num_seqs"] = 4
    path = run_dir.parent.parent / "lab-replicas-green.yaml"
    path.write_text(yaml.safe_dump(changed, sort_keys=False))
    _, again = driver.execute(path, RunOptions(resume=run_dir, only="05", parameters={"confirm_replace": True}),
                              say=print)
    nb = next(n for n in again.notebooks if n.name.startswith("05"))
    assert nb.status == "ok", nb.exception
    (held,) = [e["data"] for e in read_events(run_dir, "front_held")][-1:]
    print("front_held:", held)
    assert held["way"] == "blue-green" and (held["refused"], held["failed"]) == (0, 0), held
    endpoint = json.loads((run_dir / "state.json").read_text())["endpoint"]
    assert endpoint["replicas"] == {s.name: f"http://{s.fabric_ip}:8102" for s in params.nodes}, endpoint
    for spec in params.nodes:  # the old copies drained and stopped
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"http://{spec.fabric_ip}:8101/health", timeout=5)
    listed = httpx.get(f"{endpoint['base_url']}/v1/models", timeout=10,
                       headers=bearer(KEY)).json()["data"]
    assert [m["id"] for m in listed] == [params.model.served_name]


def test_stop_then_up_brings_the_replicas_and_the_router_back(replicas, capsys: pytest.CaptureFixture[str]) -> None:
    params, run_dir, manifest = replicas
    outputs = str(run_dir.parent.parent)
    assert cli.main(["stop", manifest.params_file, "--outputs", outputs]) == 0
    assert "front removed" in capsys.readouterr().out
    assert cli.main(["status", manifest.params_file, "--outputs", outputs]) != 0
    stopped = capsys.readouterr().out
    assert "NOT serving" in stopped, stopped
    t0 = time.monotonic()
    assert cli.main(["up", manifest.params_file, "--outputs", outputs]) == 0
    print(f"up: {time.monotonic() - t0:.0f} s")
    capsys.readouterr()
    assert cli.main(["status", manifest.params_file, "--outputs", outputs]) == 0
    text = capsys.readouterr().out
    print(text)
    assert "router on lab-0: running" in text and text.count("/health answers 200") == 3, text
    newest = operate.last_good(params, Path(outputs))
    assert newest.run_id != run_dir.name and newest.endpoint.router_log is not None, "up's own run deployed it"
