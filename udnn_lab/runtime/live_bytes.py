"""Live bytes of a step on a CPU, where there is no allocator to ask: storages counted as they come and go.

A lighter cousin of the recorder (NOTE [storage lifetimes] in recorder.py): it keeps no
op records, only the bytes alive now and the most seen at once.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from functools import partial

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from udnn_lab.analysis._fake.memo import flat_tensors


class LiveBytes(TorchDispatchMode):
    def __init__(self, existing: Iterable[torch.Tensor] = ()) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._refs: dict[int, weakref.ref] = {}
        for tensor in existing:
            self._see(tensor)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in flat_tensors(args) if self._unseen_inputs(args) else ():
            self._see(tensor)
        for tensor in flat_tensors((out,)):
            self._see(tensor)
        return out

    def adopt(self, tensor: torch.Tensor) -> None:
        """A storage made by something other than an op (an offload runtime's prefetch)."""
        self._see(tensor)

    def _unseen_inputs(self, args) -> bool:
        return any(id(t.untyped_storage()) not in self._refs for t in flat_tensors(args))

    def _see(self, tensor: torch.Tensor) -> None:
        try:
            storage = tensor.untyped_storage()
        except (RuntimeError, NotImplementedError):
            return
        key = id(storage)
        if key in self._refs:
            return
        nbytes = storage.nbytes()
        self._refs[key] = weakref.ref(storage, partial(self._gone, key, nbytes))
        self.live += nbytes
        self.peak = max(self.peak, self.live)

    def _gone(self, key: int, nbytes: int, _ref) -> None:
        if self._refs.pop(key, None) is not None:
            self.live -= nbytes
