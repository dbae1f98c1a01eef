"""The host time a Python dispatch mode adds to each op: what following a step op by op costs here.

A plan the runtime cannot follow by its module and saved-tensor hooks alone is followed op by op,
under a TorchDispatchMode (NOTE [offload runtime] 1). Every op of the step then makes a round trip
through Python: on a CPU that time adds to the op's, on a GPU it is host time the device waits for
once the host falls behind. This probe runs a fixed chain of small ops with autograd, forward and
backward, with and without a pass-through mode that does the runtime's bookkeeping for an op it does
not act on (its family by op, the op's index against the plan's), and returns the difference per op.
"""

from __future__ import annotations

import time
from contextlib import nullcontext

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from udnn_lab.vocabulary import traced_op

_BLOCKS = 8  # convolution, batch norm, ReLU and a residual add each: about 100 ops in forward and backward


class PassThroughMode(TorchDispatchMode):
    """Runs every op as it is, doing the runtime's work for an op it does not act on: a lookup by op, a count
    and a comparison. Timing a step with and without it tells what following that step op by op costs."""

    def __init__(self) -> None:
        super().__init__()
        self.families: dict = {}
        self.index = 0  # ops a trace counts (vocabulary.traced_op)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        family = self.families.get(func)
        if family is None:
            family = self.families[func] = str(func) if traced_op(func) else None
        if family is None:
            return func(*args, **(kwargs or {}))
        self.index += 1
        if family == "":  # never true: the comparison the runtime makes with the plan's op
            raise AssertionError(func)
        return func(*args, **(kwargs or {}))


def _network(device: torch.device) -> torch.nn.ModuleList:
    """Small residual blocks: the ops and argument lists of a real network, on inputs too small to take time."""
    blocks = [torch.nn.Sequential(torch.nn.Conv2d(4, 4, 3, padding=1, bias=False), torch.nn.BatchNorm2d(4),
                                  torch.nn.ReLU()) for _ in range(_BLOCKS)]
    return torch.nn.ModuleList(blocks).to(device)


def _step(network: torch.nn.ModuleList, x: torch.Tensor) -> None:
    y = x
    for block in network:
        y = block(y) + y
    y.sum().backward()


def _host_seconds(network: torch.nn.ModuleList, x: torch.Tensor, mode: PassThroughMode | None) -> float:
    if x.device.type == "cuda":
        torch.cuda.synchronize(x.device)
    start = time.perf_counter()
    with mode if mode is not None else nullcontext():
        _step(network, x)
    seconds = time.perf_counter() - start  # host time: a GPU runs these tiny kernels faster than they are issued
    network.zero_grad(set_to_none=True)
    return seconds


def dispatch_mode_op_s(device: torch.device, repeats: int = 5) -> tuple[float, int]:
    """(seconds a dispatch mode adds to each op a trace counts, those ops in the probe's step), from the least
    times of interleaved steps: the machine's figure with the machine to itself (a busy machine slows some rounds,
    and medians can put it at 0 or several times itself: runtime/_host_probe.py). The probe's host caches stay
    warm: on a CPU, where the step's own kernels evict them, a real step pays more per op (``ul.profile`` measures
    that step's own figure)."""
    network, x = _network(device), torch.randn(2, 4, 4, 4, device=device)
    counting = PassThroughMode()
    _host_seconds(network, x, counting)
    ops = counting.index
    plain, moded = [], []
    for _ in range(2):  # warm-up
        _host_seconds(network, x, None), _host_seconds(network, x, PassThroughMode())
    for _ in range(max(repeats, 5) * 4):
        plain.append(_host_seconds(network, x, None))
        moded.append(_host_seconds(network, x, PassThroughMode()))
    return max(min(moded) - min(plain), 0.0) / ops, ops
