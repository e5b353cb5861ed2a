"""The whole runbook, headless, against the lab: what `make runbook` does, asserted end to end."""
from __future__ import annotations

import json
import re
import tarfile
from pathlib import Path

import httpx
import pytest

import sparkbook.lab as sblab
from sparkbook import cli
from sparkbook.cli import exits
from sparkbook.core.analysis import depthsweep
from sparkbook.core.cluster.topology import container_name, container_names
from sparkbook.core.values.evidence import read_events
from sparkbook.core.values.params import load_params
from sparkbook.core.values.rundir import PARAMS_COPY
from sparkbook.runbook import driver
from sparkbook.runbook.driver import RunOptions
from sparkbook.runbook.manifest import Manifest

pytestmark = pytest.mark.lab
OLD = {"old-vllm", "old-proxy", "old-embeddings", "old-reranker"}


@pytest.fixture(scope="module", autouse=True)
def old_deployment_stopped_afterwards(lab, tmp_path_factory):
    """The restore tests bring the old deployment back; what comes after this module (nbval over the notebooks)
    finds the lab as a confirmed run leaves it: the old deployment stopped, by 01 itself."""
    yield
    _, manifest = driver.execute(sblab.params_file(2), RunOptions(out_root=tmp_path_factory.mktemp("stop-old"),
                                                                  only="01", parameters={"confirm_cleanup": True}),
                                 say=print)
    assert [nb.status for nb in manifest.notebooks if nb.name.startswith("01")] == ["ok"]


def test_every_notebook_succeeds_and_is_recorded(full_run: tuple[Path, Manifest]) -> None:
    run_dir, manifest = full_run
    assert [(nb.name, nb.status) for nb in manifest.notebooks] == [(n, "ok") for n in driver.notebook_names()], \
        json.dumps([nb.exception for nb in manifest.notebooks], indent=1)
    assert all((run_dir / nb.name).exists() for nb in manifest.notebooks)
    assert any(nb.decisions for nb in manifest.notebooks)
    index = (run_dir / "index.html").read_text()
    assert all(nb.name in index for nb in manifest.notebooks)
    # issue 31: each notebook's nbconvert page linked, what wrote the run, its timeline, no path that dies with
    # the machine (papermill's run_dir, bench_dir, the evidence are relative to the run dir)
    assert all(nb.html and (run_dir / nb.html).exists() and f'href="{nb.html}"' in index for nb in manifest.notebooks)
    assert manifest.status == "ok" and manifest.sparkbook_commit and manifest.params_hash in index
    assert "<h2>Timeline</h2>" in index and "server start" in index and "stop" in index
    absolute = [p.name for p in run_dir.rglob("*") if p.is_file() and p.suffix in (".json", ".jsonl", ".ipynb", ".html")
                and str(run_dir) in p.read_text(errors="replace")]
    assert absolute == [], f"absolute paths into the run dir in {absolute}"


def test_06_measures_each_depth_and_a_prefix_cache_pair(full_run: tuple[Path, Manifest]) -> None:
    """Issue 41, item 3: 06's depth axis (single stream, the lab's depths [0, 1024]) and the deepest sent twice as a
    shared prefix, in bench/depth.json, the notebook, the summary; the sweep's plots on the run page (item 1)."""
    run_dir, _ = full_run
    bench = load_params(run_dir / PARAMS_COPY).benchmark
    found = depthsweep.read(run_dir)
    assert found is not None and [p.depth for p in found.points] == bench.depths == [0, 1024]
    for p in found.points:  # the server counted exactly the tokens sent (ids, not text), and answered each
        assert p.errors == [] and p.prompt_tokens == p.depth + bench.depth_input_len, p
        assert p.ttft_ms and p.ttft_ms > 0 and p.decode_tok_s and p.decode_tok_s > 0, p
    pair = found.prefix_cache
    assert pair is not None and pair.errors == [] and pair.prefix_tokens == 1024 and pair.ratio, pair
    assert pair.server_setting.startswith("not set on the command line"), pair  # 05's argv leaves vLLM's default
    # yet the lab's CPU vLLM turns prefix caching off for an MLA model (hyv4-tiny; its log: "MLA is enabled on a
    # non-GPU platform; forcing chunked prefill and prefix caching to be disabled"): its counters say so
    assert (pair.queried_tokens, pair.cached_tokens) == (0, 0), pair
    assert "prefix caching is off on it" in pair.verdict()
    print(json.dumps(found.model_dump(exclude={"points": {"__all__": {"ttft_ms_repeats", "decode_tok_s_repeats"}}}),
                     indent=1), pair.verdict())
    summary = json.loads((run_dir / "state.json").read_text())["benchmark"]
    assert [d["depth"] for d in summary["depths"]] == [0, 1024]
    assert summary["prefix_cache"]["ratio"] == pytest.approx(pair.ratio) and summary["prefix_cache"]["reuse"]
    notebook = (run_dir / "06-benchmark.ipynb").read_text()
    assert "Prefix caching, said plainly" in notebook and "the second request's TTFT was" in notebook
    index = (run_dir / "index.html").read_text()
    for name in ("throughput.png", "latency.png", "depth.png"):
        assert (run_dir / "bench" / name).stat().st_size > 10_000 and f'<img src="bench/{name}"' in index


def test_the_lab_serves_the_new_model_afterwards(full_run: tuple[Path, Manifest], planted: str) -> None:
    """With the API key (serve.api_key_env) that 05 and 06 sent on every request; without it vLLM refuses."""
    run_dir, manifest = full_run
    state = json.loads((run_dir / "state.json").read_text())
    params = load_params(manifest.params_file)
    assert state["image"]["ref"].endswith(":0.32.0")
    assert len(set(state["image"]["nodes"].values())) == 1, "every node holds the same image ID"
    assert state["endpoint"]["api_key_env"] == "VLLM_API_KEY"
    assert httpx.get(f"{state['endpoint']['base_url']}/v1/models", timeout=30).status_code == 401
    reply = httpx.post(f"{state['endpoint']['base_url']}/v1/completions", timeout=120,
                       headers={"Authorization": f"Bearer {planted}"},
                       json={"model": params.model.served_name, "prompt": "Hello", "max_tokens": 8})
    assert reply.status_code == 200 and reply.json()["choices"][0]["text"]


# every process of the container whose command line runs vLLM: does its environment hold HF_TOKEN=<argv[1]>?
SERVING_ENV = """import os, pathlib, sys
found = []
for proc in pathlib.Path("/proc").glob("[0-9]*"):
    if proc.name == str(os.getpid()):  # this probe: its own command line holds the word it looks for
        continue
    try:
        cmd, env = (proc / "cmdline").read_bytes(), (proc / "environ").read_bytes().split(b"\\0")
    except OSError:
        continue
    if b"vllm" in cmd:
        found.append(("HF_TOKEN=" + sys.argv[1]).encode() in env)
print(len(found), all(found))
"""


def test_planted_secret_reaches_the_serving_processes(full_run: tuple[Path, Manifest], planted: str,
                                                      node_shells) -> None:  # type: ignore[no-untyped-def]
    """The secret named in params is where it is used: in the environment of every vLLM process on every
    serving node (a 0600 file its shell exported and removed, never a command line or the container's env)."""
    _, manifest = full_run
    params = load_params(manifest.params_file)
    for node in ("lab-0", "lab-1"):
        _, out, _ = node_shells[node].run(["docker", "exec", container_name(params, node), "python3", "-c",
                                           SERVING_ENV, planted])
        count, every = out.split()
        assert int(count) > 0 and every == "True", (node, out)
        _, argv, _ = node_shells[node].run(["docker", "inspect", "--format", "{{json .Args}} {{json .Path}}",
                                            container_name(params, node)])
        assert planted not in argv
        _, inspected, _ = node_shells[node].run(["docker", "inspect", container_name(params, node)])
        assert planted not in inspected and "HF_TOKEN" not in inspected, node


def test_planted_secret_is_in_no_written_file(full_run: tuple[Path, Manifest], planted: str) -> None:
    """Every file under the outputs root (run dir, index, logs, state, notebooks) and every member of the
    archive, decompressed; the secret was really in the run's environment and named in its params."""
    run_dir, manifest = full_run
    assert "HF_TOKEN" in load_params(manifest.params_file).secrets
    archive = driver.pack_run(run_dir)
    written = [p for p in run_dir.parent.parent.rglob("*") if p.is_file()]
    assert archive in written and len(written) > 10
    for path in written:
        assert planted.encode() not in path.read_bytes(), path
    with tarfile.open(archive) as tar:
        members = [m for m in tar.getmembers() if m.isfile()]
        assert len(members) == len([p for p in run_dir.rglob("*") if p.is_file()])
        for member in members:
            assert planted.encode() not in tar.extractfile(member).read(), member.name


def _sparkbook(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    code = cli.main(list(argv))
    out = capsys.readouterr()
    print(out.out, out.err)
    assert "Traceback" not in out.out + out.err
    return code, out.out + out.err


def test_operator_commands_and_up_after_a_reboot(full_run: tuple[Path, Manifest], node_shells,  # type: ignore[no-untyped-def]
                                                 capsys: pytest.CaptureFixture[str], planted: str,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """plan, status and logs on the running cluster; then the node containers removed as a reboot would (`sparkbook
    stop` first, recorded), status and logs say it is dark, and `sparkbook up` brings the same plan back."""
    monkeypatch.setenv("VLLM_API_KEY", planted)  # as the full run had it: `up`'s 05 sends it (serve.api_key_env)
    monkeypatch.setenv("HF_TOKEN", planted)
    run_dir, manifest = full_run
    params, outputs = load_params(manifest.params_file), str(run_dir.parent.parent)
    files = [manifest.params_file, "--outputs", outputs]
    code, text = _sparkbook(capsys, "status", *files)
    assert code == 0 and "/health answers 200" in text and text.count("running") >= 4, text
    plan_hash = re.search(r"plan ([0-9a-f]{12})", text).group(1)  # type: ignore[union-attr]
    code, text = _sparkbook(capsys, "logs", *files, "--node", "lab-0")
    assert code == 0 and "vllm" in text.lower(), text
    code, text = _sparkbook(capsys, "plan", *files)
    assert code == 0 and "docker run -d --name " + container_name(params, "lab-0") in text and "ray start" in text
    assert "vllm serve /" in text and planted not in text
    assert "-e HF_TOKEN" not in text, "no secret in a node container's env (issue 43): its spawned processes get it"

    code, text = _sparkbook(capsys, "stop", *files, "--keep-ray")
    assert code == 0 and "kept (Ray still runs)" in text, text
    assert read_events(run_dir, "operator_stop") and _sparkbook(capsys, "status", *files)[0] == exits.EXIT_FAILED
    for node, names in container_names(params).items():  # what a reboot does to them: gone, nothing restarts them
        node_shells[node].run(["docker", "rm", "-f", *names], timeout=60)
    code, text = _sparkbook(capsys, "status", *files)
    assert code == exits.EXIT_FAILED and "NOT serving" in text and "none (" in text, text
    code, text = _sparkbook(capsys, "logs", *files)
    assert code == exits.EXIT_FAILED and "is not running" in text and "sparkbook up" in text, text

    code, text = _sparkbook(capsys, "up", *files)
    assert code == 0 and f"plan {plan_hash}" in text, text
    up_dir = Path(text.split("run dir: ")[1].split()[0])
    statuses = {nb.name[:2]: nb.status for nb in Manifest.read(up_dir).notebooks}
    assert statuses == {"01": "skipped", "02": "skipped", "03": "skipped", "04": "ok", "05": "ok", "06": "skipped"}
    code, text = _sparkbook(capsys, "status", *files)
    assert code == 0 and f"plan {plan_hash}" in text and up_dir.name in text, text


# --- `sparkbook restore` of the whole run (issue 21); after the tests above: they need the new server serving ---
def lab_containers() -> dict[str, str]:
    """node/name -> state of every container of the lab."""
    return {f"{n.name}/{c['name']}": c["state"] for n in sblab.status().nodes for c in n.containers}


def test_restore_while_the_new_server_holds_the_port_is_refused(full_run: tuple[Path, Manifest],
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    run_dir, manifest = full_run
    before = lab_containers()
    assert not {name for name, st in before.items() if st == "running" and name.split("/")[1] in OLD}
    assert cli.main(["restore", str(run_dir)]) == exits.EXIT_FAILED
    err = capsys.readouterr().err
    head = container_name(load_params(manifest.params_file), "lab-0")
    assert err.startswith("error (restore): refused") and err.count("\n") == 1, err
    assert f"lab-0: old-vllm: port 8000 is held by container {head} (this run's node container)" in err, err
    assert "--stop-new" in err
    assert lab_containers() == before, "a refused restore changes nothing"
    (outcome,) = [e["data"] for e in read_events(run_dir, "restore_outcome")]
    assert outcome["result"] == "refused" and not outcome["actions"]
    assert "refused" in (run_dir / "index.html").read_text().split("<h2>Restore</h2>")[1]


def test_stop_new_then_restore_brings_the_old_services_back(full_run: tuple[Path, Manifest],
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    run_dir, manifest = full_run
    params = load_params(manifest.params_file)
    code = cli.main(["restore", str(run_dir), "--stop-new"])
    out = capsys.readouterr()
    print(out.out, out.err)
    assert code == 0, out.out + out.err
    containers = {c["name"]: c for n in sblab.status().nodes for c in n.containers}
    assert {name: containers[name].get("answers") for name in OLD} == dict.fromkeys(OLD, True)
    assert all(containers[container_name(params, n.name)]["state"] != "running" for n in params.nodes)
    outcome = [e["data"] for e in read_events(run_dir, "restore_outcome")][-1]
    assert outcome["result"] == "restored"
    assert [a["name"] for a in outcome["stopped_new"]] == [name for names in container_names(params).values()
                                                           for name in names], "the front's own place too"
    assert all(c["ok"] for c in outcome["checks"]) and OLD | {"vllm_node"} <= {c["name"] for c in outcome["checks"]}
    vllm = next(c for c in outcome["checks"] if c["name"] == "old-vllm")
    assert vllm["health"] == f"answers http://{params.head.host}:8000/health", vllm  # this lab's (SPARKBOOK_LAB_ID)
    assert "restored" in (run_dir / "index.html").read_text().split("<h2>Restore</h2>")[1]


def test_restore_of_a_run_whose_cleanup_stopped_nothing_changes_nothing(lab, tmp_path: Path,
                                                                        capsys: pytest.CaptureFixture[str]) -> None:
    run_dir, manifest = driver.execute(sblab.REPO_PARAMS, RunOptions(out_root=tmp_path, only="01"))
    assert [nb.status for nb in manifest.notebooks if nb.name.startswith("01")] == ["ok"]
    before = lab_containers()
    assert cli.main(["restore", str(run_dir)]) == 0
    assert "nothing to restore; nothing was changed" in capsys.readouterr().out
    assert lab_containers() == before
    assert [e["data"]["result"] for e in read_events(run_dir, "restore_outcome")] == ["nothing to restore"]
