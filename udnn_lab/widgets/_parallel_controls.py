"""MemoryLab's controls for a step spread over ranks: none, DDP, FSDP2 or HSDP, and the world size.

The prediction is of one rank (``ul.trace(..., parallel=...)``); "one GPU" disables the world size, which then
adds nothing to the step, so changing it traces nothing again.
"""

from __future__ import annotations

import ipywidgets as widgets

from udnn_lab.fitting import parallel_spec
from udnn_lab.parallel import Parallel

ONE_GPU = "one GPU"
CHOICES = (ONE_GPU, "DDP", "FSDP2", "HSDP")


class ParallelControls:
    """The two boxes; ``setup()`` is what the step gets: (None, 1) or (a setup name, a world size)."""

    def __init__(self, setup: str | None, world_size: int, width: str) -> None:
        setup = setup or ONE_GPU
        if setup not in CHOICES:
            raise ValueError(f"unknown parallel setup {setup!r}: use one of {', '.join(CHOICES[1:])} (or None)")
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size counts the ranks (one per GPU): a positive int, got {world_size!r}")
        layout = widgets.Layout(width=width)
        self.ranks = widgets.Dropdown(options=list(CHOICES), value=setup, description="ranks", layout=layout,
                                      tooltip="DDP: whole replicas; FSDP2: parameters, gradients and optimizer "
                                              "state sharded over every rank; HSDP: sharded within a node of 8, "
                                              "replicated across nodes. The charts show one rank.")
        self.world_size = widgets.BoundedIntText(value=world_size, min=1, max=1 << 16, description="world size",
                                                 tooltip="ranks (processes, one GPU each)", layout=layout)
        self.ranks.observe(lambda _: self._follow(), names="value")
        self._follow()

    @property
    def controls(self) -> tuple[widgets.Widget, ...]:
        return self.ranks, self.world_size

    def _follow(self) -> None:
        self.world_size.disabled = self.ranks.value == ONE_GPU

    def setup(self) -> tuple[str | None, int]:
        if self.ranks.value == ONE_GPU:
            return None, 1
        return str(self.ranks.value), int(self.world_size.value)


def spec_of(setup: str | None, world_size: int) -> Parallel | None:
    """The spec a setting's (setup, world size) stands for; None on one GPU."""
    return None if setup is None else parallel_spec(setup, world_size)
