"""When the forward pass lets go of each storage it makes, if autograd held nothing.

NOTE [forward holders]
  1. Autograd keeps a saved tensor until its backward use, so the trace's free steps do not
     show the step's other references: a local that outlives its last use (a U-Net's skip,
     held until the enclosing forward returns), the output the training loop keeps, a
     sequence another layer loops over. Offloading or dropping such a tensor frees nothing
     until those references go.
  2. So forward and the loss run a second time under the same fake tensors, with
     saved-tensor hooks that keep nothing, counting ops as the recorder does (records_op).
     A storage is known by the op that made it and its position among that op's new
     storages, as the runtime finds planned tensors (NOTE [offload runtime] 1); its
     release is attributed to the op that ran last (NOTE [storage lifetimes] 3).
  3. What is still alive when forward and the loss have run is held by the caller (the
     output, the loss): the training step keeps it through backward.
  4. With gradient accumulation every micro-batch runs this same forward: its releases
     are this one's, shifted to where its forward starts.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from contextlib import nullcontext
from functools import partial
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from udnn_lab.analysis._fake.memo import flat_tensors
from udnn_lab.analysis._recorder import records_op
from udnn_lab.analysis.step import forward_loss, view_replay
from udnn_lab.workload import DEFAULT_STEP, StepOptions

HELD = None  # a storage the caller still holds when forward and the loss are done (NOTE [forward holders] 3)


class _Releases(TorchDispatchMode):
    """Counts ops; notes when each new storage of an op dies."""

    def __init__(self, run_op: Callable) -> None:
        super().__init__()
        self.run_op = run_op
        self.index = 0
        self.released: dict[tuple[int, int], int | None] = {}
        self._refs: list[weakref.ref] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = self.run_op(func, args, kwargs)
        if not records_op(func):
            return out
        index = self.index
        self.index += 1
        taken = {id(t.untyped_storage()) for t in flat_tensors((args, kwargs))}
        position = 0
        for tensor in flat_tensors((out,)):
            storage = tensor.untyped_storage()
            if id(storage) in taken:
                continue
            taken.add(id(storage))
            key = (index, position)
            position += 1
            self.released[key] = HELD
            self._refs.append(weakref.ref(storage, partial(self._gone, key)))
        return out

    def _gone(self, key: tuple[int, int], _ref) -> None:
        self.released[key] = self.index - 1


def forward_releases(model: torch.nn.Module, args: tuple, kwargs: dict, target: Any, loss_fn: Callable | None,
                     run_op: Callable, options: StepOptions = DEFAULT_STEP, scaler: torch.amp.GradScaler | None = None,
                     runtime: Any = None) -> tuple[int, dict[tuple[int, int], int | None]]:
    """(ops counted, {(producer op, position among its new storages): op after which it is released, or HELD}).

    Run where the trace's fake mode and fake parameters are active, with the trace's ``run_op``
    (its fast paths and probes decide shapes and strides, so the same ops run: NOTE [forward holders] 2),
    and the step's ``options`` and ``scaler`` (autocast, the loss's division and scaling are forward too).
    ``runtime``: a dispatch mode the step ran under, inside the recorder (NOTE [host storages] 2): entered here
    inside the counting too, so that the ops it adds are counted.
    """
    watcher = _Releases(run_op)
    keep_nothing = torch.autograd.graph.saved_tensors_hooks(lambda tensor: None, lambda packed: packed)
    with view_replay(), keep_nothing, watcher, runtime or nullcontext():
        output, loss, start = forward_loss(model, args, kwargs, loss_fn=loss_fn, target=target, options=options,
                                           scaler=scaler)
    released = dict(watcher.released)
    watcher._refs.clear()  # before the output and loss go: what they hold stays HELD
    del output, loss, start
    return watcher.index, released
