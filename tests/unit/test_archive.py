"""The archive: run dirs read into records (committed ones and synthetic ones), the cluster index, `sparkbook runs`,
and a run's own index.html."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
from committed import examples
from rundirs import NAMES, make_run, point

from sparkbook import cli
from sparkbook.records import archive, pages
from sparkbook.runbook import driver
from sparkbook.runbook.manifest import Manifest

REPO = Path(__file__).resolve().parents[2]
LAB_RUN = examples() / "lab/20261130T150551Z"
H200_RUN = examples() / "h200-duo/20261130T144302Z"
FAILED_RUN = examples() / "lab/20261201T200508Z"
FAILED_05 = {"ename": "ServeError", "evalue": "vllm serve did not become healthy\nmore", "cell_index": 2,
             "exec_count": 3}
OOM = {"at": "t", "stage": "05-serve", "kind": "serve_attempts",
       "data": [{"attempt": 1, "ready": False, "seconds": 30.0, "cause": "CUDA graph capture OOM"}]}


def test_a_committed_lab_run_gives_every_figure_from_its_state() -> None:
    r = archive.read_run(LAB_RUN)
    assert (r.kind, r.status, r.cluster) == ("ok", "ok", "lab")
    assert r.image == "sparkbook-lab/vllm-cpu:0.32.0" and r.versions["vllm"] == "0.32.0+cpu"
    assert (r.executor, r.ready_s, r.peak_concurrency) == ("mp", 69.8, 8)
    assert r.single_tok_s == pytest.approx(28.39, abs=0.01) and r.peak_tok_s == pytest.approx(222.70, abs=0.01)
    assert r.roofline_pct == pytest.approx(0.336, abs=0.001)
    assert [f["severity"] for f in r.findings].count("blocker") == 1
    assert r.params_hash is None and r.not_run == [] and r.cause is None


def test_an_older_gpu_run_without_state_falls_back_to_decisions_and_bench_files() -> None:
    r = archive.read_run(H200_RUN)
    assert r.kind == "ok" and r.executor == "ray" and r.image == "/opt/torch/.venv/bin/python3"
    # no state.json nor events: time to ready and the roofline share as 05 and 06 displayed them (its README's)
    assert r.ready_s == 184.1 and r.roofline_pct == pytest.approx(17.58, abs=0.01)
    assert r.single_tok_s == pytest.approx(247.26, abs=0.01) and (r.peak_concurrency, round(r.peak_tok_s)) == (64, 3406)
    assert archive.row(r)["ready s"] == "184.1" and archive.row(r)["peak tok/s"] == "3,405.6 @64"
    figures = {f["figure"]: f["value"] for f in pages.key_figures(r)}
    assert figures["runtime"] == "Python environment /opt/torch/.venv/bin/python3"


def test_the_failed_lab_run_shows_its_real_cause_and_the_resolved_finding() -> None:
    """Issue 31: the record says 'worker died'; the logs it kept say why, and 03 resolved 02's image blocker."""
    r = archive.read_run(FAILED_RUN)
    assert r.cause == "worker died" and r.status == "failed at 05"
    assert [(x.log, x.line_no, x.error) for x in r.first_errors] == [
        ("logs/serve-lab-0-attempt1.log", 5, "vllm: error: unrecognized arguments: --planted-unknown-flag"),
        ("logs/serve-lab-1-attempt1.log", 5, "main.py: error: unrecognized arguments: --planted-unknown-flag")]
    assert [f.get("resolved_by") for f in r.findings if f["severity"] == "blocker"] == ["03"]
    page = pages.run_page(r)
    assert page.index("first error in the logs") < page.index("Key figures") < page.index("Findings")
    assert '<a href="logs/serve-lab-0-attempt1.log">' in page and '<a href="05-serve.html">' in page
    assert "(resolved by 03)" in page and "written by a sparkbook not recorded" in page
    assert [(s.node, s.action) for s in r.timeline][-2:] == [("lab-0", "server start"), ("-", "failure")]


def test_the_timeline_reads_new_kinds_by_their_name() -> None:
    """Another stage's new event kind (a replaced server, a disabled unit) is listed without a change here."""
    from sparkbook.records.timeline import steps
    events = [{"at": "t2", "stage": "05-serve", "kind": "server_replace", "data": {"node": "lab-0", "old": "a",
                                                                                   "new": "b"}},
              {"at": "t1", "stage": "01-cleanup", "kind": "unit_disable", "data": [{"node": "lab-1", "unit": "u"}]},
              {"at": "t0", "stage": "02-diagnosis", "kind": "node_facts", "data": {"node": "lab-0"}}]
    assert [(s.at, s.node, s.action, s.detail) for s in steps(events)] == [
        ("t1", "lab-1", "unit disable", "unit u"), ("t2", "lab-0", "server replace", "old a, new b")]


def test_image_and_executor_are_read_by_the_decisions_key_whatever_their_words(tmp_path: Path) -> None:
    """Issue 28 item 3: a reworded question keeps its column; a run dir without keys is read by the words."""
    keyed = {"03": [{"question": "Which container image should serve the model?", "choice": "img:keyed",
                     "reason": "r", "key": "image"}],
             "05": [{"question": "Which executor?", "choice": "ray", "reason": "r", "key": "executor"}]}
    run_dir = make_run(tmp_path / "lab", "20261201T100000Z", statuses=["ok", "ok"] + ["pending"] * 4,
                       decisions=keyed)
    r = archive.read_run(run_dir)
    assert (r.image, r.executor) == ("img:keyed", "ray")
    worded = {"03": [{"question": "Which image runs vLLM?", "choice": "img:worded", "reason": "r"}]}
    r = archive.read_run(make_run(tmp_path / "lab", "20261201T110000Z", statuses=["ok", "ok"] + ["pending"] * 4,
                                  decisions=worded))
    assert r.image == "img:worded"


def test_failed_partial_ok_and_malformed_runs_newest_first(tmp_path: Path) -> None:
    lab = tmp_path / "lab"
    make_run(lab, "20261201T100000Z", image="img:1", image_id="sha256:1", points=[point(1, 20.0)])
    make_run(lab, "20261201T110000Z", statuses=["ok"] * 4 + ["failed", "pending"], exception=FAILED_05,
             image="img:2", image_id="sha256:2", events=[OOM])
    make_run(lab, "20261201T120000Z", statuses=["pending", "ok"] + ["pending"] * 4)
    make_run(lab, "20261201T130000Z", image="img:2", image_id="sha256:2")
    bad = make_run(lab, "20261201T140000Z")
    (bad / "manifest.json").write_text("{not json")
    (lab / "20261201T150000Z").mkdir()  # a run whose manifest is gone
    odd = make_run(lab, "20261201T143000Z")
    (odd / "manifest.json").write_text('{"notebooks": [{"status": "ok", "decisions": ["not a decision"]}]}')
    (lab / "interactive").mkdir()  # a notebook's own run dir: not a run

    records = archive.runs(lab)
    assert "a notebook entry without a name" in records[1].status
    del records[1]
    assert [r.run_id for r in records] == ["20261201T150000Z", "20261201T140000Z", "20261201T130000Z",
                                           "20261201T120000Z", "20261201T110000Z", "20261201T100000Z"]
    gone, malformed, ok, partial, failed, first = records
    assert gone.kind == "unreadable" and "no manifest.json" in gone.status
    assert malformed.kind == "unreadable" and "JSONDecodeError" in malformed.status
    assert partial.status == "partial: 02 ran" and partial.not_run == [n for n in NAMES if not n.startswith("02")]
    assert failed.status == "failed at 05" and failed.cause == "CUDA graph capture OOM"
    assert failed.failing_cell["source"] == "cell 2 of 05-serve.ipynb"
    assert (first.image_changed, failed.image_changed, ok.image_changed) == (None, True, False)
    assert ok.params_hash and len(ok.params_hash) == 12 and first.single_tok_s == 20.0


def test_the_failure_cause_without_a_classified_serve_failure_is_the_exception(tmp_path: Path) -> None:
    r = archive.read_run(make_run(tmp_path / "lab", "20261201T110000Z", statuses=["ok", "failed"] + ["pending"] * 4,
                                  exception={**FAILED_05, "cell_index": 99}))
    assert r.status == "failed at 02" and r.cause == "ServeError: vllm serve did not become healthy"
    assert r.failing_cell["source"] is None  # the cell index points nowhere: the error alone


def _hrefs(page: str) -> list[str]:
    return re.findall(r'href="([^"]+)"', page)


def test_the_cluster_index_links_only_what_exists_and_filters_by_status(tmp_path: Path) -> None:
    lab = tmp_path / "lab"
    make_run(lab, "20261201T100000Z")
    make_run(lab, "20261201T110000Z", statuses=["ok"] * 4 + ["failed", "pending"], exception=FAILED_05)
    (lab / "20261201T150000Z").mkdir()
    page = pages.write_cluster_index(lab).read_text()
    for href in _hrefs(page):
        assert (lab / href).exists(), href
    assert "20261201T110000Z/05-serve.ipynb" in _hrefs(page) and "20261201T110000Z/06-benchmark.ipynb" not in page
    assert page.index("20261201T110000Z") < page.index("20261201T100000Z")
    assert 'data-kind="failed"' in page and 'data-kind="unreadable"' in page and "<option>partial</option>" in page


def test_the_committed_clusters_index_without_broken_links() -> None:
    for cluster in ("lab", "h200-duo", "h200-duo-mp"):
        page = pages.cluster_page(cluster, archive.runs(examples() / cluster))
        assert all((examples() / cluster / h).exists() for h in _hrefs(page)), cluster


def test_a_run_page_shows_status_figures_findings_failing_cell_and_what_did_not_run(tmp_path: Path) -> None:
    decisions = {"03": [{"question": "Which image serves X?", "choice": "img:2", "reason": "registers X",
                         "alternatives": [{"option": "img:1", "rejected_because": "does not register X"}],
                         "evidence": ["probe"]}]}
    findings = [{"severity": "fact", "topic": "gpu", "text": "no GPU"},
                {"severity": "blocker", "topic": "image", "text": "img:1 cannot serve X"}]
    run_dir = make_run(tmp_path / "lab", "20261201T110000Z", statuses=["ok"] * 4 + ["failed", "pending"],
                       exception=FAILED_05, events=[OOM], decisions=decisions, findings=findings)
    manifest = Manifest.read(run_dir)
    page = driver.write_index(run_dir, manifest).read_text()
    assert "Status: <b>failed at 05</b>" in page and "Not run: 06-benchmark.ipynb" in page
    assert page.index("img:1 cannot serve X") < page.index("no GPU")  # blockers first
    assert "rejected <b>img:1</b>: does not register X" in page and "registers X" in page
    assert "cell 2 of 05-serve.ipynb" in page and "ServeError: vllm serve did not become healthy" in page
    assert "CUDA graph capture OOM" in page and "70.0 s" not in page  # 05 failed: no endpoint, no ready time
    assert all((run_dir / h).exists() for h in _hrefs(page) if not h.startswith("../"))


def test_an_only_run_is_partial_not_ok(tmp_path: Path) -> None:
    run_dir = make_run(tmp_path / "lab", "20261201T120000Z", statuses=["pending", "ok"] + ["pending"] * 4)
    manifest = Manifest.read(run_dir)
    assert manifest.status == "ok"  # what the manifest says of an --only run that succeeded
    page = driver.write_index(run_dir, manifest).read_text()
    assert "Status: <b>partial: 02 ran</b>" in page and "Status: <b>ok" not in page


def test_sparkbook_runs_prints_newest_first_and_filters(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    lab = tmp_path / "lab"
    make_run(lab, "20261201T100000Z")
    make_run(lab, "20261201T110000Z", statuses=["ok"] * 4 + ["failed", "pending"], exception=FAILED_05, events=[OOM])
    assert cli.main(["runs", "lab", "--outputs", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "2 of 2 run(s)" in out and out.index("20261201T110000Z") < out.index("20261201T100000Z")
    assert "failed at 05" in out and "CUDA graph capture OOM" in out and (lab / "index.html").exists()
    assert cli.main(["runs", str(lab), "--status", "ok"]) == 0
    out = capsys.readouterr().out
    assert "1 of 2 run(s)" in out and "20261201T110000Z" not in out
    assert cli.main(["runs", "nosuch", "--outputs", str(tmp_path)]) == 1
    assert "'nosuch' is neither" in capsys.readouterr().err


def test_a_notebooks_own_run_dir_is_read_from_its_state_and_events_but_not_listed(tmp_path: Path) -> None:
    """nbval and JupyterLab write outputs/<cluster>/interactive (no manifest): 06 compares against it."""
    lab = tmp_path / "lab"
    made = make_run(lab, "interactive", image="img:3", events=[OOM, {
        "at": "t", "stage": "03-image-selection", "kind": "decision",
        "data": {"question": "Which image serves X?", "choice": "img:3", "reason": "r", "alternatives": []}}])
    (made / "manifest.json").unlink()
    r = archive.read_run(made)
    assert r.kind == "interactive" and r.image == "img:3" and r.versions["vllm"] == "0.32.0"
    assert [d["choice"] for d in r.decisions()] == ["img:3"]
    assert archive.runs(lab) == []


def test_runs_named_by_a_params_file_a_cluster_or_nothing() -> None:
    outputs = examples()
    assert archive.cluster_dirs(str(REPO / "params/h200-duo.yaml"), outputs) == [outputs / "h200-duo"]
    assert archive.cluster_dirs("lab", outputs) == [outputs / "lab"]
    assert {"lab", "h200-duo", "h200-duo-mp"} <= {d.name for d in archive.cluster_dirs(None, outputs)}


def test_the_run_page_lists_where_clients_reach_the_api_on_each_network(tmp_path: Path) -> None:
    """05's endpoint records the URL per network (issue 29): the page names both, so a colleague on the management
    network does not try the fabric address."""
    record = archive.read_run(make_run(tmp_path / "lab", "20261202T100000Z"))
    assert record.addresses == ["management: http://10.1.230.180:8000", "fabric: http://192.168.200.12:8000"]
    page = pages.run_page(record)
    assert "clients reach the API at" in page and "management: http://10.1.230.180:8000" in page
    unserved = archive.read_run(make_run(tmp_path / "lab", "20261202T110000Z", statuses=["ok"] * 4 + ["failed", "pending"]))
    assert unserved.addresses == []


def test_runs_says_how_a_replacement_behind_the_front_went(tmp_path: Path) -> None:
    """Issue 55: `runs` and the cluster index show the way 05's replacement went and what a client saw."""
    held = {"at": "t", "stage": "05-serve", "kind": "front_held",
            "data": {"way": "drained stop", "drain_timeout_s": 30, "asks": 80, "held": 12, "refused": 0, "failed": 0,
                     "seconds without service (as a client saw it)": 41.5}}
    lab = tmp_path / "lab"
    fronted = archive.read_run(make_run(lab, "20261201T100000Z", events=[held]))
    assert archive.row(fronted)["redeploy"] == ("drained stop: 41.5 s without service, 12 held, 0 refused, 0 failed, "
                                                "drain 30 s at most")
    assert archive.row(archive.read_run(make_run(lab, "20261201T110000Z", events=[OOM])))["redeploy"] == "-"
