"""04's front door: what each node's preview shows is what `start_containers` is handed and starts (issue 39, item 3),
and the branches the notebook's cells held (kept or started anew, gate, fabric test), with the stage's remote steps
replaced by values. The runtime here is a second implementation of sparkbook's own Runtime interface, in-process:
it starts nothing and remembers each start it is given."""
from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path

import pandas as pd
import pytest

from sparkbook.core.cluster import probes
from sparkbook.core.cluster.context import Context
from sparkbook.core.cluster.nodes import Cluster, Node, Result
from sparkbook.core.cluster.runtime import Place, StartSpec
from sparkbook.core.values.evidence import Decision, Event, Shown, table_rows, to_data
from sparkbook.core.values.fanout import FanOut, Outcome
from sparkbook.core.values.handoff import FabricProof, ImageChoice, RayCluster
from sparkbook.core.values.params import Params
from sparkbook.core.values.state import Handoffs
from sparkbook.stages import raycluster
from sparkbook.stages.raycluster import containers, fabrictest, formation

PARAMS = Path(__file__).resolve().parents[2] / "params"
IMAGE = ImageChoice(ref="sparkbook-lab/vllm:new", id="sha256:" + "ab" * 32, vllm_version="0.17.1",
                    ray_version="2.49.0", nodes={})


class InProcess:
    """Runtime's verbs that 04's preview and start_containers use, answered in-process; each start kept."""

    not_reusable: str | None = "in-process: no container a previous run left"
    place_word = "container"
    own_place = True

    def __init__(self, serving: str | None = None) -> None:
        self.started: dict[str, StartSpec] = {}
        self.serving = serving  # the head place's serving record (None: no place stands)
        self.aside: list[str] = []  # the nodes whose place was set aside

    def set_aside(self, node: Node, place: Place) -> bool:
        self.aside.append(node.name)
        return self.serving is not None

    def alive(self, node: Node, place: Place) -> bool:
        return self.serving is not None

    def read(self, node: Node, place: Place, path: str, *, tail_bytes: int = 0) -> str:
        return self.serving or ""

    def preflight(self, cluster: Cluster) -> FanOut[None]:
        return FanOut({n.name: Outcome(n.name) for n in cluster})

    def devices(self, node: Node) -> list[str]:
        return ["/dev/infiniband"] if node.name == "lab-1" else []

    def start_spec(self, node: Node, place: Place, *, gpus: bool, devices: Sequence[str] = ()) -> StartSpec:
        return StartSpec(node.name, place.name, place.image, ("sleep", "infinity"), dict(place.env),
                         ("HF_TOKEN",), devices=tuple(devices), gpus=gpus)

    def lacks(self, node: Node, ref: str, image_id: str | None = None) -> str | None:
        return None

    def start(self, node: Node, spec: StartSpec) -> str:
        self.started[node.name] = spec
        return f"c0ffee{node.name}"

    def existing(self, node: Node, place: Place) -> None:
        return None

    def exec(self, node: Node, place: Place, argv: Sequence[str], *, timeout: float = 120,
             env: dict[str, str] | None = None) -> Result:
        """The netdev_ips probe's reply: the node's fabric IP on its netdev."""
        doc = json.dumps({"addresses": [str(node.spec.fabric_ip)]})
        return Result(node.name, tuple(argv), 0, f"{probes.PREFIX}{doc}\n{probes.END}\n", "", datetime.now(UTC), 0.0)


def context(params: Params, tmp_path: Path, runtime: InProcess, image: ImageChoice = IMAGE) -> Context:
    return Context(params, Cluster(params), runtime, tmp_path, handoffs=Handoffs(given=(image,)))  # type: ignore[arg-type]


def test_each_node_starts_the_spec_its_preview_shows(lab: Params, tmp_path: Path) -> None:
    runtime = InProcess()
    ctx = context(lab, tmp_path, runtime)
    seen = raycluster.preview(ctx)
    started = containers.start_containers(ctx.with_image(IMAGE.ref), seen.specs, IMAGE.id)
    assert runtime.started == seen.specs and list(seen.specs) == ["lab-0", "lab-1"]
    assert [r["node container"] for r in map(raycluster.NodeStart.row, seen.starts)] == \
        [runtime.started[n].command_line() for n in ("lab-0", "lab-1")]
    assert [c.devices for c in started] == [[], ["/dev/infiniband"]], "the table shows the devices that started"
    assert "--device /dev/infiniband:/dev/infiniband" in seen.starts[1].row()["node container"]
    assert "HF_TOKEN" not in seen.starts[0].row()["env (names)"], "no secret in a container's env (issue 43)"
    assert "VLLM_HOST_IP" in seen.starts[0].row()["env (names)"]


def test_the_preview_assumes_the_cluster_it_would_form(lab: Params, tmp_path: Path) -> None:
    seen = raycluster.preview(context(lab, tmp_path, InProcess()))
    ray = seen.assumed[0]
    assert isinstance(ray, RayCluster) and ray.address == "10.77.0.10:" + str(lab.ray.port)
    assert set(ray.containers) == {"lab-0", "lab-1"} and not ray.reused and ray.nodes == []
    assert seen.starts[0].ray[:3] == ["ray", "start", "--block"] and "--head" in seen.starts[0].ray
    assert not seen.kept.ok and "in-process" in str(seen.kept.reason)


def test_an_image_without_its_id_is_never_kept(lab: Params, tmp_path: Path) -> None:
    unknown = IMAGE.model_copy(update={"id": None})
    seen = raycluster.preview(context(lab, tmp_path, InProcess(), unknown))
    assert not seen.kept.ok and "not known before 03" in str(seen.kept.reason)


def formed(monkeypatch: pytest.MonkeyPatch, gate_ok: bool = True, fabric_ok: bool = True) -> list[str]:
    """formation's and fabrictest's remote steps replaced by values; the list names each step as it is called."""
    called: list[str] = []
    join = formation.Join(["lab-0", "lab-1"], [], 1.0, None)
    rows = [formation.GateRow("lab-1", "10.77.0.11", "10.77.0.11", "10.77.0.11", "1 CPU", "1 CPU",
                              "ok" if gate_ok else "not in the Ray cluster")]
    limits = fabrictest.Limits("cpu", 8000.0, 0.1, "the default for cpu")
    verdict = fabrictest.FabricVerdict(limits, [] if fabric_ok else ["busbw at 8 MiB is 0.01 Gb/s"], ["the link"])

    def step(name, value):
        def called_with(*args, **kwargs):
            called.append(name)
            return value
        return called_with

    monkeypatch.setattr(formation, "start_ray", step("start_ray", []))
    monkeypatch.setattr(formation, "wait_for_join", step("wait_for_join", join))
    monkeypatch.setattr(formation, "status", step("status", Result("lab-0", ("ray", "status"), 0, "Active:", "",
                                                                    datetime.now(UTC), 0.1)))
    monkeypatch.setattr(formation, "gate", step("gate", formation.Gate(rows)))
    monkeypatch.setattr(fabrictest, "single_rank", lambda params: None)
    monkeypatch.setattr(fabrictest, "run_allreduce", step("run_allreduce", "test"))
    monkeypatch.setattr(fabrictest, "verdict", step("verdict", verdict))
    monkeypatch.setattr(fabrictest, "figure", step("figure", "figure"))
    monkeypatch.setattr(fabrictest, "proof", step("proof", FabricProof(backend="gloo", world=2, small_bytes=1,
                                                                      small_us=1.0, large_bytes=2,
                                                                      large_busbw_gbps=1.0)))
    return called


def kinds(outcome: raycluster.RayOutcome) -> list[str]:
    return [r.kind if isinstance(r, Event) else f"decision: {r.choice}" for r in outcome.records
            if isinstance(r, (Event, Decision))]


def test_run_records_in_order_and_hands_on_the_proof_then_the_cluster(monkeypatch, lab, tmp_path) -> None:
    called = formed(monkeypatch)
    ctx = context(lab, tmp_path, InProcess())
    out = raycluster.run(ctx, raycluster.preview(ctx), confirm_replace=False)
    assert out.error is None and called == ["start_ray", "wait_for_join", "status", "gate", "run_allreduce",
                                            "verdict", "figure", "proof"]
    assert kinds(out) == ["decision: form Ray", "decision: start new containers and Ray", "ray_join", "ray_gate",
                          fabrictest.EVENT, "fabric_verdict"]
    assert [type(h) for h in out.handoffs] == [FabricProof, RayCluster] and list(out.figures) == ["fabric-allreduce.png"]
    assert out.status_results[0].stdout == "Active:"


def test_with_vllms_own_multinode_launch_no_ray_starts_and_the_fabric_is_still_proven(monkeypatch, lab, tmp_path):
    """Issue 45: serve.executor mp (or an image without Ray, executor unset): the containers, the fabric test and a
    hand-off without a Ray address; not one Ray step runs."""
    called = formed(monkeypatch)
    for params, image in ((lab.model_copy(update={"serve": lab.serve.model_copy(update={"executor": "mp"})}), IMAGE),
                          (lab, IMAGE.model_copy(update={"ray_version": None}))):
        called.clear()
        ctx = context(params, tmp_path, InProcess(), image)
        seen = raycluster.preview(ctx)
        assert seen.no_ray is not None and seen.address is None and all(s.ray == [] for s in seen.starts)
        assert "no Ray" in seen.shown()[1].title and seen.starts[0].row()["ray start"] == "- (no Ray)"
        out = raycluster.run(ctx, seen, confirm_replace=False)
        assert out.error is None and called == ["run_allreduce", "verdict", "figure", "proof"], called
        assert kinds(out) == ["decision: no Ray", "decision: start new containers", fabrictest.EVENT, "fabric_verdict"]
        assert out.ray is not None and out.ray.address is None and set(out.ray.containers) == {"lab-0", "lab-1"}
        assert "no Ray on this path" in str(out.join_shown()[0].value)
        assert "no Ray on this path" in str(out.ray_start_shown()[0].value)


def test_a_failed_gate_is_the_outcomes_error_after_its_evidence(monkeypatch, lab, tmp_path) -> None:
    called = formed(monkeypatch, gate_ok=False)
    ctx = context(lab, tmp_path, InProcess())
    out = raycluster.run(ctx, raycluster.preview(ctx), confirm_replace=False)
    assert isinstance(out.error, formation.GateFailed) and "lab-1: not in the Ray cluster" in str(out.error)
    assert "run_allreduce" not in called and kinds(out)[-1] == "ray_gate" and out.handoffs == []
    assert "04 stopped" in str(out.summary_shown()[0].value)


def test_a_fabric_below_its_limits_keeps_its_figure_and_hands_on_nothing(monkeypatch, lab, tmp_path) -> None:
    formed(monkeypatch, fabric_ok=False)
    ctx = context(lab, tmp_path, InProcess())
    out = raycluster.run(ctx, raycluster.preview(ctx), confirm_replace=False)
    assert isinstance(out.error, fabrictest.FabricTestFailed) and "busbw at 8 MiB" in str(out.error)
    assert out.handoffs == [] and list(out.figures) == ["fabric-allreduce.png"]
    assert kinds(out)[-1] == "fabric_verdict"


@pytest.fixture
def health_server():
    """An HTTP server on localhost whose /health answers 200: a live server's, as 04 asks it."""
    import http.server
    import threading

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802
            self.send_response(200 if self.path == "/health" else 404)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_containers_that_hold_a_live_server_are_replaced_only_when_confirmed(lab: Params, tmp_path: Path,
                                                                             health_server: str,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 40, item 1: a new image would replace the node containers, whose server answers: without
    confirm_replace 04 stops before touching them, saying whose server it is; with it, it replaces them."""
    record = json.dumps({"running": {"base_url": health_server, "model": "hyv4-tiny"}, "run": "20261203T100000Z"})
    runtime = InProcess(record)
    seen = raycluster.preview(context(lab, tmp_path, runtime))
    assert seen.live is not None and seen.live.run == "20261203T100000Z" and not seen.kept.ok
    assert any("only with -p confirm_replace=true" in str(s.value) for s in seen.shown())
    out = raycluster.run(context(lab, tmp_path, runtime), seen, confirm_replace=False)
    assert isinstance(out.error, containers.RayStageError) and "04 would stop a live server" in out.error.message
    assert runtime.started == {} and runtime.aside == [] and kinds(out)[-1] == "decision: keep them, stop here"
    formed(monkeypatch)
    out = raycluster.run(context(lab, tmp_path, runtime), seen, confirm_replace=True)
    assert out.error is None and set(runtime.started) == {"lab-0", "lab-1"}
    assert sorted(runtime.aside) == ["lab-0", "lab-1"], "kept aside before the new containers start"
    kept = next(r for r in out.records if isinstance(r, Event) and r.kind == "containers_set_aside")
    assert isinstance(kept.data, dict) and kept.data["run"] == "20261203T100000Z" and sorted(kept.data["nodes"]) == ["lab-0", "lab-1"]
    assert kinds(out).index("decision: replace them") < kinds(out).index("containers_set_aside")
    assert raycluster.preview(context(lab, tmp_path, InProcess(json.dumps(
        {"running": {"base_url": "http://127.0.0.1:9", "model": "m"}})))).live is None, "a server that does not answer"



UNPROBED = ImageChoice(ref="sparkbook-lab/vllm:absent", id=None, vllm_version=None, ray_version=None, nodes={})


def rendered(shown: Shown) -> str:
    """A shown value as `sparkbook plan` and the notebooks render it (a pandas table where it is table-like)."""
    rows = table_rows(to_data(shown.value))
    return pd.DataFrame(rows).to_string(index=False) if rows is not None else str(shown.value)


def test_an_image_03_has_not_probed_shows_its_versions_as_not_known_never_nan(lab: Params, tmp_path: Path) -> None:
    """Issue 54, item 6: before a first run whose probe of 03's first candidate did not answer, its vLLM and Ray are
    unknown: the table says so, where pandas rendered a None as NaN."""
    image = raycluster.preview(context(lab, tmp_path, InProcess(), UNPROBED)).shown()[0]
    assert image.title == "Image (03)" and "NaN" not in rendered(image)
    assert image.value == {"image": UNPROBED.ref, "id": "not known: 03 puts it on the nodes",
                           "vLLM": "not known: 03's probe of it tells", "Ray": "not known: 03's probe of it tells"}
    probed = raycluster.preview(context(lab, tmp_path, InProcess(), IMAGE.model_copy(update={"ray_version": None})))
    assert probed.shown()[0].value["Ray"] == "none", "a probed image without Ray has none"  # type: ignore[index]


def test_the_heading_does_not_guess_no_ray_for_an_image_not_probed(lab: Params, tmp_path: Path) -> None:
    """Executor unset (the lab's): whether Ray forms turns on the image; not probed, the preview says it is not known,
    starts no guess (`ray start` shown, as it would run with Ray) and hands 05 no RayCluster."""
    seen = raycluster.preview(context(lab, tmp_path, InProcess(), UNPROBED))
    title = seen.shown()[1].title
    assert "no Ray" not in title and title.startswith("Node containers, Ray not known yet") and UNPROBED.ref in title
    assert seen.no_ray is None and seen.address is None and seen.assumed == ()
    assert all(s.ray[:2] == ["ray", "start"] for s in seen.starts)


def test_where_the_params_decide_ray_an_image_not_probed_changes_nothing(lab: Params, tmp_path: Path) -> None:
    mp = lab.model_copy(update={"serve": lab.serve.model_copy(update={"executor": "mp"})})
    seen = raycluster.preview(context(mp, tmp_path, InProcess(), UNPROBED))
    assert seen.ray_unknown is None and seen.shown()[1].title.startswith("Node containers, no Ray: serve.executor is mp")
    ray = lab.model_copy(update={"serve": lab.serve.model_copy(update={"executor": "ray"})})
    seen = raycluster.preview(context(ray, tmp_path, InProcess(), UNPROBED))
    assert seen.ray_unknown is None and seen.shown()[1].title.startswith("Node containers and Ray (Ray address")
