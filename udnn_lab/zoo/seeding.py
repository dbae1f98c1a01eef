"""Random weights from a seed, without reseeding the caller's random stream."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch


@contextmanager
def seeded(seed: int, device: torch.device) -> Iterator[None]:
    """Modules built inside draw their random weights from ``seed``; torch's global generators are as they were
    afterwards (the caller's own random stream is not reseeded by asking for a model)."""
    index = (device.index if device.index is not None else torch.cuda.current_device()) \
        if device.type == "cuda" else None
    with torch.random.fork_rng(devices=[] if index is None else [index]):
        torch.random.default_generator.manual_seed(seed)
        if index is not None:  # that device's generator alone (torch.manual_seed would reseed every GPU's)
            with torch.cuda.device(index):
                torch.cuda.manual_seed(seed)
        yield
