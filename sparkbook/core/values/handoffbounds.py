"""What a deployment's hand-offs in state.json may say, bounded by the params the operator commands run with: a
state.json is read back from a run dir, and `status`, `logs`, `stop`, `up` and `watch` act on what it names (the
variable whose value goes out as a bearer token, the URL it goes to, the image started, the log a process group is
read from). Pure: each check returns the problems, the caller refuses."""
from __future__ import annotations

import posixpath
from collections.abc import Collection
from urllib.parse import urlsplit

from .handoff import Endpoint, ImageChoice
from .params import Params


def candidate_images(params: Params) -> set[str]:
    """What 03 may choose from: the params' candidate images and installed image, or the Python runtime's
    interpreter."""
    rt = params.runtime
    if rt.kind == "python":
        return {rt.python}
    return {*rt.images, *([rt.installed_image] if rt.installed_image else [])}


def image_problems(choice: ImageChoice, params: Params, found: Collection[str] = ()) -> list[str]:
    """Why `choice` is not an image these params let 03 choose (`found`: the old deployment's images 01 recorded,
    which 03 may keep); [] where it is."""
    allowed = candidate_images(params) | set(found)
    if choice.ref in allowed:
        return []
    return [f"image.ref {choice.ref!r} is none of the params' candidate images ({', '.join(sorted(allowed))})"]


def _url_problem(field: str, url: str, hosts: set[str]) -> str | None:
    try:
        parts = urlsplit(url)
        host = parts.hostname
    except ValueError:
        return f"{field}: {url!r} is not a URL"
    if parts.scheme not in ("http", "https") or host not in hosts:
        return f"{field}: {url!r} is not an http URL on a node of the params ({', '.join(sorted(hosts))})"
    return None


def _log_problem(field: str, path: str, log_dir: str) -> str | None:
    """A log path must lie in the node's log directory, or be relative to the run dir without leaving it."""
    norm = posixpath.normpath(path)
    inside = norm.startswith(log_dir.rstrip("/") + "/") if posixpath.isabs(path) \
        else norm != ".." and not norm.startswith("../")
    return None if inside and "\0" not in path else f"{field}: {path!r} is outside {log_dir} and the run dir"


def endpoint_problems(e: Endpoint, params: Params, log_dir: str) -> list[str]:
    """Why `e` is not an endpoint these params' 05 could have recorded: its API key variable not among the params'
    secrets, a URL on no node, a node the params lack, a log outside the node's log directory; [] where none."""
    nodes = {n.name for n in params.nodes}
    hosts = {n.host for n in params.nodes} | {str(n.fabric_ip) for n in params.nodes}
    secrets = {*params.secrets, *([params.serve.api_key_env] if params.serve.api_key_env else [])}
    problems = []
    if e.api_key_env is not None and e.api_key_env not in secrets:
        problems.append(f"endpoint.api_key_env {e.api_key_env!r} is not among the params' secrets")
    urls = {"endpoint.base_url": e.base_url, **{f"endpoint.addresses.{k}": v for k, v in e.addresses.items()},
            **{f"endpoint.replicas.{k}": v for k, v in e.replicas.items()}}
    problems += [p for f, url in urls.items() if (p := _url_problem(f, url, hosts))]
    named = {*e.commands, *e.env, *e.logs, *e.replicas}
    problems += [f"endpoint: node {n!r} is not a node of the params" for n in sorted(named - nodes)]
    logs = {f"endpoint.logs.{k}": v for k, v in e.logs.items()}
    logs |= {"endpoint.router_log": e.router_log} if e.router_log is not None else {}
    problems += [p for f, path in logs.items() if (p := _log_problem(f, path, log_dir))]
    return problems
