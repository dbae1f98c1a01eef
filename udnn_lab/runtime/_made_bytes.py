"""What a recomputation makes while it runs, counted for an observer of the step that cannot see it (NOTE [offload
runtime] 6 and 8): a replay's or a module re-run's intermediates, alive at once beside the step's own tensors."""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from functools import partial

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from udnn_lab.analysis.recording import flat_tensors


class MadeBytes(TorchDispatchMode):
    """The bytes of the storages ops make while they are alive, and the most alive at once. A storage an op reads
    before any op made it was there before the count: never counted, nor are views of it; but where one goes while
    the count is open (a replay lets go of its recorded inputs as it ends), the peak was that much above what is
    alive after it (``above_now``)."""

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = 0
        self.gone_from_before = 0  # bytes of storages from before the count that went since
        self._refs: dict[int, weakref.ref] = {}
        self._counted: dict[int, int] = {}  # storage -> its bytes, for those the count made
        self._before: dict[int, int] = {}  # storage -> its bytes, for those from before the count

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        for tensor in flat_tensors((args, kwargs or {})):
            self._meet(tensor, made=False)
        out = func(*args, **(kwargs or {}))
        for tensor in flat_tensors((out,)):
            self._meet(tensor, made=True)
        return out

    def above_now(self) -> int:
        """The most alive at once while the ops ran, above what is alive now of what the count knows."""
        return self.peak + self.gone_from_before

    def close(self) -> None:
        """Stop following the storages: the weak references go, and their callbacks with them."""
        self._refs.clear()
        self._counted.clear()
        self._before.clear()

    def _meet(self, tensor: torch.Tensor, made: bool) -> None:
        try:
            storage = tensor.untyped_storage()
        except (RuntimeError, NotImplementedError):  # a tensor without storage (a wrapper's outer tensor)
            return
        key = id(storage)
        if key in self._refs:
            return
        self._refs[key] = weakref.ref(storage, partial(self._gone, key))
        if made:
            self._counted[key] = storage.nbytes()
            self.live += storage.nbytes()
            self.peak = max(self.peak, self.live)
        else:
            self._before[key] = storage.nbytes()

    def _gone(self, key: int, _ref) -> None:
        self._refs.pop(key, None)
        self.live -= self._counted.pop(key, 0)
        self.gone_from_before += self._before.pop(key, 0)


def out_of_sight(counted: MadeBytes | None) -> contextlib.AbstractContextManager:
    """Where the runtime runs a recomputation (NOTE [offload runtime] 8): out of every dispatch mode's sight, the
    step's modes' and a tensor subclass's, or, where ``counted`` is given, seen by that counter alone."""
    return torch._C._DisableTorchDispatch() if counted is None else _seen_by(counted)


@contextlib.contextmanager
def _seen_by(counted: MadeBytes) -> Iterator[None]:
    with _disable_current_modes(), counted:
        yield
