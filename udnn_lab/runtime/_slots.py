"""What one step of the offload runtime keeps per planned storage, and its small helpers (NOTE [offload runtime])."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from udnn_lab.graph.plan_ir import Offload, Plan, Recompute
from udnn_lab.runtime._replay import Replay
from udnn_lab.runtime._rerun import ModuleRerun
from udnn_lab.runtime._step_layout import StepLayout
from udnn_lab.runtime.pinned_pool import HostPool


@dataclass(frozen=True)
class StepStats:
    """What one step under the runtime moved and waited for."""

    ops: int | None  # ops the step ran; None when it was followed by its saved-tensor events (not counted)
    d2h_bytes: int
    h2d_bytes: int
    recomputed: int  # tensors rebuilt by replay
    wait_s: float  # host time blocked on copies
    on_demand: int  # handles unpacked before their prefetch
    by_hook_events: bool = False  # followed by module and saved-tensor hooks (a dispatch mode only to record)
    hook_calls: int | None = None  # followed by hooks: the calls it handled, which Plan.hook_calls prices


class Slot:
    """One planned storage during one step."""

    __slots__ = ("tensor", "action", "device_data", "key", "host", "host_offset", "offload_done", "restored",
                 "rebuilt", "prefetch_done", "handles", "replay", "watchers", "saved")

    def __init__(self, tensor: int, action: Offload | Recompute, replay: ModuleRerun | None = None) -> None:
        self.tensor, self.action = tensor, action
        self.device_data: torch.Tensor | None = None  # uint8 view of the original storage, held until copied out
        self.key: int | None = None  # id() of the original storage, while it lives
        self.host: torch.Tensor | None = None
        self.host_offset: int | None = None
        self.offload_done: torch.cuda.Event | None = None
        self.restored: torch.Tensor | None = None
        self.rebuilt: torch.Tensor | None = None  # a recomputed tensor as its replay made it (over ``restored``)
        self.prefetch_done: torch.cuda.Event | None = None
        self.handles = 0
        self.saved: list[weakref.ref[Handle]] = []  # its handles, to check when the storage is written
        self.replay: Replay | ModuleRerun | None = replay  # a Replay's is set where the step meets the tensor
        self.watchers: list[weakref.ref] = []  # weakrefs whose callbacks follow the storage and the handles


class Handle:
    """What autograd keeps instead of a planned tensor: which slot, and the view to rebuild."""

    __slots__ = ("slot", "dtype", "shape", "stride", "offset", "saved", "weak", "version", "stale", "__weakref__")

    def __init__(self, slot: Slot, tensor: torch.Tensor, held: bool = True) -> None:
        self.slot = slot
        self.dtype, self.shape, self.stride, self.offset = tensor.dtype, tensor.shape, tensor.stride(), \
            tensor.storage_offset()
        # autograd's version check, which a handle would lose (NOTE [offload runtime] 5). Autograd often packs
        # a fresh alias that shares the version counter: it is held until forward lets the tensor go (an
        # offload's until its release point, which is no earlier), when it costs no memory, then weakly.
        self.version, self.stale = tensor._version, False
        self.saved: torch.Tensor | None = tensor if held else None
        self.weak = weakref.ref(tensor)

    def saved_tensor(self) -> torch.Tensor | None:
        return self.saved if self.saved is not None else self.weak()

    def check(self) -> None:
        """Mark the handle stale if its saved tensor was written in place since it was saved."""
        saved = self.saved_tensor()
        if saved is not None and saved._version != self.version:
            self.stale = True


class Kept:
    """A tensor the plan leaves alone, with its version when saved: autograd skips that check under hooks."""

    __slots__ = ("tensor", "version")

    def __init__(self, tensor: torch.Tensor, version: int) -> None:
        self.tensor, self.version = tensor, version


def modified_in_place(dtype: torch.dtype, shape) -> None:
    raise RuntimeError(
        "one of the variables needed for gradient computation has been modified by an inplace operation: "
        f"a saved {dtype} tensor of shape {list(shape)} was written after it was saved (eager PyTorch refuses "
        "this step too: the step, not the plan, is wrong)")


class OpMode(TorchDispatchMode):
    """A dispatch mode that hands every op to a step: all of them (op by op), or those of a recording window."""

    def __init__(self, on_op: Callable[[Any, tuple, dict], Any]) -> None:
        super().__init__()
        self.on_op = on_op

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return self.on_op(func, args, kwargs or {})


class Observer(Protocol):
    def adopt(self, tensor: torch.Tensor) -> None: ...


class Owner(Protocol):
    """What a step needs of the runtime that runs it."""

    plan: Plan | None
    pool: HostPool | None
    observer: Observer | None

    def host_pool(self, device: torch.device) -> HostPool: ...

    def step_layout(self, reruns: Collection[int]) -> StepLayout: ...


def last_look(slot: Slot) -> None:
    """Forward is done with the tensor: the last moment a write into it can be seen (5); the aliases go."""
    for handle in alive(slot.saved):
        handle.check()
        handle.saved = None


def alive(refs) -> list[Handle]:
    return [handle for handle in (ref() for ref in refs) if handle is not None]


def bytes_of(tensor: torch.Tensor) -> torch.Tensor:
    """A uint8 tensor over the whole storage of ``tensor`` (made without dispatch: not an op of the step)."""
    storage = tensor.untyped_storage()
    with torch._C._DisableTorchDispatch():
        return torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(storage)
