"""The serve stage: the `vllm serve` commands from params, their launch in the node containers, the
readiness wait (health, models, every node's process alive), the smoke test, and one remediated retry."""
from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx
from tenacity import Retrying, retry_if_result, wait_fixed

from ..core import probes
from ..core.errors import ProbeOutputError, SparkbookError
from ..core.failures import Diagnosis, Remedy, classify, not_ready, remedy
from ..core.handoff import Endpoint
from ..core.nodes import Cluster, Node
from ..core.params import NodeSpec, Params, ServeSettings
from ..core.record import Alternative, Decision
from ..core.runtime import Place, Runtime, Spawned
from ..core.topology import address, lost

LOG_DIR = "/tmp/sparkbook/logs"
SERVING = f"{LOG_DIR}/serving.json"  # in the head's container: what serves there now (for reuse by a later run)
POLL_S = 1.0
TAIL_BYTES = 6000


# --- platform and executor -------------------------------------------------------------------------
@dataclass(frozen=True)
class Platform:
    """What the image runs on: `cuda` or `cpu`, with the versions that show it."""

    device: str
    vllm: str
    torch: str | None
    gpus: int

    @property
    def evidence(self) -> list[str]:
        return [f"vllm {self.vllm}", f"torch {self.torch}", f"torch.cuda.is_available() = {self.device == 'cuda'}",
                f"visible GPUs: {self.gpus}"]


def detect_platform(runtime: Runtime, node: Node, place: Place) -> Platform:
    """Ask the image itself (a `+cpu` vLLM build or no CUDA in torch means the CPU platform)."""
    out = runtime.exec(node, place, ["python3", "-c", probes.source("vllm_platform")], timeout=120)
    try:
        data = probes.parse(out, node=node.name, probe="the image's platform")
    except ProbeOutputError as exc:
        raise ServeError(f"{node.name}: cannot tell the image's platform (the probe's output has no {exc.missing}, "
                         f"{exc.received_bytes} bytes received): {(out.stderr or out.stdout)[-800:]}",
                         node=node.name) from exc
    cpu = data["vllm"].endswith("+cpu") or not data["cuda"]
    return Platform("cpu" if cpu else "cuda", data["vllm"], data["torch"], data["gpus"])


def choose_executor(params: Params, platform: Platform) -> tuple[str, Decision]:
    """Ray where the platform supports it and params ask for it; `mp` multi-node otherwise."""
    wanted = params.serve.executor
    multi = len(serving_nodes(params)) > 1
    if platform.device == "cpu" and wanted == "ray":
        return "mp", Decision(
            "Which distributed executor serves the model?", "mp" + (" multi-node" if multi else ""),
            f"vLLM's CPU build refuses Ray as executor (`current platform cpu does not support ray`); "
            f"the image is vLLM {platform.vllm}. Ray still runs in the node containers (04).",
            [Alternative("ray", "the image's platform is cpu: vLLM would refuse it at start-up")],
            platform.evidence + [f"params serve.executor = {wanted}"])
    other = "mp" if wanted == "ray" else "ray"
    return wanted, Decision(
        "Which distributed executor serves the model?", wanted, f"params ask for {wanted} and the "
        f"{platform.device} platform supports it", [Alternative(other, "not what params ask for")],
        platform.evidence + [f"params serve.executor = {wanted}"])


# --- the commands ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class ServeCommand:
    node: str
    argv: list[str]
    env: dict[str, str]


@dataclass(frozen=True)
class ServePlan:
    """The exact commands per node, and where the API will answer."""

    executor: str
    settings: ServeSettings
    commands: list[ServeCommand]
    base_url: str
    model: str
    model_dir: str = ""  # where the nodes load the model from (02's snapshot of model.hf_id); '' = from params

    def table(self) -> list[dict[str, str]]:
        return [{"node": c.node, "env": " ".join(f"{k}={v}" for k, v in c.env.items()),
                 "command": " ".join(c.argv)} for c in self.commands]


def serving_nodes(params: Params) -> list[NodeSpec]:
    """Head first, then workers, as many as the world size needs (a node without listed GPUs is one rank)."""
    world = params.serve.tensor_parallel_size * params.serve.pipeline_parallel_size
    chosen, slots = [], 0
    for spec in [params.head, *params.workers]:
        if slots >= world:
            break
        chosen.append(spec)
        slots += len(spec.gpus) or 1
    return chosen


def model_source(params: Params, model_dir: str = "") -> tuple[str, dict[str, str]]:
    """What `vllm serve` loads, and the env that keeps it there. model.path as is; model.hf_id from the
    snapshot 02 found in the node's cache (else by its id), with HF_HUB_CACHE naming that cache, which is
    mounted at the same path in the containers (not the containers' own ~/.cache), and HF_HUB_OFFLINE=1
    unless model.offline is false: a worker without internet then loads what is on its disk instead of
    asking the Hub."""
    model = params.model
    if model.path:
        return str(model.path), {}
    hub = model_dir.split("/models--")[0] if "/models--" in model_dir else (
        model.cache_dir if model.cache_dir.rstrip("/").endswith("/hub") else f"{model.cache_dir.rstrip('/')}/hub")
    env = {"HF_HUB_CACHE": hub, **({"HF_HUB_OFFLINE": "1"} if model.offline else {})}
    return model_dir or str(model.hf_id), env


def serve_argv(params: Params, settings: ServeSettings, executor: str, spec: NodeSpec, rank: int,
               nnodes: int, model_dir: str = "") -> list[str]:
    """One node's `vllm serve` argv, every value from params (the model as `model_source` has it)."""
    model, _ = model_source(params, model_dir)
    argv = ["vllm", "serve", model, "--served-model-name", params.model.served_name,
            "--host", str(settings.host), "--port", str(settings.port),
            "--tensor-parallel-size", str(settings.tensor_parallel_size),
            "--pipeline-parallel-size", str(settings.pipeline_parallel_size),
            "--distributed-executor-backend", executor, "--dtype", settings.dtype]
    if executor == "mp" and nnodes > 1:
        argv += ["--nnodes", str(nnodes), "--node-rank", str(rank), "--master-addr", str(params.head.fabric_ip),
                 "--master-port", str(settings.master_port)]
        if rank > 0:
            argv.append("--headless")
    for flag, value in (("--max-model-len", settings.max_model_len), ("--max-num-seqs", settings.max_num_seqs),
                        ("--gpu-memory-utilization", settings.gpu_memory_utilization),
                        ("--kv-cache-memory-bytes", settings.kv_cache_memory_bytes),
                        ("--reasoning-parser", settings.reasoning_parser),
                        ("--tool-call-parser", settings.tool_call_parser), ("--chat-template", settings.chat_template)):
        if value is not None:
            argv += [flag, str(value)]
    if settings.tool_call_parser:
        argv.append("--enable-auto-tool-choice")
    if settings.enforce_eager:
        argv.append("--enforce-eager")
    return argv + list(settings.extra_args)


def plan(params: Params, executor: str, settings: ServeSettings | None = None, model_dir: str = "") -> ServePlan:
    """Commands for every node that serves: the head alone for `ray`, one rank per node for `mp`; `model_dir`
    is where 02 found model.hf_id on the nodes (ModelFacts.dir_on_nodes)."""
    settings = settings or params.serve
    _, model_env = model_source(params, model_dir)
    nodes = serving_nodes(params) if executor == "mp" else [params.head]
    # the ray executor joins the cluster 04 formed; without RAY_ADDRESS, ray.init() looks for the last
    # cluster in the default temp dir (not 04's --temp-dir) and may start a private local instance instead
    joins = {"RAY_ADDRESS": address(params)} if executor == "ray" else {}
    commands = [ServeCommand(spec.name, serve_argv(params, settings, executor, spec, rank, len(nodes), model_dir),
                             {**joins, **model_env, **settings.env, **settings.node_env.get(spec.name, {})})
                for rank, spec in enumerate(nodes)]
    return ServePlan(executor, settings, commands, f"http://{params.head.fabric_ip}:{settings.port}",
                     params.model.served_name, model_dir)


# --- launch and readiness --------------------------------------------------------------------------
class ServeError(SparkbookError):
    """Serving could not start; the message names the node and the classified cause."""

    stage = "05-serve"


@dataclass(frozen=True)
class Launch:
    plan: ServePlan
    attempt: int
    spawned: dict[str, Spawned]
    started_at: float


def log_path(attempt: int) -> str:
    return f"{LOG_DIR}/serve-{attempt}.log"


def _host_port(serve_plan: ServePlan) -> tuple[str, str]:
    """The serve address of the plan's base URL, as (host, port)."""
    host, port = serve_plan.base_url.rsplit("/", 1)[-1].rsplit(":", 1)
    return host, port


def launch(cluster: Cluster, runtime: Runtime, where: dict[str, Place], serve_plan: ServePlan,
           attempt: int = 1) -> Launch:
    """Spawn every node's command in its container (head first), logs to a file per attempt; worker ranks
    follow the head's API (they end when it is gone: probes/follow.py)."""
    t0 = time.monotonic()
    host, port = _host_port(serve_plan)
    follow = probes.source("follow")
    spawned = {c.node: runtime.spawn(cluster.nodes[c.node], where[c.node],
                                     c.argv if rank == 0 else ["python3", "-c", follow, host, port, *c.argv],
                                     log_path(attempt), env=c.env)
               for rank, c in enumerate(serve_plan.commands)}
    return Launch(serve_plan, attempt, spawned, t0)


def stop_serving(cluster: Cluster, runtime: Runtime, where: dict[str, Place], launched: Launch) -> None:
    """End the serve processes of `launched` (their process groups); the containers and Ray stay."""
    cluster.fan_out(lambda n: runtime.kill(n, where[n.name], launched.spawned[n.name]),
                    [cluster.nodes[name] for name in launched.spawned])


@dataclass(frozen=True)
class Readiness:
    """How a launch ended: ready (with timings) or failed (with the classified cause and log tails)."""

    ok: bool
    seconds: float
    health_s: float | None
    models: list[str]
    tails: dict[str, str]
    diagnosis: Diagnosis | None = None


def _get(client: httpx.Client, url: str) -> httpx.Response | None:
    try:
        return client.get(url)
    except httpx.HTTPError:
        return None


def _tails(cluster: Cluster, runtime: Runtime, where: dict[str, Place], launched: Launch) -> dict[str, str]:
    def read(node: Node) -> str:
        return runtime.read(node, where[node.name], launched.spawned[node.name].log, tail_bytes=TAIL_BYTES)

    outcomes = cluster.fan_out(read, [cluster.nodes[n] for n in launched.spawned], timeout=60)
    return {n: (o.value if o.ok else f"(log unreadable: {o.error})") for n, o in outcomes.items()}


def _dead(cluster: Cluster, runtime: Runtime, where: dict[str, Place], launched: Launch) -> dict[str, str]:
    """Nodes whose container (any node's: Ray lives there too) or serve process is gone, with what was seen."""
    def check(node: Node) -> str:
        place = where[node.name]
        if not runtime.alive(node, place):
            return f"container {place.name} is not running"
        if node.name in launched.spawned and not runtime.running(node, place, launched.spawned[node.name]):
            return "its `vllm serve` process exited"
        return ""

    outcomes = cluster.fan_out(check, [cluster.nodes[n] for n in where], timeout=60)
    return {n: (o.value if o.ok else f"unreachable: {o.error}") for n, o in outcomes.items()
            if not o.ok or o.value}


def stop_earlier(cluster: Cluster, runtime: Runtime, where: dict[str, Place], attempts: int) -> None:
    """End serve processes an earlier run of this stage left in the containers (by their recorded IDs)."""
    def kill_all(node: Node) -> None:
        for attempt in range(1, attempts + 1):
            runtime.kill(node, where[node.name], Spawned(node.name, where[node.name].name, log_path(attempt)))

    cluster.fan_out(kill_all, [cluster.nodes[n] for n in where])


def wait_ready(cluster: Cluster, runtime: Runtime, where: dict[str, Place], launched: Launch, timeout_s: float,
               on_round: Callable[[float, str], None] = lambda s, note: None) -> Readiness:
    """Poll /health then /v1/models from here; every round also check each node's container and process,
    so a dead node ends the wait at once with its classified log tail."""
    base, model = launched.plan.base_url, launched.plan.model
    health_s = None

    def round_(client: httpx.Client) -> Readiness | None:
        """One look: Readiness once ready, dead or past `timeout_s` (counted from the launch); None to go on."""
        nonlocal health_s
        elapsed = time.monotonic() - launched.started_at
        if health_s is None:
            r = _get(client, f"{base}/health")
            health_s = elapsed if r is not None and r.status_code == 200 else None
        if health_s is not None:
            r = _get(client, f"{base}/v1/models")
            models = [m["id"] for m in r.json().get("data", [])] if r is not None and r.status_code == 200 else []
            if model in models:
                return Readiness(True, time.monotonic() - launched.started_at, health_s, models,
                                 _tails(cluster, runtime, where, launched))
        dead = _dead(cluster, runtime, where, launched)
        if dead or elapsed > timeout_s:
            tails = _tails(cluster, runtime, where, launched)
            cause = classify(tails, dead) if dead else not_ready(tails, launched.plan.commands[0].node, elapsed)
            return Readiness(False, elapsed, health_s, [], tails, cause)
        on_round(elapsed, "health OK, waiting for /v1/models" if health_s else _last_line(cluster, runtime,
                                                                                           where, launched))
        return None

    with httpx.Client(timeout=httpx.Timeout(3.0, connect=2.0)) as client:
        return Retrying(wait=wait_fixed(POLL_S), retry=retry_if_result(lambda ready: ready is None))(round_, client)


def _last_line(cluster: Cluster, runtime: Runtime, where: dict[str, Place], launched: Launch) -> str:
    head = launched.plan.commands[0].node
    text = runtime.read(cluster.nodes[head], where[head], launched.spawned[head].log, tail_bytes=400)
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return lines[-1][-120:] if lines else "(no output yet)"


@dataclass
class BringUp:
    """Every attempt of the serve stage, the remediations between them, and the one that is serving."""

    attempts: list[tuple[Launch, Readiness]] = field(default_factory=list)
    remedies: list[Remedy] = field(default_factory=list)
    reuse: Decision | None = None  # whether a server already running was kept
    reused_from: dict[str, object] | None = None  # its record (SERVING) when it was

    @property
    def ok(self) -> bool:
        return bool(self.attempts) and self.attempts[-1][1].ok

    @property
    def launched(self) -> Launch:
        return self.attempts[-1][0]

    @property
    def readiness(self) -> Readiness:
        return self.attempts[-1][1]

    def decisions(self) -> list[Decision]:
        retries = [Decision(f"How to retry after {r.cause}?", ", ".join(f"{k}={v}" for k, v in r.change.items()),
                            r.reason, [Alternative(o, why) for o, why in r.alternatives],
                            [f"attempt {i + 1}: {self.attempts[i][1].diagnosis.summary()}"])
                   for i, r in enumerate(self.remedies)]
        return ([self.reuse] if self.reuse else []) + retries

    def table(self) -> list[dict[str, object]]:
        return [{"attempt": launch_.attempt, "ready": r.ok, "seconds": round(r.seconds, 1),
                 "health after s": None if r.health_s is None else round(r.health_s, 1),
                 "cause": r.diagnosis.cause if r.diagnosis else "", "node": r.diagnosis.node if r.diagnosis else "",
                 "evidence": r.diagnosis.evidence[-160:] if r.diagnosis else ""} for launch_, r in self.attempts]


def port_taken(cluster: Cluster, runtime: Runtime, where: dict[str, Place],
               serve_plan: ServePlan) -> Diagnosis | None:
    """The classified cause when something already listens on the serve address, else None: found before
    launching (vLLM itself reports it only after loading the model, minutes on a loaded node)."""
    head, port = serve_plan.commands[0].node, _host_port(serve_plan)[1]
    host = str(serve_plan.settings.host)  # where vLLM will bind: 0.0.0.0 collides with a listener on any address
    r = runtime.exec(cluster.nodes[head], where[head], ["python3", "-c", probes.source("bind"), host, port], timeout=30)
    try:
        bound = probes.parse(r, node=head, probe=f"bind {host}:{port}")
    except ProbeOutputError:
        return None  # no whole answer: the launch reports what is wrong
    if bound["bound"] or "Errno 98" not in bound["error"]:
        return None
    return classify({head: f"{host}:{port}: {bound['error']}"})


def missing_chat_template(cluster: Cluster, runtime: Runtime, where: dict[str, Place],
                          serve_plan: ServePlan) -> str:
    """Where serve.chat_template is not a file as each serving node's container sees it ("" when it is, or when
    params name none): vLLM would report it only after loading the model."""
    path = serve_plan.settings.chat_template
    if path is None:
        return ""
    nodes = [cluster.nodes[c.node] for c in serve_plan.commands]
    outcomes = cluster.fan_out(lambda n: runtime.exec(n, where[n.name], ["test", "-f", path], timeout=30).ok, nodes,
                               timeout=60)
    return ", ".join(n for n, o in outcomes.items() if not (o.ok and o.value))


def bring_up(params: Params, cluster: Cluster, runtime: Runtime, where: dict[str, Place], serve_plan: ServePlan,
             on_round: Callable[[float, str], None] = lambda s, note: None, floor: float | None = None) -> BringUp:
    """Launch and wait; on a failure with a known remediation (and serve.retry_with_remediation), stop the
    serve processes, apply it and try again (at most serve.max_remedies times). `floor` is the lowest
    gpu_memory_utilization that still holds weights and KV cache (`modelinfo.utilization_floor`; None: unknown,
    a graph-capture OOM goes straight to --enforce-eager). Raises ServeError, launching
    nothing, when 04's Ray cluster is no longer whole (a node's container or Ray process is gone), the
    serve port is taken on the head or serve.chat_template is not there."""
    gone = lost(params, cluster, runtime)
    if gone:
        raise ServeError("the Ray cluster of 04 is broken: " + "; ".join(f"{n}: {why}" for n, why in gone.items()),
                         remediation="run 04 again to re-form it")
    found, why = find_running(cluster, runtime, where, serve_plan)
    if found is not None:
        return found
    result, current = BringUp(reuse=_start_decision(why)), serve_plan
    stop_earlier(cluster, runtime, where, params.serve.max_remedies + 1)
    taken = port_taken(cluster, runtime, where, serve_plan)
    if taken is not None:
        raise ServeError(f"serving did not start: {taken.summary()}")
    lacking = missing_chat_template(cluster, runtime, where, serve_plan)
    if lacking:
        raise ServeError(f"serve.chat_template: {serve_plan.settings.chat_template} is not a file where `vllm serve` "
                         f"runs on {lacking}", node=lacking.split(", ")[0],
                         remediation=f"put the template on every node under model.cache_dir ({params.model.cache_dir}, "
                                     "which the node containers mount at the same path) or correct serve.chat_template")
    for attempt in range(1, params.serve.max_remedies + 2):
        launched = launch(cluster, runtime, where, current, attempt)
        ready = wait_ready(cluster, runtime, where, launched, params.serve.ready_timeout_s, on_round)
        result.attempts.append((launched, ready))
        if ready.ok:
            _remember(cluster, runtime, where, serve_plan, result)
            return result
        stop_serving(cluster, runtime, where, launched)
        fix = remedy(ready.diagnosis, current.settings, floor) if params.serve.retry_with_remediation else None
        if fix is None or attempt > params.serve.max_remedies:
            return result
        result.remedies.append(fix)
        current = plan(params, current.executor, fix.settings, current.model_dir)
    return result


# --- reuse on a second run --------------------------------------------------------------------------
def _plan_data(p: ServePlan) -> dict[str, object]:
    return json.loads(json.dumps({"executor": p.executor, "settings": p.settings.model_dump(mode="json"),
                                  "commands": [dataclasses.asdict(c) for c in p.commands], "base_url": p.base_url,
                                  "model": p.model, "model_dir": p.model_dir}))


def _plan_from(data: dict) -> ServePlan:
    return ServePlan(data["executor"], ServeSettings.model_validate(data["settings"]),
                     [ServeCommand(**c) for c in data["commands"]], data["base_url"], data["model"],
                     data.get("model_dir", ""))


def _remember(cluster: Cluster, runtime: Runtime, where: dict[str, Place], requested: ServePlan,
              result: BringUp) -> None:
    """Write what serves now (the plan asked for, the one running after remedies) into the head's container."""
    head = requested.commands[0].node
    record = {"requested": _plan_data(requested), "running": _plan_data(result.launched.plan),
              "attempt": result.launched.attempt, "attempts": len(result.attempts),
              "ready_s": round(result.readiness.seconds, 1)}
    runtime.exec(cluster.nodes[head], where[head], ["sh", "-c", 'printf %s "$1" >"$0"', SERVING, json.dumps(record)],
                 timeout=30).check()


def find_running(cluster: Cluster, runtime: Runtime, where: dict[str, Place],
                 requested: ServePlan) -> tuple[BringUp | None, str]:
    """The server a previous run started, when it is still right: started from this very plan, every node's
    `vllm serve` running, /health and /v1/models answering. Otherwise None and why not."""
    head = requested.commands[0].node
    if not runtime.alive(cluster.nodes[head], where[head]):
        return None, f"no container on {head}, so no server to reuse"
    try:
        record = json.loads(runtime.read(cluster.nodes[head], where[head], SERVING))
    except ValueError:
        return None, f"no record of a server in {head}'s container ({SERVING})"
    if record["requested"] != _plan_data(requested):
        old, new = record["requested"], _plan_data(requested)
        settings = {**old["settings"], **new["settings"]}
        differ = sorted({f"serve.{k}" for k in settings if old["settings"].get(k) != new["settings"].get(k)}
                        | {k for k in new if k != "settings" and old.get(k) != new[k]})
        return None, f"the running server was started from another plan (differs in: {', '.join(differ)})"
    running = _plan_from(record["running"])
    spawned = {c.node: Spawned(c.node, where[c.node].name, log_path(record["attempt"])) for c in running.commands}
    dead = [n for n, sp in spawned.items() if not runtime.running(cluster.nodes[n], where[n], sp)]
    if dead:
        return None, f"the earlier `vllm serve` is not running on {', '.join(dead)}"
    with httpx.Client(timeout=httpx.Timeout(10.0, connect=3.0)) as client:
        health, listed = _get(client, f"{running.base_url}/health"), _get(client, f"{running.base_url}/v1/models")
    models = [m["id"] for m in listed.json().get("data", [])] \
        if listed is not None and listed.status_code == 200 else []
    if health is None or health.status_code != 200 or running.model not in models:
        return None, f"the earlier server does not answer /health with {running.model} listed at {running.base_url}"
    launched = Launch(running, record["attempt"], spawned, time.monotonic())
    ready = Readiness(True, 0.0, 0.0, models, _tails(cluster, runtime, where, launched))
    return BringUp([(launched, ready)], reuse=Decision(
        "Reuse the running server or start a new one?", "reused: the server already running",
        "it was started from exactly this plan (same commands, settings and environment), every node's `vllm serve` "
        "still runs, and it answers /health with the model listed",
        [Alternative("start vllm serve again", "would stop a healthy server of the same model and configuration")],
        [f"{running.base_url}/health: 200", f"/v1/models: {', '.join(models)}",
         f"started by attempt {record['attempt']}, ready then in {record['ready_s']} s"]), reused_from=record), ""


def _start_decision(why: str) -> Decision:
    return Decision("Reuse the running server or start a new one?", "start vllm serve", why,
                    [Alternative("reuse the running server", why)])


def log_tails(result: BringUp) -> dict[str, str]:
    """Every attempt's log tail per node, named for the run dir's logs/ folder."""
    return {f"serve-{node}-attempt{launched.attempt}.log": text
            for launched, ready in result.attempts for node, text in ready.tails.items()}


def failure_message(result: BringUp) -> str:
    d = result.readiness.diagnosis
    return f"serving did not start ({len(result.attempts)} attempt(s)): {d.summary() if d else 'unknown'}"


# --- smoke test ------------------------------------------------------------------------------------
REASONING_TOKENS = 1024  # room for a thinking model to finish thinking and answer ("Say hello." ~400 for Qwen3.5)
PLAIN_TOKENS = 32
THINK_TAGS = ("<think>", "</think>")


@dataclass(frozen=True)
class Reply:
    """One reply as a client reads it: the answer (chat `content` or completion `text`), the separated thinking,
    and what is wrong with it ("" when nothing is), with what to change."""

    text: str
    reasoning: str
    finish_reason: str
    problem: str = ""
    remediation: str = ""


@dataclass(frozen=True)
class Smoke:
    kind: str
    prompt: str
    text: str
    seconds: float
    completion_tokens: int
    reasoning: str = ""
    finish_reason: str = ""
    problem: str = ""
    remediation: str = ""


def smoke_tokens(settings: ServeSettings) -> int:
    """max_tokens per smoke request: serve.smoke_max_tokens, else room to think where a reasoning parser runs."""
    return settings.smoke_max_tokens or (REASONING_TOKENS if settings.reasoning_parser else PLAIN_TOKENS)


def judge(kind: str, data: dict, reasoning_parser: str | None, max_tokens: int) -> Reply:
    """Read a chat completion (`kind` "chat") or completion response body as vLLM returns it and say whether
    its answer is where clients read it: chat text in `content` without think tags, the thinking (if any) in
    `reasoning_content` (`reasoning` in vLLM >= 0.11)."""
    choice = data["choices"][0]
    finish = choice.get("finish_reason") or ""
    if kind != "chat":
        text = choice.get("text") or ""
        return Reply(text, "", finish) if text.strip() else Reply(text, "", finish, *_nothing(finish, max_tokens))
    message = choice["message"]
    text = message.get("content") or ""
    reasoning = message.get("reasoning_content") or message.get("reasoning") or ""
    parser = f"--reasoning-parser {reasoning_parser}" if reasoning_parser else "no reasoning parser"
    if any(tag in text for tag in THINK_TAGS):
        return Reply(text, reasoning, finish, f"the answer holds the model's thinking with its {'/'.join(THINK_TAGS)} "
                     f"tags ({parser}): clients would show the thinking as the answer",
                     "set serve.reasoning_parser to the model's parser (qwen3 for Qwen3/Qwen3.5, deepseek_r1 for "
                     "DeepSeek-R1; vLLM docs: Reasoning Outputs)" if reasoning_parser is None else
                     f"the parser {reasoning_parser} does not match the model's output: set serve.reasoning_parser to "
                     "the one for this model and its chat template (vLLM docs: Reasoning Outputs)")
    if not text.strip() and reasoning.strip():
        if finish == "length":
            return Reply(text, reasoning, finish, f"all {max_tokens} tokens went to thinking (finish_reason length, "
                         "content empty): the model was cut off before it answered",
                         f"raise serve.smoke_max_tokens (now {max_tokens})")
        return Reply(text, reasoning, finish, f"the whole answer is in reasoning_content and content is empty though "
                     f"the model finished (finish_reason {finish or 'none'}): {parser} does not match the model's "
                     "output", "set serve.reasoning_parser to the parser for this model and its chat template, or "
                     "remove it for a model that does not think (vLLM docs: Reasoning Outputs)")
    if not text.strip():
        return Reply(text, reasoning, finish, *_nothing(finish, max_tokens))
    return Reply(text, reasoning, finish)


def _nothing(finish: str, max_tokens: int) -> tuple[str, str]:
    return (f"no text in the reply (neither content nor reasoning; finish_reason {finish or 'none'}, "
            f"max_tokens {max_tokens})", "read the serve log tail in the run's logs/ and send the request by hand")


def smoke_test(base_url: str, model: str, settings: ServeSettings | None = None,
               timeout_s: float = 180) -> list[Smoke]:
    """One chat completion and one completion, each judged (`judge`); their text, time and token counts."""
    settings = settings or ServeSettings()
    max_tokens, out = smoke_tokens(settings), []
    with httpx.Client(timeout=timeout_s) as client:
        for kind, path, body, prompt in (
                ("chat", "/v1/chat/completions", {"messages": [{"role": "user", "content": "Say hello."}]}, "Say hello."),
                ("completion", "/v1/completions", {"prompt": "The capital of France is"}, "The capital of France is")):
            t0 = time.monotonic()
            r = client.post(base_url + path, json={"model": model, "max_tokens": max_tokens, "temperature": 0, **body})
            r.raise_for_status()
            data = r.json()
            reply = judge(kind, data, settings.reasoning_parser, max_tokens)
            out.append(Smoke(kind=kind, prompt=prompt, seconds=time.monotonic() - t0,
                             completion_tokens=data["usage"]["completion_tokens"], **dataclasses.asdict(reply)))
    return out


def check_smoke(smoke: list[Smoke]) -> None:
    """ServeError, naming the request and what to change, for the first reply whose answer is not usable."""
    for s in smoke:
        if s.problem:
            raise ServeError(f"smoke test, {s.kind} request ({s.prompt!r}): {s.problem}", remediation=s.remediation)


def smoke_decision(settings: ServeSettings) -> Decision:
    """What the smoke test expects of the chat reply, given how vLLM was told to shape the model's output."""
    tokens = smoke_tokens(settings)
    evidence = [f"--host {settings.host}",
                f"--reasoning-parser {settings.reasoning_parser}" if settings.reasoning_parser
                else "no serve.reasoning_parser",
                f"--tool-call-parser {settings.tool_call_parser} --enable-auto-tool-choice" if settings.tool_call_parser
                else "no serve.tool_call_parser (no tool calls)",
                f"--chat-template {settings.chat_template}" if settings.chat_template
                else "the model's own chat template", f"max_tokens {tokens}"]
    if settings.reasoning_parser:
        return Decision("What must the smoke test's chat reply hold?",
                        "the answer in content, the thinking in reasoning_content",
                        f"vLLM separates the model's thinking with the {settings.reasoning_parser} parser; {tokens} "
                        "tokens leave room to finish thinking and answer",
                        [Alternative("any text in content (32 tokens)", "a reply cut off while thinking has no content, "
                                     "and thinking left in content would pass as an answer")], evidence)
    return Decision("What must the smoke test's chat reply hold?", "text in content, without think tags",
                    f"no reasoning parser runs, so a model that thinks would put its tagged thinking in content: the "
                    f"test fails on it ({tokens} tokens)",
                    [Alternative("the answer in content, the thinking in reasoning_content",
                                 "vLLM returns no reasoning_content without serve.reasoning_parser")], evidence)


def endpoint(result: BringUp) -> Endpoint:
    """What 06 needs: where to send requests, and exactly what was started where."""
    launched = result.launched
    return Endpoint(base_url=launched.plan.base_url, model=launched.plan.model, executor=launched.plan.executor,
                    commands={c.node: c.argv for c in launched.plan.commands},
                    env={c.node: c.env for c in launched.plan.commands},
                    logs={n: s.log for n, s in launched.spawned.items()},
                    ready_s=result.reused_from["ready_s"] if result.reused_from
                    else round(result.readiness.seconds, 1),
                    attempts=result.reused_from["attempts"] if result.reused_from else len(result.attempts),
                    reused=result.reused_from is not None)
