"""serve.front: router on the lab (issue 55): 04 and 05 seeded from the session's full run under a cluster name and
ports of its own, serving behind vllm-router (the front) on the head; then 05 again with a changed plan
(max_num_seqs halved, confirmed) while a bounded streaming load at concurrency 4 runs through the front: the old
server is stopped drained (vLLM's --shutdown-timeout), the front stays up (the same process) and holds the requests
that arrive while no server answers, so none is refused and none fails; the run records the seconds without service
a client saw. The module's containers are removed after it."""
from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from sparkbook.core.cluster.topology import container_name
from sparkbook.core.values.evidence import read_events
from sparkbook.core.values.params import load_params
from sparkbook.core.values.stagelist import RAYCLUSTER, SERVE
from sparkbook.runbook import driver
from sparkbook.runbook.driver import RunOptions
from sparkbook.runbook.manifest import Manifest
from sparkbook.stages.serve import front

pytestmark = pytest.mark.lab
FRONT = {"front": "router", "port": 8200, "replica_port": 8201, "master_port": 29701, "api_key_env": None,
         "hold_s": 120, "drain_timeout_s": 20}
LOAD_CONCURRENCY = 4


@pytest.fixture(scope="module")
def fronted(full_run, node_shells, tmp_path_factory: pytest.TempPathFactory
            ) -> Iterator[tuple[dict[str, Any], Path, Manifest]]:
    first_dir, first = full_run
    data = yaml.safe_load(Path(first.params_file).read_text())
    data.update(cluster="lab-front", secrets=[])
    data["serve"].update(FRONT)
    data["ray"] = {**data.get("ray", {}), "port": 6479}  # the full run's Ray holds 6379 beside it
    path = tmp_path_factory.mktemp("lab-front-params") / "lab-front.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    t0 = time.monotonic()
    run_dir, manifest = driver.execute(path, RunOptions(out_root=tmp_path_factory.mktemp("lab-front-outputs"),
                                                        seed=first_dir, start=RAYCLUSTER.id, upto=SERVE.id), say=print)
    print(f"lab-front: 04-05 in {time.monotonic() - t0:.0f} s")
    params = load_params(path)
    yield data | {"_params": params}, run_dir, manifest
    for spec in params.nodes:
        node_shells[spec.name].run(["docker", "rm", "-f", container_name(params, spec.name)], check=False)


class Load:
    """A bounded streaming load through the front: LOAD_CONCURRENCY clients asking one after another until stopped,
    each request counted as answered, refused (no connection) or failed (an error status or a cut stream)."""

    def __init__(self, base_url: str, model: str) -> None:
        self.base_url, self.model = base_url, model
        self.ok = self.refused = self.failed = 0
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._client, daemon=True) for _ in range(LOAD_CONCURRENCY)]
        self._lock = threading.Lock()

    def __enter__(self) -> Load:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=200)

    def _client(self) -> None:
        body = {"model": self.model, "messages": [{"role": "user", "content": "Count to twenty."}],
                "max_tokens": 48, "stream": True, "ignore_eos": True}
        with httpx.Client(timeout=httpx.Timeout(180.0, connect=5.0)) as client:
            while not self._stop.is_set():
                self._count(self._one(client, body))

    def _one(self, client: httpx.Client, body: dict[str, Any]) -> str:
        try:
            with client.stream("POST", f"{self.base_url}/v1/chat/completions", json=body) as r:
                if r.status_code != 200:
                    return f"failed: status {r.status_code}"
                text = "".join(r.iter_text())
            return "ok" if "[DONE]" in text else f"failed: stream ended without [DONE]: {text[-120:]}"
        except httpx.ConnectError as exc:
            return f"refused: {exc}"
        except httpx.HTTPError as exc:
            return f"failed: {type(exc).__name__}: {exc}"

    def _count(self, result: str) -> None:
        with self._lock:
            if result == "ok":
                self.ok += 1
                return
            self.refused += result.startswith("refused")
            self.failed += result.startswith("failed")
            self.errors.append(result)


def _front_pid(node_shells, data: dict[str, Any]) -> str:
    head = data["nodes"][0]["name"]
    _, out, _ = node_shells[head].run(["docker", "exec", container_name(data["_params"], head), "cat",
                                       f"{front.LOG}.pid"])
    return out.split()[0] if out.split() else ""


def test_a_changed_plan_behind_the_front_is_a_drained_stop_no_client_sees_refused(
        fronted, node_shells, tmp_path: Path) -> None:
    data, run_dir, manifest = fronted
    assert {nb.name[:2]: nb.status for nb in manifest.notebooks if nb.status != "skipped"} == {"04": "ok", "05": "ok"}
    endpoint = json.loads((run_dir / "state.json").read_text())["endpoint"]
    head_ip = data["nodes"][0]["fabric_ip"]
    assert endpoint["base_url"] == f"http://{head_ip}:8200" and endpoint["router_log"] == front.LOG, endpoint
    assert endpoint["replicas"] == {data["nodes"][0]["name"]: f"http://{head_ip}:8201"}, endpoint
    assert "--shutdown-timeout" in endpoint["commands"][data["nodes"][0]["name"]], "the lab's vLLM 0.32 drains"
    pid = _front_pid(node_shells, data)
    assert pid
    data = {k: v for k, v in data.items() if k != "_params"} | {"_params": data["_params"]}
    changed = {k: v for k, v in data.items() if k != "_params"} | {"serve": {**data["serve"], "max_num_seqs": data["serve"]["max_num_seqs"] // 2}}
    path = tmp_path / "lab-front-changed.yaml"
    path.write_text(yaml.safe_dump(changed, sort_keys=False))
    t0 = time.monotonic()
    with Load(endpoint["base_url"], endpoint["model"]) as load:
        time.sleep(3)  # requests in flight when 05 starts
        _, again = driver.execute(path, RunOptions(resume=run_dir, only="05", parameters={"confirm_replace": True}),
                                  say=print)
        time.sleep(3)
    print(f"redeploy behind the front: {time.monotonic() - t0:.0f} s; load: {load.ok} ok, {load.refused} refused, "
          f"{load.failed} failed; first errors: {load.errors[:3]}")
    nb = next(n for n in again.notebooks if n.name.startswith("05"))
    assert nb.status == "ok", nb.exception
    (held,) = read_events(run_dir, "front_held")[-1:]
    print("front_held:", held["data"])
    assert held["data"]["way"] == "drained stop" and held["data"]["refused"] == 0, held["data"]
    after = json.loads((run_dir / "state.json").read_text())["endpoint"]
    assert after["front_refused"] == 0 and after["seconds_without_service"] is not None, after
    assert (load.refused, load.failed) == (0, 0), load.errors[:5]
    assert load.ok > LOAD_CONCURRENCY
    assert _front_pid(node_shells, data) == pid, "the front outlived the servers behind it"
