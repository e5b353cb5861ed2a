"""What every stage function is handed: one small frozen context instead of `(params, cluster, runtime, ...)`.

Stages read it and return values; they never record into the run (the notebook records what they return).
`Run.context()` builds it; `with_image` gives the same context with the image 03 chose, which the node
places (04's containers, 05's serving processes) are named from.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from ..values.params import Params
from ..values.state import Handoff, Handoffs
from .nodes import Cluster, Node
from .runtime import ImageSource, Place, Runtime
from .runtimes import image_source_for
from .topology import front_place
from .topology import places as _places


@dataclass(frozen=True)
class Context:
    """The cluster a stage acts on: its params, its nodes, the runtime on them, the run dir for logs and,
    from 04 on, the image its places run."""

    params: Params
    cluster: Cluster
    runtime: Runtime
    run_dir: Path
    image: str | None = None
    handoffs: Handoffs = dataclasses.field(default_factory=Handoffs)  # what the notebooks before this one left

    def with_image(self, ref: str) -> Context:
        return dataclasses.replace(self, image=ref)

    def with_handoffs(self, *values: Handoff) -> Context:
        """The same context with these hand-offs beside its own (`sparkbook plan` chains the previews so)."""
        return dataclasses.replace(self, handoffs=self.handoffs.adding(*values))

    @property
    def images(self) -> ImageSource:
        """Where 02 and 03 find images (Docker's images, or the Python environment): apart from process control."""
        return image_source_for(self.params)

    @property
    def head(self) -> Node:
        return self.cluster.head

    @property
    def places(self) -> dict[str, Place]:
        """One place per node (04's containers; 05 serves in the same ones), named from the chosen image."""
        if self.image is None:
            raise ValueError("this context has no image yet: use ctx.with_image(ImageChoice.ref)")
        return _places(self.params, self.image)

    def place(self, node: str) -> Place:
        return self.places[node]

    @property
    def front(self) -> Place:
        """The front's own place on the head (serve.front: router), which 04's new node places leave standing."""
        if self.image is None:
            raise ValueError("this context has no image yet: use ctx.with_image(ImageChoice.ref)")
        return front_place(self.params, self.image)
