"""Which implementation of `core.cluster.runtime`'s interfaces a params file picks: Docker's or a Python environment's.
Apart from the interfaces, so the interfaces import none of their implementations and the implementations import
them."""
from __future__ import annotations

from ..values.params import DockerRuntime, Params
from .runtime import ImageSource, Runtime
from .runtime_docker import DockerImages, DockerNodes
from .runtime_python import PythonImages, PythonNodes
from .topology import cache_dir


def runtime_for(params: Params) -> Runtime:
    if isinstance(params.runtime, DockerRuntime):
        return DockerNodes(params.runtime, params.model.cache_dir, params.secret_values(), cache_dir(params))
    return PythonNodes(params.runtime, params.secret_values())


def image_source_for(params: Params) -> ImageSource:
    if isinstance(params.runtime, DockerRuntime):
        return DockerImages(params.runtime)
    return PythonImages(params.runtime)
