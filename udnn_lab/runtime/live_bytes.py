"""Live bytes of a step on a CPU, where there is no allocator to ask: storages counted as they come and go.

A lighter cousin of the recorder (NOTE [storage lifetimes] in analysis/_recorder.py): it keeps no
op records, only the bytes alive now and the most seen at once. As the recorder does (NOTE [wrapper tensors]),
it lets a DTensor run its own dispatch and counts the plain tensors inside, and it reads the size of the
storages FSDP2 empties and refills in place (NOTE [resized storages]) again before each op. A storage first met as
an op's out= tensor is taken to have been alive since the count began, so the peak so far held it too: DDP's
gradient buckets, kept between steps, are first written (``mul(..., out=)``) in backward, after a step's peak.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from functools import partial

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass_type

from udnn_lab.analysis.recording import flat_tensors
from udnn_lab.analysis.step import MicroBatch, scaler_state


class LiveBytes(TorchDispatchMode):
    def __init__(self, existing: Iterable[torch.Tensor] = (), watched: Iterable[torch.Tensor] = ()) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._refs: dict[int, weakref.ref] = {}
        self._counted: dict[int, int] = {}  # storage -> the bytes counted for it now
        self._watched = [weakref.ref(t) for t in watched]  # FSDP2's; never kept alive by the count
        for tensor in existing:
            self._see(getattr(tensor, "_local_tensor", tensor))  # a DTensor: its shard on this rank
        self._poll()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(is_traceable_wrapper_subclass_type(t) for t in types):
            return NotImplemented  # a DTensor runs its own dispatch first: its inner tensors come here
        self._poll()
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        for tensor in flat_tensors(args) if self._unseen_inputs(args) else ():
            self._see(tensor)
        if "out" in kwargs:  # written by the op, made before it
            for tensor in flat_tensors((kwargs["out"],)):
                self._see(tensor, held_since_the_start=True)
        for tensor in flat_tensors((out,)):
            self._see(tensor)
        return out

    def adopt(self, tensor: torch.Tensor, held_since_the_start: bool = False) -> None:
        """A storage made by something other than an op (an offload runtime's prefetch); ``held_since_the_start``:
        one the step had from its start that the count learns of only now (a later micro-batch)."""
        self._see(tensor, held_since_the_start)

    def during(self, made_bytes: int) -> None:
        """Out of the count's sight (an offload runtime's replay, NOTE [offload runtime] 6), the live bytes were up
        to ``made_bytes`` above what is alive now: the peak counts them."""
        self._poll()
        self.peak = max(self.peak, self.live + made_bytes)

    def _unseen_inputs(self, args) -> bool:
        return any(id(t.untyped_storage()) not in self._refs for t in flat_tensors(args))

    def _see(self, tensor: torch.Tensor, held_since_the_start: bool = False) -> None:
        try:
            storage = tensor.untyped_storage()
        except (RuntimeError, NotImplementedError):
            return
        key = id(storage)
        if key in self._refs:
            return
        self._refs[key] = weakref.ref(storage, partial(self._gone, key))
        self._counted[key] = 0
        peak_so_far = self.peak
        self._count(key, storage.nbytes())
        if held_since_the_start:
            self.peak = max(self.peak, peak_so_far + storage.nbytes())

    def _count(self, key: int, nbytes: int) -> None:
        self.live += nbytes - self._counted[key]
        self._counted[key] = nbytes
        self.peak = max(self.peak, self.live)

    def _poll(self) -> None:
        """Follow the watched storages' resizes: a resize is not an op, so no mode sees it."""
        for ref in self._watched:
            tensor = ref()
            if tensor is None:
                continue
            storage = tensor.untyped_storage()
            if id(storage) in self._refs:
                self._count(id(storage), storage.nbytes())
            elif storage.nbytes():
                self._see(tensor)

    def __exit__(self, *exc) -> None:
        self._poll()
        return super().__exit__(*exc)

    def _gone(self, key: int, _ref) -> None:
        if self._refs.pop(key, None) is not None:
            self.live -= self._counted.pop(key)


def resident(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, scaler: torch.amp.GradScaler | None,
             micro_batches: Iterable[MicroBatch]):
    """What a step starts with, for ``LiveBytes(existing=)``: parameters, buffers, optimizer and scaler state, and
    the micro-batches' tensors (inside whatever holds them)."""
    yield from model.parameters()
    yield from model.buffers()
    if optimizer is not None:
        for state in optimizer.state.values():
            yield from (v for v in state.values() if isinstance(v, torch.Tensor))
    yield from scaler_state(scaler).values()
    for args, kwargs, target in micro_batches:
        yield from flat_tensors((args, kwargs, target))

