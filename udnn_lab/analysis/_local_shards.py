"""An FSDP2 rank's optimizer step taken on its local shards, for the trace (NOTE [local shard steps]).

NOTE [local shard steps]
  1. FSDP2's parameters, their gradients and the optimizer state made for them are DTensors sharded along
     their first dimension. An elementwise optimizer step (SGD, Adam, AdamW: the foreach kernels included)
     runs, through DTensor's dispatch, the same aten op on each rank's local tensors: nothing is
     communicated, and the local tensors are the storages the trace records (NOTE [wrapper tensors]).
  2. Working that out is DTensor's sharding propagation, which for a foreach kernel over a few hundred
     parameters takes most of a second in Python, twice per op per step: half of a Llama-3-8B rank's trace.
     So the trace steps an optimizer of the same class and settings over the local tensors, handing it each
     gradient's local tensor, and runs the aten ops DTensor would run, without the propagation.
  3. FSDP2 makes a parameter's local tensor anew in its lazy initialization (the first forward), so the
     shards are looked up again at every step, and the optimizer's state follows a shard that was replaced.
  4. It is also closer to the real step: the first time DTensor's propagation meets an op's arguments it runs
     ops of its own on them (temporaries of the shapes it reasons about), which under fake tensors a trace
     records as the step's; a real step's propagation does that work on meta tensors, and once its caches are
     warm, not at all. The shards' step makes the ops DTensor's step makes with warm caches (checked: ops and
     bytes equal on 30 unseen architectures, CPU and CUDA kernels, ranks 0 and 3 of 4, SGD with momentum, Adam).
  5. Only where that holds: no GradScaler (its inf check reduces across ranks) and no gradient clipping (the
     norm is all-reduced), and SGD, Adam or AdamW. Otherwise the DTensor optimizer runs.
  6. Where it runs, the trace warms up two steps rather than one: an optimizer's first step runs other ops than
     its next ones (SGD makes its momentum by a copy, then updates it in place), and an op that DTensor first
     meets in the recorded step would bring its propagation's own ops into the trace. After two steps every op
     of the steady step has been met, and the trace is the same whatever ran before it in the process
     (checked with clipping and a GradScaler in tests/analysis/test_one_rank.py).
  7. Warm caches are not enough on every torch: where the propagation's cache keys an op by its scalar
     arguments too (torch 2.11), Adam's ``addcdiv_`` by a step size that changes every step misses it every
     step, and its propagation ran three parameter-sized temporaries and the op again in the trace's fake mode,
     recorded as the step's (a rank of an MLP under AdamW: 21.1 MB where the shards' step peaks at 17.3). A
     real step's propagation makes a fake mode of its own for them, which a measurement's recorder saw as well.
     So every recorded step, traced or measured, runs them in a fake mode of its own beneath no recorder
     (``propagation_unrecorded``): they hold no memory of the step's.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import cast

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import _disable_current_modes

from udnn_lab.analysis.step import same_optimizer

CHECKED = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW)  # NOTE [local shard steps] 5


class LocalShardSteps:
    """Looks like the DTensor optimizer to the step (param_groups, state, zero_grad, step); steps the shards."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.groups = [list(group["params"]) for group in optimizer.param_groups]  # the DTensor parameters
        self.inner = same_optimizer(optimizer, [{**{k: v for k, v in group.items() if k != "params"},
                                                 "params": [_shard(p) for p in params]}
                                                for group, params in zip(optimizer.param_groups, self.groups,
                                                                         strict=True)])
        self.defaults = self.inner.defaults

    @property
    def param_groups(self) -> list[dict]:
        return self.inner.param_groups

    @property
    def state(self) -> Mapping[torch.Tensor, dict]:
        """Each parameter's state (its shard's), keyed by the parameter, as the DTensor optimizer keys it."""
        return {p: self.inner.state[local] for params, group in zip(self.groups, self.inner.param_groups, strict=True)
                for p, local in zip(params, group["params"], strict=True) if local in self.inner.state}

    def zero_grad(self, set_to_none: bool = True) -> None:
        for params, group in zip(self.groups, self.inner.param_groups, strict=True):
            for p, local in zip(params, group["params"], strict=True):
                p.grad = local.grad = None

    def step(self) -> None:
        for params, group in zip(self.groups, self.inner.param_groups, strict=True):
            for i, p in enumerate(params):
                local, before = _shard(p), group["params"][i]
                if local is not before:  # NOTE [local shard steps] 3
                    group["params"][i] = local
                    if before in self.inner.state:
                        self.inner.state[local] = self.inner.state.pop(before)
                    before.grad = None
                local.grad = None if p.grad is None else _shard(p.grad)
        self.inner.step()


def steps_on_shards(optimizer: torch.optim.Optimizer | None, scales_loss: bool,
                    clips: bool) -> torch.optim.Optimizer | None:
    """``optimizer`` itself, or a LocalShardSteps over it where NOTE [local shard steps] 5 allows."""
    if optimizer is None or scales_loss or clips or type(optimizer) not in CHECKED:
        return optimizer
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if not params or not all(_sharded_on_first_dim(p) for p in params):
        return optimizer
    return cast(torch.optim.Optimizer, LocalShardSteps(optimizer))  # what the step uses of one, it has


def _shard(tensor: torch.Tensor) -> torch.Tensor:
    return tensor._local_tensor  # type: ignore[attr-defined]  # a DTensor's tensor on this rank


def _sharded_on_first_dim(tensor: torch.Tensor) -> bool:
    placements = getattr(tensor, "placements", None)
    return placements is not None and all(getattr(p, "dim", None) == 0 or p.is_replicate() for p in placements)


_PROPAGATION = threading.Lock()
_unrecorded_steps = 0  # recorded steps under way (threads, nested traces): the wrapper goes when the last ends
_kept: list = []  # what the propagator had on the instance before the wrapper, if anything


@contextmanager
def propagation_unrecorded() -> Iterator[None]:
    """DTensor's sharding propagation runs the ops it reasons with in a fake mode of its own, beneath no dispatch
    mode of the trace's or a measurement's (NOTE [local shard steps] 7); as it was once the last such step ends."""
    global _unrecorded_steps
    dtensor = sys.modules.get("torch.distributed.tensor")  # not imported: no DTensor in the step
    propagator = dtensor.DTensor._op_dispatcher.sharding_propagator if dtensor is not None else None
    if propagator is None or not hasattr(propagator, "_propagate_tensor_meta_non_cached"):
        yield  # a torch that propagates otherwise: nothing to keep out
        return
    with _PROPAGATION:
        if _unrecorded_steps == 0:
            _wrap(propagator)
        _unrecorded_steps += 1
    try:
        yield
    finally:
        with _PROPAGATION:
            _unrecorded_steps -= 1
            if _unrecorded_steps == 0:
                _unwrap(propagator)


def _wrap(propagator) -> None:
    original = propagator._propagate_tensor_meta_non_cached
    _kept[:] = [vars(propagator).get("_propagate_tensor_meta_non_cached")]  # one set on the instance before: kept

    def unrecorded(op_schema):
        with _disable_current_modes(), FakeTensorMode():
            return original(op_schema)

    propagator._propagate_tensor_meta_non_cached = unrecorded


def _unwrap(propagator) -> None:
    own = _kept.pop() if _kept else None
    if own is None:
        del propagator._propagate_tensor_meta_non_cached  # the class's method again
    else:
        propagator._propagate_tensor_meta_non_cached = own
