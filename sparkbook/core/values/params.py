"""The params schema for one cluster, loaded from YAML with errors that name the file, field and line."""
from __future__ import annotations

import ipaddress
import json
import os
import posixpath
import re
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from .abarm import AbKind
from .errors import SparkbookError
from .redact import SECRET_NAME, secret_args, token_shaped

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")
_PATTERN = re.compile(r"^[A-Za-z0-9._@*?\[\]-]{1,128}$")
_PATH = re.compile(r"^/[A-Za-z0-9._/@+-]*$")
_IMAGE = re.compile(r"^[a-z0-9][a-z0-9._/-]*(:[A-Za-z0-9._-]{1,128})?(@sha256:[0-9a-f]{64})?$")
_DIGEST = re.compile(r"sha256:[0-9a-f]{64}")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_ENV_VALUE = re.compile(r"^[A-Za-z0-9 ._,:/@+=%{}\"'\[\]-]*$")
_NETDEV = re.compile(r"^[A-Za-z0-9._-]{1,15}$")
_ARG = re.compile(r"^[A-Za-z0-9._,:/@+=%{}\"'\[\] -]*$")
_HF_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")
_SIZE = re.compile(r"^[0-9]+[KMGkmg]?$")
_PROSE = re.compile(r"^[\w .,:?!'\"()/-]*$")  # a question in any script; no shell operators, no newline
USE_A_REFERENCE = ("put the value in the controller's environment and name its variable under `secrets` (the "
                   "processes 04 and 05 start get it by that name; the API key: serve.api_key_env)")


def _matches(regex: re.Pattern[str], what: str) -> AfterValidator:
    def check(value: str) -> str:
        if not regex.fullmatch(value):
            shown = "the value (not shown: it looks like a token)" if token_shaped(value) else repr(value)
            raise ValueError(f"{shown} is not a valid {what} (allowed: {regex.pattern})")
        return value

    return AfterValidator(check)


def _no_secret(value: str) -> str:
    """A value typed into an env or argv setting is recorded, shown and put on command lines: never a secret."""
    if token_shaped(value):
        raise ValueError(f"looks like a token (not shown): {USE_A_REFERENCE}")
    return value


def _secret_name(value: str) -> str:
    """A `secrets` entry names a variable; one that does not is never echoed (it may be the secret itself, pasted
    where its name belongs, and an error lands in CI logs): only its index, and a NAME=VALUE's name, are said."""
    if _ENV_NAME.fullmatch(value):
        return _no_secret(value)
    name, sep, _ = value.partition("=")
    if sep and _ENV_NAME.fullmatch(name):
        raise ValueError(f"give the variable's name ({name}), not NAME=VALUE: the value (not shown) belongs in the "
                         "controller's environment")
    raise ValueError("not an environment variable name (the entry is not shown: it may be a secret); name the "
                     "variable that holds the secret")


def _digest_pin(value: str) -> str:
    """A pin (`name@sha256:...`, `name:tag@sha256:...`) names the image's bytes: its digest must be whole, or the
    pin names nothing Docker can find and the run fails later, at 03's probe, far from the typo."""
    digest = value.partition("@")[2]
    if "@" in value and not _DIGEST.fullmatch(digest):
        raise ValueError(f"{value!r} has a malformed digest {digest!r}: a pin is name@sha256: and 64 lowercase hex "
                         "digits, as `docker image inspect --format '{{.RepoDigests}}' IMAGE` prints it")
    return value


def _not_an_option(value: str) -> str:
    """A unit name reaches systemctl and journalctl as an argument: one starting with `-` reads as an option there
    (`-Hroot@host.service` is `-H root@host.service`)."""
    if value.startswith("-"):
        raise ValueError(f"{value!r} starts with '-': systemctl would read it as an option; name the unit without it")
    return value


Name = Annotated[str, _matches(_NAME, "name")]
Pattern = Annotated[str, _matches(_PATTERN, "glob pattern")]
UnitPattern = Annotated[Pattern, AfterValidator(_not_an_option)]
RemotePath = Annotated[str, _matches(_PATH, "absolute path")]
Image = Annotated[str, AfterValidator(_digest_pin), _matches(_IMAGE, "image reference")]
EnvName = Annotated[str, _matches(_ENV_NAME, "environment variable name")]
EnvValue = Annotated[str, _matches(_ENV_VALUE, "environment value"), AfterValidator(_no_secret)]
NetDev = Annotated[str, _matches(_NETDEV, "network interface name")]
Arg = Annotated[str, _matches(_ARG, "command-line argument"), AfterValidator(_no_secret)]
Size = Annotated[str, _matches(_SIZE, "size (e.g. 128M, 1G)")]
Parser = Annotated[str, _matches(_NAME, "vLLM parser name")]
Prose = Annotated[str, _matches(_PROSE, "sentence (letters, digits, spaces, .,:?!'\"()/-)")]
Env = dict[EnvName, EnvValue]


# benchmark.depths left out: 0 and the deepest of these that fits the plan's window with the depth's prompt and output
DEPTH_LADDER = (4096, 2048, 1024, 512)
REASONING_TOKENS = 1024  # room for a thinking model to finish thinking and answer ("Say hello." ~400 for Qwen3.5)
PLAIN_TOKENS = 32
DEPTH_INPUT_LEN, DEPTH_OUTPUT_LEN = 512, 32


SYSTEM_DIRS = frozenset({"/run/lock", "/run/user", "/var/lock", "/var/run", "/var/tmp", "/var/lib", "/var/log",
                         "/var/cache", "/usr/local", "/usr/lib", "/usr/share", "/dev/shm"})  # and every top-level one


def _no_climb(value: str) -> str:
    """The path with `.` and doubled slashes folded (`//tmp` is `/tmp`); `..` refused, as it leads out of the
    directory it seems to be below."""
    if ".." in value.split("/"):
        raise ValueError(f"{value} has a `..` component; write the directory it leads to without `..`")
    return posixpath.normpath("/" + value.lstrip("/"))


PlainPath = Annotated[RemotePath, AfterValidator(_no_climb)]


def _own_dir(value: str) -> str:
    """A directory of sparkbook's own: not a system one other programs keep files in (it is made 0700 and the runbook
    writes as root there)."""
    if len(PurePosixPath(value).parts) < 3 or value in SYSTEM_DIRS:
        raise ValueError(f"{value} is a system directory that other programs keep files in; name a directory of "
                         "sparkbook's own below it (the default: ~/.sparkbook/NAME)")
    return value


OwnDir = Annotated[PlainPath, AfterValidator(_own_dir)]


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class SSHSettings(Strict):
    user: Name = Field("root", description="SSH user on every node (a node's ssh_user, or its ssh config entry's "
                       "User, first)")
    port: int = Field(22, ge=1, le=65535, description="SSH port on every node (a node's ssh_port first)")
    key_file: Path | None = Field(None, description="private key on this controller (relative to the params file)")
    known_hosts: Path | None = Field(None, description="known_hosts file the nodes' host keys are checked against "
                                     "(default ~/.ssh/known_hosts; relative to the params file)")
    config_file: Path | None = Field(None, description="ssh config whose Host entries resolve node hosts given as "
                                     "aliases (default ~/.ssh/config where it exists)")
    host_key_policy: Literal["strict", "trust_on_first_use"] = Field(
        "strict", description="strict: a host key must be known; trust_on_first_use: record an unknown one in "
        "known_hosts and its fingerprint in the run's evidence")
    connect_timeout_s: float = Field(10, gt=0, le=300, description="limit on one SSH connection's set-up")
    command_timeout_s: float = Field(120, gt=0, le=86400, description="default limit on one remote command")

    @model_validator(mode="after")
    def _files_exist(self) -> SSHSettings:
        if self.config_file is not None and not self.config_file.is_file():
            raise ValueError(f"config_file: {self.config_file} does not exist")
        if self.key_file is not None and not self.key_file.is_file():
            raise ValueError(f"key_file: {self.key_file} does not exist (for the lab: run `sparkbook lab up`)")
        if self.known_hosts is not None and self.host_key_policy == "strict" and not self.known_hosts.is_file():
            raise ValueError(f"known_hosts: {self.known_hosts} does not exist; strict host keys need it "
                             "(or set host_key_policy: trust_on_first_use to record the keys on first contact)")
        if self.host_key_policy == "trust_on_first_use" and self.known_hosts is None:
            raise ValueError("host_key_policy: trust_on_first_use needs a known_hosts file to record the "
                             "fingerprints it trusts")
        return self


class NodeSpec(Strict):
    name: Name = Field(description="the node's name in every table, log and decision")
    role: Literal["head", "worker"] = Field(description="exactly one head: Ray's head, rank 0, the API and the run "
                                            "lock")
    transport: Literal["ssh", "local"] = Field("ssh", description="local: this controller itself, reached without "
                                               "SSH (a single box)")
    host: str = Field(description="SSH address (name or IP)")
    fabric_ip: ipaddress.IPv4Address = Field(description="the node's address on the fabric, the direct link NCCL, "
                                             "Gloo and Ray use (not the management address host)")
    fabric_netdev: NetDev = Field(description="the fabric's network interface on the node")
    roce_hcas: list[NetDev] = Field([], description="RoCE HCAs driving fabric_netdev (ibdev2netdev's names): 02 "
                                    "checks them, 04 gives the containers /dev/infiniband and unlimited memlock, and "
                                    "sockets in NCCL's log stop 04")
    gpus: list[Annotated[int, Field(ge=0, le=63)]] = Field([], description="GPU indices the node serves with; a node "
                                                           "with GPUs gets them in 03's probes and 04's containers")
    ssh_user: Name | None = Field(None, description="this node's SSH user (default: ssh.user)")
    ssh_port: int | None = Field(None, ge=1, le=65535, description="this node's SSH port (default: ssh.port)")
    unified_memory: bool | None = Field(None, description="the GPU allocates from the OS's memory (GB10): 05 drops the "
                                        "page cache first (null: where nvidia-smi reports no GPU memory)")
    state_dir: OwnDir | None = Field(None, description="the runbook's own directory on the node (PID files, the "
                                        "Python runtime's places and logs, the run lock): made mode 0700 by the SSH "
                                        "user and refused where anyone else owns or can change it or a parent "
                                        "(default: ~/.sparkbook/NAME in the SSH user's home)")

    @field_validator("host")
    @classmethod
    def _host(cls, value: str) -> str:
        try:
            ipaddress.ip_address(value)
        except ValueError:
            if re.fullmatch(r"[0-9.]+", value):  # shaped like an IPv4 address, but not one (999.1.1.1)
                raise ValueError(f"{value!r} is not a valid IPv4 address (each of the four parts is 0-255)") from None
            if not re.fullmatch(r"[A-Za-z0-9]([A-Za-z0-9.-]{0,251}[A-Za-z0-9])?", value):
                raise ValueError(f"{value!r} is neither an IP address nor a host name") from None
        return value


class DockerRuntime(Strict):
    kind: Literal["docker"] = Field(description="Docker on every node, driven over SSH")
    images: list[Image] = Field(min_length=1, description="the candidate images 03 probes and chooses from (pin a "
                                "moving tag as name@sha256:...)")
    installed_image: Image | None = Field(None, description="the image the old deployment runs (null: 02 probes "
                                          "the images 01 found the old containers running)")
    shm_size: Size = Field("16G", description="/dev/shm of each node container")
    ipc_host: bool = Field(True, description="node containers share the host's IPC namespace (--ipc host)")
    privileged: bool = Field(False, description="privileged node containers (otherwise IPC_LOCK where the node lists "
                             "roce_hcas)")
    nofile: int | None = Field(1048576, ge=1024, description="open-files ulimit in containers (null: the daemon's)")
    memory_limit: Size | None = Field(None, description="memory cap of each node's container (docker --memory, swap "
                                      "included; null: none): a runaway start is killed inside it, not sshd "
                                      "(docs/serving.md)")
    env: Env = Field({}, description="environment of every node container (and so of every process in it)")
    cache_dir: RemotePath | None = Field(None, description="compile caches (vLLM, Triton, TorchInductor, FlashInfer) "
                                         "on each node, mounted in its container at the same path so a new container "
                                         "compiles nothing the last one did (default: sparkbook-cache/CLUSTER "
                                         "beside model.cache_dir)")
    pull: bool = Field(False, description="docker pull every candidate on the head before 03 probes them (where it "
                       "reaches a registry; a failed pull is reported and the local copy probed)")
    image_policy: Literal["keep_installed", "newest"] = Field(
        "keep_installed", description="keep_installed: keep installed_image where it loads the model natively, has "
        "no blocking finding and is on every node with one ID; newest: the newest usable candidate")


class PythonRuntime(Strict):
    kind: Literal["python"] = Field(description="vLLM and Ray from a Python environment on every node, no Docker")
    python: RemotePath = Field(description="interpreter on every node whose environment has vLLM")
    env: Env = Field({}, description="environment of every process the runtime starts")
    cache_dir: RemotePath | None = Field(None, description="compile caches (vLLM, Triton, TorchInductor, FlashInfer) "
                                         "on each node (default: sparkbook-cache/CLUSTER beside model.cache_dir)")


class ModelTransfer(Strict):
    """How 03 puts the model on a node that lacks it: pushed node to node over the fabric by rsync."""

    streams: int = Field(4, ge=1, le=32, description="parallel rsync streams per target node")
    verify: Literal["sha256_blobs", "sha256_all"] = Field(
        "sha256_blobs", description="after the copy: sizes everywhere, plus the sha256 of every HF blob named by "
        "its sha256 (sha256_blobs) or of every copied file against the source's (sha256_all)")
    reserve: Size = Field("1G", description="free space a node's disk must keep after the copy: refused before "
                                            "copying when it would not")
    bwlimit_mbs: float | None = Field(None, gt=0, description="cap per stream in MB/s (null: none)")
    timeout_s: float = Field(7200, gt=0, le=86400, description="one stream's limit; a killed copy resumes")


class ModelSpec(Strict):
    path: RemotePath | None = Field(None, description="model directory on every node")
    hf_id: Annotated[str, _matches(_HF_ID, "Hugging Face model id")] | None = Field(
        None, description="the model by its Hugging Face id, read from the hub cache under cache_dir (give path or "
        "hf_id)")
    served_name: Name = Field(description="the model's name in the API (vLLM's --served-model-name)")
    cache_dir: RemotePath = Field(description="where nodes keep models (mounted into containers at the same path); "
                                              "for hf_id: the Hugging Face cache (HF_HOME or its hub/ dir)")
    offline: bool = Field(True, description="hf_id: serve with HF_HUB_OFFLINE=1, from what the nodes' cache holds")
    transfer: ModelTransfer = Field(ModelTransfer(), description="how 03 copies the model to a node lacking it")

    @model_validator(mode="after")
    def _one_source(self) -> ModelSpec:
        if (self.path is None) == (self.hf_id is None):
            raise ValueError("path: give exactly one of model.path or model.hf_id")
        return self


class CleanupTargets(Strict):
    containers: list[Pattern] = Field([], description="containers 01 may stop, by name (globs)")
    systemd_units: list[UnitPattern] = Field([], description="systemd units 01 may stop and disable, with the "
                                             "processes of their cgroup and the containers they keep running (a name "
                                             "never starts with '-': systemctl would read it as an option)")
    processes: list[Pattern] = Field([], description="processes 01 may stop, by command name, with their descendants "
                                     "and the containers they keep running")
    order: list[Pattern] = Field([], description="stop targets matching these first, in this order")
    max_targets: int = Field(8, ge=1, le=1000, description="the most targets one pattern may match on one node: one "
                             "that matches more (a typo such as `*`) is refused in 01's plan, naming what it matched")
    unit_stop_timeout_s: float = Field(90, gt=0, le=3600, description="how long a systemd unit or managed process "
                                       "may take to stop, the containers it owns with it (a unit's own "
                                       "TimeoutStopUSec is waited for when longer)")


class RaySettings(Strict):
    port: int = Field(6379, ge=1, le=65535, description="the Ray head's GCS port (two clusters on the same nodes "
                      "need their own)")
    num_cpus: int | None = Field(None, ge=1, description="CPUs each node gives Ray (null: Ray's count)")
    object_store_gib: float = Field(1.0, ge=0.1, le=1024, description="Ray's object store per node (its default "
                                    "is 30 % of memory, which a unified-memory GB10 needs for the model; vLLM moves "
                                    "tensors over NCCL, not the object store)")
    env: Env = Field({}, description="environment of the node containers for Ray (changing it re-creates them in 04)")
    join_timeout_s: float = Field(120, gt=0, description="how long 04's gate waits for every node to join")


def api_key(api_key_env: str | None) -> str | None:
    """The API key in this controller's environment variable `api_key_env` (None when no variable is named).
    A name set but absent from the environment is an error naming the variable."""
    if api_key_env is None:
        return None
    value = os.environ.get(api_key_env)
    if not value:
        raise SparkbookError(f"serve.api_key_env: {api_key_env} is not set in this controller's environment",
                             remediation=f"export {api_key_env}=<the API key> before the run")
    return value


def bearer(api_key_env: str | None) -> dict[str, str]:
    """The Authorization header for an API whose key is in `api_key_env` (none when it is None)."""
    key = api_key(api_key_env)
    return {"Authorization": f"Bearer {key}"} if key else {}


class SmokeCheck(Strict):
    """What 05's smoke test asks and expects: a question a real instruct model answers, and, where a tool-call
    parser runs, one tool call that must come back parsed (broken FP8 output, a wrong chat template and a parser
    that does not match the model all pass a test that accepts any text)."""

    prompt: Prose = Field("What is the capital of France? Answer with the name of the city only.", min_length=1,
                        max_length=2000, description="the chat request's question")
    expect: Prose | None = Field("Paris", min_length=1, max_length=200, description="text the chat answer must "
                               "contain, case-insensitive (null: any text, for a model that cannot answer, as the "
                               "lab's tiny model)")
    tool_call: bool = Field(True, description="with serve.tool_call_parser set, one request the model must answer "
                            "with a call of the test's tool, parsed into tool_calls")


class QualityCheck(Strict):
    """05's answers checked at depth, after its smoke test: known answers (a fact in generated filler, asked back
    at each depth) and greedy agreement with the first ok run's tokens for this model and plan
    (core.analysis.quality)."""

    enabled: bool = Field(True, description="run the checks (false: 05 records that they did not run)")
    known_answers: bool = Field(True, description="ask the fact back at each depth (skipped anyway for dummy "
                                "weights and where serve.smoke.expect is null: a model that cannot answer)")
    depths: list[Annotated[float, Field(gt=0, le=1)]] = Field(
        [0.1, 0.5, 1.0], min_length=1, max_length=8, description="known-answer prompt lengths as shares of the "
        "served window (serve.max_model_len, else the server's), less the answer's tokens: 1.0 is the whole window")
    fact_position: float = Field(0.5, ge=0, le=1, description="where the fact sits in the filler (0: first, 1: last)")
    agreement_tokens: int = Field(32, ge=4, le=512, description="greedy tokens per prompt of the agreement check")
    min_agreement: float = Field(0.9, gt=0, le=1, description="share of identical top-1 tokens (each position under "
                                 "the reference's tokens before it) below which 05 fails, naming the prompt")
    timeout_s: float = Field(600, gt=0, le=7200, description="one request's limit (a prefill at the whole window)")

    @field_validator("depths")
    @classmethod
    def _distinct(cls, value: list[float]) -> list[float]:
        if len(set(value)) != len(value):
            raise ValueError(f"{value} names a depth twice")
        return sorted(value)


DRAFTED = ("eagle", "eagle3", "draft_model")  # speculative methods that load a draft model or head of their own


class Speculative(Strict):
    """vLLM's --speculative-config, as its vllm/config/speculative.py names the fields: the method, how many tokens
    each step drafts, and the method's own fields (ngram's lookup window, a draft's directory)."""

    method: Literal["mtp", "ngram", "eagle", "eagle3", "draft_model"] = Field(
        description="mtp: the served model's own multi-token-prediction layers; ngram: drafts from the prompt; eagle, "
        "eagle3, draft_model: a separate draft (speculative.model)")
    num_speculative_tokens: int = Field(ge=1, le=16, description="tokens drafted per step")
    model: RemotePath | None = Field(None, description="eagle, eagle3, draft_model: the draft's directory on every "
                                     "node (for the docker runtime under model.cache_dir, which is mounted)")
    prompt_lookup_min: int | None = Field(None, ge=1, description="ngram: shortest n-gram matched (vLLM's default 5)")
    prompt_lookup_max: int | None = Field(None, ge=1, description="ngram: longest n-gram matched (vLLM's default 5)")

    @model_validator(mode="after")
    def _method_fields(self) -> Speculative:
        """Each method's own fields and no other's: vLLM ignores what its method does not read (a draft named for
        mtp, a lookup window for eagle), so a typo would pass silently."""
        problems = []
        if self.method in DRAFTED and self.model is None:
            problems.append(f"model: method {self.method} needs the draft's directory")
        if self.method not in DRAFTED and self.model is not None:
            problems.append(f"model: method {self.method} loads no draft (" + (
                "its layers are the served model's own)" if self.method == "mtp" else "it drafts from the prompt)"))
        for name in ("prompt_lookup_min", "prompt_lookup_max"):
            if self.method != "ngram" and getattr(self, name) is not None:
                problems.append(f"{name}: only method ngram reads it, not {self.method}")
        low, high = self.prompt_lookup_min, self.prompt_lookup_max
        if low is not None and high is not None and low > high:
            problems.append(f"prompt_lookup_min: {low} is above prompt_lookup_max {high}")
        if problems:
            raise ValueError("\n".join(problems))
        return self

    def config_json(self) -> str:
        """The value of `--speculative-config`: the fields set, as the JSON vLLM parses."""
        return json.dumps(self.model_dump(exclude_none=True), separators=(",", ":"))


class ServeSettings(Strict):
    port: int = Field(8000, ge=1, le=65535, description="the API's port on the head (the router's, with layout "
                      "replicas)")
    executor: Literal["ray", "mp"] | None = Field(None, description="vLLM's distributed executor (null: 05 chooses by "
                                                  "the ranks and the image's platform: Ray where the image has it)")
    layout: Literal["tp", "replicas"] = Field("tp", description="tp: one server, the model split over the nodes "
                                              "(tensor_parallel_size x pipeline_parallel_size); replicas: a whole "
                                              "copy on each node behind one endpoint, where 02 finds that one fits")
    replica_port: int = Field(8001, ge=1, le=65535, description="layout replicas: the port of each node's own "
                              "server; the router answers clients on port")
    front: Literal["auto", "none", "router"] = Field(
        "auto", description="router: clients reach port through vllm-router on the head, a front door that outlives "
        "the servers behind it (they listen on replica_port), so a replacement or restart holds requests instead of "
        "refusing them; with api_key_env it refuses every request without the key, its admin routes included; "
        "none: vLLM answers on port itself; auto: router")
    switch: Literal["auto", "drain"] = Field("auto", description="front router, a replacement: auto stands the new "
                                             "server up beside the old where 05 measures that both fit (blue-green: "
                                             "the front moves to it after its checks, then the old drains), else "
                                             "a drained stop; drain: always the drained stop")
    hold_s: float = Field(120, gt=0, le=3600, description="front router: how long the front holds a request while no "
                          "server behind it answers (a replacement's or a restart's gap), retrying with backoff")
    drain_timeout_s: int = Field(30, ge=0, le=3600, description="front router: how long a stopped server may finish "
                                 "the requests it runs (vLLM's --shutdown-timeout where the image has it) before "
                                 "it is killed")
    router_policy: Literal["power_of_two", "round_robin", "cache_aware"] = Field(
        "power_of_two", description="layout replicas: how vllm-router picks a replica (power_of_two: the less "
        "loaded; cache_aware: the one holding the prompt's prefix)")
    tensor_parallel_size: int = Field(1, ge=1, le=64, description="vLLM's --tensor-parallel-size")
    pipeline_parallel_size: int = Field(1, ge=1, le=64, description="vLLM's --pipeline-parallel-size")
    master_port: int = Field(29501, ge=1, le=65535, description="rank 0's port for vLLM's own multi-node launch "
                             "(executor mp, --master-port)")
    gpu_memory_utilization: float | None = Field(None, gt=0, le=1, description="vLLM's --gpu-memory-utilization "
                                                 "(null: vLLM's default; the out-of-memory ladder lowers it)")
    max_model_len: int | None = Field(None, ge=16, description="vLLM's --max-model-len, the served window")
    max_num_seqs: int | None = Field(None, ge=1, description="vLLM's --max-num-seqs; 02's memory fit holds this many "
                                     "sequences of max_model_len")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field("auto", description="vLLM's --dtype")
    enforce_eager: bool = Field(False, description="vLLM's --enforce-eager (the last step of the out-of-memory "
                                "ladder sets it)")
    kv_cache_memory_bytes: Size | None = Field(None, description="vLLM's --kv-cache-memory-bytes")
    host: ipaddress.IPv4Address = Field(ipaddress.IPv4Address("0.0.0.0"), description="address the API binds on the "
                                        "head (0.0.0.0: every interface); clients reach it at the head's fabric_ip")
    reasoning_parser: Parser | None = Field(None, description="vLLM --reasoning-parser (qwen3 for Qwen3.5): the "
                                            "model's thinking goes to reasoning_content, its answer to content")
    tool_call_parser: Parser | None = Field(None, description="vLLM --tool-call-parser (qwen3_coder for Qwen3.5), "
                                            "with --enable-auto-tool-choice")
    chat_template: RemotePath | None = Field(None, description="chat template file as the serving container sees "
                                             "it (under model.cache_dir, which is mounted); 05 checks it exists")
    smoke_max_tokens: int | None = Field(None, ge=1, le=32768, description="tokens per smoke-test request (default: "
                                         "1024 with a reasoning parser, where the model thinks first; 32 without)")
    smoke: SmokeCheck = Field(SmokeCheck(), description="05's smoke test")
    quality: QualityCheck = Field(QualityCheck(), description="05's answers checked at depth")
    speculative: Speculative | None = Field(None, description="speculative decoding, passed as --speculative-config "
                                            "(null: none)")
    extra_args: list[Arg] = Field([], description="further vllm serve arguments (not a flag that has a field of "
                                  "its own)")
    env: Env = Field({}, description="environment of every serving process (carried by 04's node containers)")
    node_env: dict[Name, Env] = Field({}, description="environment of one node's serving processes, by node name")
    ready_timeout_s: float = Field(900, gt=0, description="how long 05 waits for the model to be listed")
    retry_with_remediation: bool = Field(True, description="relaunch with a remediation after a classified failure")
    max_remedies: int = Field(3, ge=0, le=8, description="relaunches with a remediation after a classified failure")
    settle_gib: float = Field(2, gt=0, le=64, description="after a failed attempt every serving node's MemAvailable "
                              "must come back within this of its value before the first launch")
    settle_timeout_s: float = Field(120, gt=0, le=1800, description="how long the settle check waits for it")
    utilization_step: float = Field(0.05, gt=0, le=0.5, description="the out-of-memory ladder lowers "
                                    "gpu_memory_utilization by this much per attempt while 02's memory fit holds")
    rollback_on_failure: bool = Field(True, description="when a replacement fails to start, relaunch the plan that "
                                      "served before it (kept by the run that started it)")
    api_key_env: EnvName | None = Field(None, description="environment variable (also listed in `secrets`) whose value "
                                        "vLLM requires as its API key: every request of 05 and 06 sends it")

    @model_validator(mode="before")
    @classmethod
    def _front_resolved(cls, data: object) -> object:
        """serve.front: auto becomes what it means here, once, so every reader sees router or none."""
        if isinstance(data, dict) and data.get("front", "auto") == "auto":
            return {**data, "front": "router"}
        return data

    def smoke_tokens(self) -> int:
        """max_tokens per smoke or known-answer request: smoke_max_tokens, else room to think where a reasoning
        parser runs (05's smoke test and both answer checks, 05's and the one after 06's soak, ask the same)."""
        return self.smoke_max_tokens or (REASONING_TOKENS if self.reasoning_parser else PLAIN_TOKENS)

    def headers(self) -> dict[str, str]:
        """What every request to the API carries: the bearer token of api_key_env, when set."""
        return bearer(self.api_key_env)

    @field_validator("extra_args")
    @classmethod
    def _no_secret_flags(cls, value: list[str]) -> list[str]:
        """A secret flag's value in the next element (`--api-key`, `V`), which no element alone shows."""
        found = secret_args(value)
        if found:
            raise ValueError(f"{', '.join(f'extra_args[{i}]' for i in found)}: a secret's value typed in (not "
                             f"shown); {USE_A_REFERENCE}")
        return value

    @field_validator("extra_args")
    @classmethod
    def _no_field_flags(cls, value: list[str]) -> list[str]:
        """A flag with a field of its own in extra_args would be given twice, one value silently winning."""
        own = {"--host": "host", "--reasoning-parser": "reasoning_parser", "--tool-call-parser": "tool_call_parser",
               "--enable-auto-tool-choice": "tool_call_parser", "--chat-template": "chat_template",
               "--speculative-config": "speculative", "-sc": "speculative"}
        flags = [(a, a.split("=", 1)[0].split(".", 1)[0]) for a in value]  # --speculative-config.method: one field
        taken = [f"{a} (use serve.{own[flag]})" for a, flag in flags if flag in own]
        if taken:
            raise ValueError(f"set by their own fields, not in extra_args: {', '.join(taken)}")
        return value


SOAK_DRAIN_S = 300.0  # the soak's requests in flight at soak_s end within the client's request timeout


class SoakSettings(Strict):
    """06's soak after the sweep (benchmark.soak_*): sustained load at long context while every node is sampled, for
    what only minutes of load find (an engine that dies after 10-30 min, a GB10 frozen under unified-memory pressure,
    speculative decoding crashing at long context)."""

    soak_s: float = Field(0, ge=0, le=86400, description="seconds of sustained load after the sweep (0: no soak)")
    soak_concurrency: int = Field(4, ge=1, le=4096, description="requests in flight throughout the soak")
    soak_context: int = Field(1024, ge=1, description="prompt tokens of every soak request (fresh random ids each, "
                              "so no prefix is cached); with soak_output_len within serve.max_model_len")
    soak_output_len: int = Field(128, ge=2, description="output tokens of every soak request (ignore_eos)")
    soak_max_error_rate: float = Field(0.01, ge=0, le=1, description="the soak fails when more than this share of "
                                       "its ended requests failed")
    soak_sample_s: float = Field(5, ge=1, le=60, description="how often each node and the server are sampled")

    @property
    def soak_wait_s(self) -> float:
        """The longest the soak may take: soak_s, then its requests in flight end (at most one request's timeout)."""
        return self.soak_s + SOAK_DRAIN_S if self.soak_s else 0.0


class BenchmarkSettings(SoakSettings):
    input_len: int = Field(64, ge=1, description="prompt tokens of every sweep request")
    output_len: int = Field(128, ge=2, description="output tokens of every sweep request")
    num_prompts: int = Field(32, ge=1, description="requests per sweep point and repeat")
    concurrency: list[Annotated[int, Field(ge=1, le=4096)]] = Field([1, 2, 4, 8, 16], description="the sweep's "
                                                                    "points: requests in flight")
    warmup_requests: int = Field(2, ge=0, description="warm-up per point (0: none): max(this, 2 x concurrency) "
                                 "distinct prompts, `concurrency` in flight, staggered output lengths, not counted")
    repeats: int = Field(1, ge=1, le=20, description="measurements per point after its warm-up, fresh prompts each; "
                         "the point reports their median and spread (default 3 where the nodes list GPUs, else 1)")
    clients: int = Field(1, ge=1, le=64, description="client processes sending the load")
    memory_bandwidth_gbs: float | None = Field(None, gt=0, description="per node, overriding the datasheet figure of "
                                               "the card the head reports (more than 10 % apart: a finding); null: "
                                               "that figure, and no roofline for a card the table lacks")
    clock_drop: float = Field(0.10, gt=0, lt=1, description="06 flags a point whose GPU SM clock fell more than "
                              "this fraction below its start (sampled with nvidia-smi where nodes list GPUs)")
    ab: AbKind | None = Field(None, description="speculative: 05 and 06 run twice, the plan without "
                              "serve.speculative first, then with it; layout: the plan with serve.layout tp (one model "
                              "split across the nodes) first, then its own serve.layout replicas (a copy per node "
                              "behind the router); image: the same plan in the image that serves now (on a first "
                              "run runtime.installed_image) first, then in 03's choice, 04 to 06 in each arm; both "
                              "arms get the same prompts, seeds and concurrency points, and 06 records the ratio at "
                              "each concurrency and which configuration stays serving")
    ab_decide_at: int | None = Field(None, ge=1, description="the concurrency whose ratio decides the A/B (default: "
                                     "for speculative the lowest measured, the single stream speculation is for; for "
                                     "layout the highest, the load replicas are for)")
    depths: list[Annotated[int, Field(ge=0)]] = Field([0, DEPTH_LADDER[0]], description="context depths (tokens before "
                                                       "the prompt, llama-benchy's --depth) measured single stream "
                                                       "after the sweep: TTFT and decode tok/s at each; the deepest "
                                                       "above 0 is also sent twice to measure prefix caching ([]: "
                                                       "neither)")
    depth_input_len: int = Field(DEPTH_INPUT_LEN, ge=1, description="prompt tokens after the context at each depth "
                                 "(llama-benchy's --pp)")
    depth_output_len: int = Field(DEPTH_OUTPUT_LEN, ge=2, description="tokens generated at each depth "
                                  "(llama-benchy's --tg)")


class Fabric(Strict):
    mtu: int = Field(1500, ge=576, le=9216, description="the MTU 02 expects on every fabric netdev")
    expect_gbps: float | None = Field(None, gt=0, description="bus bandwidth (Gb/s) 04's large all_reduce must reach "
                                      "(default: link_fraction x the link rate, else per link kind: docs/fabric.md)")
    link_fraction: float = Field(0.6, gt=0, le=1, description="share of the fabric netdev's link rate the busbw must "
                                 "reach where expect_gbps is not set")
    max_allreduce_us: float | None = Field(None, gt=0, description="limit on 04's small all_reduce time in us "
                                           "(default per link kind: docs/fabric.md)")
    allreduce_small_bytes: int = Field(32768, ge=4, le=1 << 20, description="04's latency size (decode-sized)")
    allreduce_large_bytes: int | None = Field(None, ge=1 << 20, le=4 << 30, description="04's bandwidth size "
                                              "(default per link kind: docs/fabric.md)")
    allreduce_iters: int = Field(20, ge=2, le=1000, description="timed all_reduces per size, at most")
    allreduce_budget_s: float = Field(0.5, gt=0, le=60, description="time per size: fewer iterations where "
                                      "allreduce_iters would take longer")
    allreduce_timeout_s: float = Field(90, gt=0, le=900, description="04's all_reduce test ends by then, on every node")


class WatchSettings(Strict):
    """`sparkbook watch`: how often it asks the deployment, when a failure is one, and how hard it tries to bring it
    back before it gives up (a restart of a large model costs its whole load time, so one lost request is no failure
    and a deployment that keeps dying is a person's problem, not a loop's)."""

    interval_s: float = Field(30, gt=0, le=3600, description="seconds between two checks (/health and a one-token "
                              "completion)")
    check_timeout_s: float = Field(30, gt=0, le=600, description="how long one check's completion may take: a loaded "
                                   "server answers one token late, a dead engine never")
    failures_to_restart: int = Field(2, ge=1, le=20, description="consecutive failed checks that make a failure the "
                                     "watch acts on")
    max_restarts: int = Field(3, ge=0, le=100, description="restarts within restart_window_s; the next failure in "
                              "that window makes the watch give up (exit 5)")
    restart_window_s: float = Field(3600, gt=0, le=7 * 86400, description="the window max_restarts counts over")
    backoff_s: float = Field(30, ge=0, le=3600, description="wait before the second restart in the window, doubled for "
                             "each one after (the first follows the failure at once)")
    backoff_max_s: float = Field(600, ge=0, le=86400, description="the longest wait between two restarts")

    @model_validator(mode="after")
    def _backoff_order(self) -> WatchSettings:
        if self.backoff_max_s < self.backoff_s:
            raise ValueError(f"backoff_max_s: {self.backoff_max_s:g} is below backoff_s ({self.backoff_s:g}); the "
                             "longest wait cannot be shorter than the first")
        return self




class RunLockSettings(Strict):
    """How the run lock ages; it lives in the head's state dir (NodeSpec.state_dir), the runbook's own, so no path
    can name a directory other programs or users keep files in."""

    stale_after_s: float = Field(43200, gt=0, description="a lock older than this is reported as stale")


FRONT_NODE = "front"  # not a node's name: the front's own place is named as a node's would be (topology.front_place)


class Params(Strict):
    cluster: Name = Field(description="the cluster's name: its runs go to outputs/<cluster>/")
    ssh: SSHSettings = Field(SSHSettings(), description="how this controller reaches the nodes")
    nodes: list[NodeSpec] = Field(min_length=1, description="the machines, one head")
    fabric: Fabric = Field(Fabric(), description="02's link checks and 04's all_reduce test")
    runtime: Annotated[DockerRuntime | PythonRuntime, Field(discriminator="kind")] = Field(
        description="how nodes run places and processes: Docker, or a Python environment")
    model: ModelSpec = Field(description="the model to serve")
    cleanup: CleanupTargets = Field(CleanupTargets(), description="what 01 may stop (allow-lists)")
    ray: RaySettings = Field(RaySettings(), description="04's Ray cluster")
    serve: ServeSettings = Field(ServeSettings(), description="05's vllm serve plan")
    benchmark: BenchmarkSettings = Field(BenchmarkSettings(), description="06's sweep, depths, soak and A/B")
    secrets: list[Annotated[str, AfterValidator(_secret_name)]] = Field(
        [], description="environment variables holding secrets, by name (never the secret itself)")
    run_lock: RunLockSettings = Field(RunLockSettings(), description="one run per cluster at a time")
    watch: WatchSettings = Field(WatchSettings(), description="sparkbook watch")

    def secret_values(self) -> dict[str, str]:
        """The named secrets as this controller's environment holds them (those it lacks are left out)."""
        return {name: os.environ[name] for name in self.secrets if os.environ.get(name)}

    @model_validator(mode="before")
    @classmethod
    def _benchmark_defaults(cls, data: Any) -> Any:
        """benchmark.repeats unset: 3 where the nodes list GPUs (their batched points move between identical runs),
        else 1 (the lab's CPU vLLM). benchmark.depths unset: 0 and the deepest of DEPTH_LADDER, as far as they fit
        serve.max_model_len with their prompt and output (a plan with a short window is no params error for a setting
        its author never wrote; one that names depths is held to them)."""
        if not isinstance(data, dict) or not isinstance(data.get("benchmark") or {}, dict):
            return data
        bench = dict(data.get("benchmark") or {})
        if "repeats" not in bench:
            nodes = data.get("nodes")
            if not isinstance(nodes, list):
                nodes = []
            bench["repeats"] = 3 if any(isinstance(n, dict) and n.get("gpus") for n in nodes) else 1
        serve = data.get("serve")
        window = serve.get("max_model_len") if isinstance(serve, dict) else None
        extra = (bench.get("depth_input_len", DEPTH_INPUT_LEN), bench.get("depth_output_len", DEPTH_OUTPUT_LEN))
        if "depths" not in bench and isinstance(window, int) and all(isinstance(x, int) for x in extra):
            bench["depths"] = [d for d in (0, *DEPTH_LADDER) if d + sum(extra) <= window][:2]
        return {**data, "benchmark": bench}

    @model_validator(mode="after")
    def _cluster_consistent(self) -> Params:
        """Cross-field checks; every problem found is reported, one `field: message` per line."""
        problems = []
        heads = [n.name for n in self.nodes if n.role == "head"]
        if len(heads) != 1:
            problems.append(f"nodes: exactly one node must have role head, found {len(heads)}: {heads}")
        problems += [f"nodes[{i}].name: {FRONT_NODE!r} names the front's own container (sparkbook-CLUSTER-front); "
                     "give the node another name" for i, n in enumerate(self.nodes) if n.name == FRONT_NODE]
        for field in ("name", "fabric_ip"):
            seen: dict[str, int] = {}
            for i, node in enumerate(self.nodes):
                value = str(getattr(node, field))
                if value in seen:
                    problems.append(f"nodes[{i}].{field}: {value} is already used by nodes[{seen[value]}]")
                seen.setdefault(value, i)
        world = self.ranks
        slots = self.total_gpus or len(self.nodes)
        unit = "GPUs listed" if self.total_gpus else "nodes (no GPUs listed: one rank per node)"
        if world > slots:
            problems.append(f"serve.tensor_parallel_size: tensor_parallel_size x pipeline_parallel_size = {world} "
                            f"is larger than the {slots} {unit}")
        if self.serve.layout == "replicas" and len(self.nodes) < 2:
            problems.append("serve.layout: replicas runs a copy of the model on each node behind one endpoint; this "
                            "cluster has one node (set serve.layout: tp)")
        if self.serve.layout == "replicas" and self.serve.executor == "ray":
            problems.append("serve.executor: ray joins ranks over the nodes, and a replica serves on one node (leave "
                            "serve.executor out with serve.layout: replicas)")
        if self.serve.layout == "replicas" and self.serve.api_key_env and self.serve.host.is_unspecified:
            problems.append("serve.host: with serve.api_key_env, 0.0.0.0 would open every replica's port on every "
                            "address of its node, where vLLM asks the key only under /v1 (its /invocations, "
                            "/tokenize and /metrics answer anyone); set serve.host to the head's fabric address, and "
                            "each replica binds its own node's (the router, which asks the key on every route, "
                            "answers clients there)")
        if (self.serve.layout == "replicas" or self.serve.front == "router") and \
                self.serve.replica_port == self.serve.port:
            problems.append(f"serve.replica_port: {self.serve.replica_port} is serve.port, where the router answers "
                            "on the head; the servers behind it need a port of their own")
        if self.serve.api_key_env and self.serve.api_key_env not in self.secrets:
            problems.append(f"serve.api_key_env: {self.serve.api_key_env} must also be listed under `secrets` (so its "
                            "value is redacted from every output and reaches the node containers)")
        draft = self.serve.speculative.model if self.serve.speculative else None
        cache = self.model.cache_dir.rstrip("/") + "/"
        if draft and isinstance(self.runtime, DockerRuntime) and not draft.startswith(cache):
            problems.append(f"serve.speculative.model: {draft} is not under model.cache_dir ({self.model.cache_dir}), "
                            "the only host directory the node containers mount")
        problems += self._ab_problems() + self._depth_problems()
        unknown = sorted(set(self.serve.node_env) - {n.name for n in self.nodes})
        if unknown:
            problems.append(f"serve.node_env: names nodes that are not in nodes: {unknown}")
        problems += self._soak_problems() + self._typed_secrets()
        if problems:
            raise ValueError("\n".join(problems))
        return self

    def _typed_secrets(self) -> list[str]:
        """A secret typed into an env or argv setting, which is recorded, shown and put where a secret must not be:
        a named secret's value (as this controller holds it), or a value given to a variable whose name says it holds
        a secret (HF_TOKEN, *_API_KEY, *_PASSWORD; 3 characters or less pass: `HF_HUB_DISABLE_IMPLICIT_TOKEN: "1"`).
        Each named by field and variable, never by value."""
        envs = {"runtime.env": self.runtime.env, "ray.env": self.ray.env, "serve.env": self.serve.env}
        envs |= {f"serve.node_env.{node}": env for node, env in self.serve.node_env.items()}
        places = {where: list(env.values()) for where, env in envs.items()}
        places["serve.extra_args"] = self.serve.extra_args
        known = {name: value for name, value in self.secret_values().items() if len(value) > 3}
        typed = [f"{where}.{name}: a secret's variable with a value typed in (not shown); {USE_A_REFERENCE}"
                 for where, env in envs.items() for name, value in env.items()
                 if SECRET_NAME.fullmatch(name) and len(value) > 3]
        return typed + [f"{where}: holds the value of {name} (not shown); it is a secret: {USE_A_REFERENCE}"
                        for where, texts in places.items() for name, value in known.items()
                        if any(value in t for t in texts)]

    def _ab_problems(self) -> list[str]:
        """An A/B needs its two arms to differ, and decides at a concurrency the sweep measures."""
        bench, problems = self.benchmark, []
        if bench.ab == "speculative" and self.serve.speculative is None:
            problems.append("benchmark.ab: speculative compares the plan with and without serve.speculative; set "
                            "serve.speculative (e.g. method: ngram, num_speculative_tokens: 3) or drop benchmark.ab")
        if bench.ab == "layout" and self.serve.layout != "replicas":
            problems.append("benchmark.ab: layout compares serve.layout tp (the baseline) with the params' own "
                            "serve.layout replicas; set serve.layout: replicas (a copy per node, 2 or more nodes) or "
                            "drop benchmark.ab")
        elif bench.ab == "layout" and self._one_node_ranks():
            problems.append(f"benchmark.ab: layout's baseline serves serve.layout tp on tensor_parallel_size x "
                            f"pipeline_parallel_size = {self.ranks} ranks, which one node holds: that is one replica, "
                            "not the model split across the nodes; set them to span the nodes")
        problems += self._image_ab_problems()
        if bench.ab_decide_at is not None and bench.ab_decide_at not in bench.concurrency:
            problems.append(f"benchmark.ab_decide_at: {bench.ab_decide_at} is not one of benchmark.concurrency "
                            f"{bench.concurrency}")
        if bench.ab_decide_at is not None and bench.ab is None:
            problems.append("benchmark.ab_decide_at: set without benchmark.ab (no A/B to decide)")
        return problems

    def _image_ab_problems(self) -> list[str]:
        """The image A/B judges answers and speed: it needs images to compare, the answer check, and repeats for a
        noise band (one repeat shows no band, so it could never say the new image is not slower)."""
        if self.benchmark.ab != "image":
            return []
        problems = []
        if self.runtime.kind != "docker":
            problems.append("benchmark.ab: image compares two Docker images; runtime.kind python has none (drop "
                            "benchmark.ab)")
        if not self.serve.quality.enabled:
            problems.append("benchmark.ab: image keeps a new image only where its answers agree with the reference "
                            "as well as the baseline's; set serve.quality.enabled: true")
        if self.benchmark.repeats < 2:
            problems.append("benchmark.ab: image keeps a new image only where it is not slower beyond the noise band "
                            "of the repeats; set benchmark.repeats: 2 or more")
        return problems

    def _depth_problems(self) -> list[str]:
        """Every depth with its prompt and output must fit serve.max_model_len, or vLLM refuses the request."""
        bench, limit = self.benchmark, self.serve.max_model_len
        extra = bench.depth_input_len + bench.depth_output_len
        too_deep = [d for d in bench.depths if limit is not None and d + extra > limit]
        if limit is None or not too_deep:
            return []
        return [f"benchmark.depths: {too_deep} + depth_input_len {bench.depth_input_len} + depth_output_len "
                f"{bench.depth_output_len} is longer than serve.max_model_len {limit}; the deepest that fits is "
                f"{limit - extra if limit > extra else 'none'} (lower benchmark.depths, or raise serve.max_model_len)"]

    @property
    def ranks(self) -> int:
        """The tp layout's ranks: tensor_parallel_size x pipeline_parallel_size."""
        return self.serve.tensor_parallel_size * self.serve.pipeline_parallel_size

    def _one_node_ranks(self) -> bool:
        """Whether the tp layout's ranks fit on one node (its GPUs, or one rank where none are listed)."""
        return self.ranks <= max(max((len(n.gpus) for n in self.nodes), default=0), 1)

    def ab_baseline(self) -> Params:
        """The A/B's baseline arm (and its kept arm): the same plan without serve.speculative (ab: speculative), or
        with serve.layout tp, one model split across the nodes (ab: layout), or unchanged (ab: image)."""
        if self.benchmark.ab is None:
            raise ValueError("benchmark.ab is not set: there is no baseline arm")
        if self.benchmark.ab == "image":  # the same plan: the baseline's image comes from 03 (AbBaseline)
            return self
        change: dict[str, object] = {"speculative": None} if self.benchmark.ab == "speculative" else {"layout": "tp"}
        return self.model_copy(update={"serve": self.serve.model_copy(update=change)})

    def _soak_problems(self) -> list[str]:
        """A soak request must fit the served context, or every one of them fails and the soak measures nothing."""
        bench, limit = self.benchmark, self.serve.max_model_len
        if bench.soak_s and limit and bench.soak_context + bench.soak_output_len > limit:
            return [f"benchmark.soak_context: {bench.soak_context} + soak_output_len {bench.soak_output_len} is more "
                    f"than serve.max_model_len {limit}; lower soak_context"]
        return []

    @property
    def head(self) -> NodeSpec:
        return next(n for n in self.nodes if n.role == "head")

    @property
    def workers(self) -> list[NodeSpec]:
        return [n for n in self.nodes if n.role == "worker"]

    @property
    def total_gpus(self) -> int:
        return sum(len(n.gpus) for n in self.nodes)

    def node(self, name: str) -> NodeSpec:
        return next(n for n in self.nodes if n.name == name)


@dataclass(frozen=True)
class Problem:
    file: str
    field: str
    line: int | None
    message: str

    def __str__(self) -> str:
        where = f"{self.file}:{self.line}" if self.line else self.file
        return f"{where}: {self.field or '(file)'}: {self.message}"


class ParamsError(SparkbookError):
    """Every problem found in a params file; raised before anything touches a node."""

    exit_kind = "invalid"
    label = "invalid params"

    def __init__(self, problems: list[Problem]):
        self.problems = problems
        super().__init__("\n".join(str(p) for p in problems))


def load_params(path: str | Path, overrides: dict[str, Any] | None = None) -> Params:
    """Read, merge `overrides` (dotted keys) and validate one cluster's params file."""
    path = Path(path)
    if not path.is_file():
        raise ParamsError([Problem(str(path), "", None, "file not found")])
    try:
        text = path.read_text()
    except UnicodeDecodeError:
        raise ParamsError([Problem(str(path), "", None, "not UTF-8 text (a binary file?): name the cluster's YAML "
                                                        "params file")]) from None
    except OSError as exc:
        raise ParamsError([Problem(str(path), "", None, f"cannot be read ({exc.strerror})")]) from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        raise ParamsError([Problem(str(path), "", mark.line + 1 if mark else None, f"not valid YAML: {exc}")]) from None
    if not isinstance(data, dict):
        raise ParamsError([Problem(str(path), "", 1, "expected a mapping of settings at the top level")])
    for dotted, value in (overrides or {}).items():
        _set_dotted(data, dotted, value)
    _resolve_local_paths(data, path.parent)
    try:
        return Params.model_validate(data)
    except ValidationError as exc:
        raise ParamsError(_problems(exc, path, text)) from None


def _set_dotted(data: dict[str, Any], dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    for key in parents:
        data = data.setdefault(key, {})
    data[leaf] = value


def _resolve_local_paths(data: dict[str, Any], base: Path) -> None:
    ssh = data.get("ssh")
    if isinstance(ssh, dict):
        for key in ("key_file", "known_hosts"):
            if isinstance(ssh.get(key), str):
                ssh[key] = str((base / Path(ssh[key]).expanduser()).resolve())


def _problems(exc: ValidationError, path: Path, text: str) -> list[Problem]:
    problems = []
    for err in exc.errors():
        tagged = err["loc"][:1] == ("runtime",) and err["loc"][1:2] in (("docker",), ("python",))
        loc = [err["loc"][0], *err["loc"][2:]] if tagged else list(err["loc"])  # drop the runtime's kind tag
        for message in err["msg"].removeprefix("Value error, ").splitlines():
            field = _dotted(loc)
            named = _FIELD_PREFIX.match(message)
            if named:
                field, message = ".".join(filter(None, (field, named.group(1)))), named.group(2)
            problems.append(Problem(str(path), field, _line_of(text, _loc_of(field)), message))
    return problems


_FIELD_PREFIX = re.compile(r"^([A-Za-z_]\w*(?:\[\d+\]|\.[A-Za-z_]\w*)*): (.+)$", re.S)


def _dotted(loc: list[Any]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _loc_of(field: str) -> list[str | int]:
    return [int(p) if p.isdigit() else p for p in re.findall(r"[^.\[\]]+", field)]


def _line_of(text: str, loc: list[str | int]) -> int | None:
    """The 1-based line of the YAML node at `loc`, or of its nearest existing parent."""
    try:
        node = yaml.compose(text)
    except yaml.YAMLError:
        return None
    line = None
    for part in loc:
        if isinstance(node, yaml.MappingNode):
            match = [v for k, v in node.value if k.value == part]
            key = [k for k, v in node.value if k.value == part]
            if not match:
                break
            line, node = key[0].start_mark.line + 1, match[0]
        elif isinstance(node, yaml.SequenceNode) and isinstance(part, int) and part < len(node.value):
            node = node.value[part]
            line = node.start_mark.line + 1
        else:
            break
    return line
