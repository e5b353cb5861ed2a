"""What `sparkbook plan` shows for 04 is what 04 starts (issue 39, item 3): a node container started from 04's
preview, read back with `docker inspect`, against the `docker run` line the plan printed for it: mounts, ulimits,
capabilities, the memory cap, env names and the command. The params set a memory cap and the compile-cache mount is
on, two of what the old `plan.py` line missed; the containers are the test's own (cluster `lab-spec`), beside
whatever the lab serves, and removed at the end. Before they start, the plan asks the image's platform in a throwaway
container of it, as 03's probes do; this image holds no vLLM, and the plan says 05 cannot tell its platform, where
it asked, not docker's 404.

RDMA's memlock=unlimited (a node with roce_hcas) cannot be shown here: this machine lacks CAP_SYS_RESOURCE, so runc's
setrlimit above the host's 8 MiB hard limit is refused ("error setting rlimit type 8: operation not permitted").
tests/unit/test_node_env.py checks that branch of the spec and its rendering."""
from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import yaml

from sparkbook import cli
from sparkbook.cli import exits
from sparkbook.core.cluster.context import Context
from sparkbook.core.cluster.docker_ssh import docker_client
from sparkbook.core.cluster.nodes import Cluster
from sparkbook.core.cluster.runtimes import runtime_for
from sparkbook.core.values.handoff import ImageChoice
from sparkbook.core.values.params import load_params
from sparkbook.stages import raycluster
from sparkbook.stages.raycluster import containers

IMAGE = "sparkbook-lab/base:bookworm"  # on every lab node; 04 only needs `sleep` in it


@pytest.fixture(scope="module")
def params_file(lab, tmp_path_factory) -> Path:  # type: ignore[no-untyped-def]
    import sparkbook.lab as sblab

    data = yaml.safe_load(sblab.params_file(2).read_text())
    data["cluster"] = "lab-spec"
    data["runtime"]["images"] = [IMAGE]
    data["runtime"]["memory_limit"] = "2G"
    path = tmp_path_factory.mktemp("spec") / "lab-spec.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def planned_docker_runs(text: str) -> dict[str, list[str]]:
    """container name -> the `docker run` argv the plan printed for it."""
    return {(argv := shlex.split(m))[argv.index("--name") + 1]: argv
            for m in re.findall(r"docker run -d --name .*? infinity", text)}


def flags(argv: list[str], flag: str) -> list[str]:
    return [argv[i + 1] for i, a in enumerate(argv) if a == flag]


def test_the_started_container_is_what_sparkbook_plan_showed(params_file: Path, tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["plan", str(params_file), "--outputs", str(tmp_path)]) == exits.EXIT_FAILED
    out = capsys.readouterr().out
    planned = planned_docker_runs(out)
    serve_part = out.split("== 05-serve")[1].split("== 06")[0]
    assert f"cannot tell the image's platform, asked in a throwaway container of {IMAGE}" in serve_part, serve_part
    params = load_params(params_file)
    cluster = Cluster(params)
    ctx = Context(params, cluster, runtime_for(params), tmp_path).with_handoffs(
        ImageChoice(ref=IMAGE, id=None, vllm_version=None, ray_version=None, nodes={}))
    try:
        preview = raycluster.preview(ctx)
        started = containers.start_containers(ctx.with_image(IMAGE), preview.specs)
        assert len(started) == len(params.nodes) == len(planned)
        for node in cluster:
            name = preview.specs[node.name].name
            argv, attrs = planned[name], docker_client(node).containers.get(name).attrs
            host = attrs["HostConfig"]
            assert sorted(m["Source"] for m in attrs["Mounts"]) == sorted(v.split(":")[0] for v in flags(argv, "-v"))
            assert sorted(f"{u['Name']}={u['Soft']}:{u['Hard']}" for u in host["Ulimits"] or []) == \
                sorted(flags(argv, "--ulimit")), node.name
            assert sorted(host["CapAdd"] or []) == sorted(flags(argv, "--cap-add")), node.name
            assert host["Memory"] == host["MemorySwap"] == 2 << 30 and flags(argv, "--memory") == ["2g"]
            assert sorted({e.split("=", 1)[0] for e in attrs["Config"]["Env"]} - {"PATH"}) == \
                sorted(flags(argv, "-e")), node.name
            assert [*attrs["Config"]["Entrypoint"], *(attrs["Config"]["Cmd"] or [])] == \
                [flags(argv, "--entrypoint")[0], argv[-1]] == ["sleep", "infinity"]
            assert attrs["Config"]["Image"] == argv[-2] == IMAGE
        assert all("/srv/sparkbook-cache" in flags(a, "-v")[1] for a in planned.values())  # the compile caches
    finally:
        containers.stop(ctx.with_image(IMAGE))
        cluster.close()
