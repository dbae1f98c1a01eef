"""MemoryLab's controls for a step spread over ranks: none, DDP, FSDP2 or HSDP, the world size, and whether FSDP2
keeps the rank's parameters on the host (its ``CPUOffloadPolicy``).

The prediction is of one rank (``ul.trace(..., parallel=...)``); "one GPU" disables the world size, which then
adds nothing to the step, so changing it traces nothing again; so does DDP the parameters' switch.
"""

from __future__ import annotations

import ipywidgets as widgets

from udnn_lab.fitting import parallel_spec
from udnn_lab.parallel import Parallel

ONE_GPU = "one GPU"
CHOICES = (ONE_GPU, "DDP", "FSDP2", "HSDP")


SHARDED = ("FSDP2", "HSDP")


class ParallelControls:
    """The three controls; ``setup()`` is what the step gets: (None, 1, False) or (a setup name, a world size,
    whether FSDP2 offloads the parameters)."""

    def __init__(self, setup: str | None, world_size: int, width: str, offload_params: bool = False) -> None:
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
        if not isinstance(offload_params, bool):
            raise ValueError(f"offload_params is True or False (FSDP2 keeps the parameters on the host), got "
                             f"{offload_params!r}")
        self.offload = widgets.Checkbox(value=offload_params, description="parameters on host", indent=True,
                                        layout=layout, tooltip="FSDP2's CPUOffloadPolicy: the rank's sharded "
                                        "parameters, gradients and optimizer state in host memory, the optimizer "
                                        "stepping there; the device holds each block's gathered parameters")
        self.ranks.observe(lambda _: self._follow(), names="value")
        self._follow()

    @property
    def controls(self) -> tuple[widgets.Widget, ...]:
        return self.ranks, self.world_size, self.offload

    def _follow(self) -> None:
        self.world_size.disabled = self.ranks.value == ONE_GPU
        self.offload.disabled = self.ranks.value not in SHARDED

    def setup(self) -> tuple[str | None, int, bool]:
        if self.ranks.value == ONE_GPU:
            return None, 1, False
        return str(self.ranks.value), int(self.world_size.value), self.ranks.value in SHARDED and self.offload.value


def spec_of(setup: str | None, world_size: int, offload_params: bool = False) -> Parallel | None:
    """The spec a setting's (setup, world size, offload) stands for; None on one GPU."""
    if setup is None:
        return None
    return parallel_spec(setup, world_size, fsdp_options={"offload_params": True} if offload_params else None)
