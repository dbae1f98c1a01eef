"""The storages FSDP2 frees and refills in place, for the recorder to watch.

NOTE [resized storages]
  1. FSDP2 (``fully_shard``) keeps each parameter's unsharded tensor for the whole run and frees its bytes
     by ``untyped_storage().resize_(0)`` after use (reshard), giving them back by ``resize_(n)`` before the
     next all-gather copies into it (``FSDPParam.all_gather_outputs``, and the inner tensors of all-gather
     extensions). A storage resize is not an op: no dispatch mode sees it, and the storage object, which
     the recorder knows storages by (NOTE [storage lifetimes] 1), stays the same.
  2. So the recorder polls these storages' sizes before each op and when the step ends. A storage found
     emptied was released right after the op before (NOTE [storage lifetimes] 3); one found refilled is a
     new storage of its parameter, allocated by the op about to run (the all-gather's copy-out), with the
     category "parameter".
  3. The tensors are FSDP's private state (as PyTorch's own FSDPMemTracker reads it). Their list exists
     after the first step (FSDP's lazy init), which is why every measured or traced step comes after one.
  4. Polling every watched storage before every op costs a tenth of a traced step of Llama-3-8B (291
     storages, 9792 ops). FSDP2 resizes them through the storage's Python ``resize_``, so while a step is
     recorded that method is wrapped to note which storages were resized (``resizes_seen``), and the poll
     before an op looks at those alone; the poll at the step's end looks at every one, as before.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel


@dataclass(frozen=True)
class ResizedStorage:
    """A tensor whose storage FSDP resizes in place, and what to call it."""

    tensor: torch.Tensor
    name: str  # '<parameter> (unsharded)'


def fsdp_modules(model: nn.Module) -> list[nn.Module]:
    """The modules of ``model`` that ``fully_shard`` was applied to (none when FSDP was never imported)."""
    fsdp = sys.modules.get("torch.distributed.fsdp")  # not imported: nothing can have been sharded (saves 0.7 s)
    if fsdp is None:
        return []
    return [m for m in model.modules() if isinstance(m, fsdp.FSDPModule)]


def is_distributed(model: nn.Module) -> bool:
    """Whether ``model`` is already wrapped for several ranks (DistributedDataParallel, or fully_shard applied)."""
    return isinstance(model, DistributedDataParallel) or bool(fsdp_modules(model))


def fsdp_params(model: nn.Module) -> list[Any]:
    """The FSDPParams of every FSDP2 module in ``model``. A module's state keeps them in a list of param groups;
    older torch (2.11) keeps one group or none."""
    found = []
    for module in fsdp_modules(model):
        state = module._get_fsdp_state()  # type: ignore[operator]
        groups = getattr(state, "_fsdp_param_groups", None)
        if groups is None:
            groups = [group for group in (state._fsdp_param_group,) if group is not None]
        found += [param for group in groups for param in group.fsdp_params]
    return found


def resized_storages(model: nn.Module) -> list[ResizedStorage]:
    """Every unsharded-parameter tensor of the FSDP2 modules in ``model`` (NOTE [resized storages] 3)."""
    found = []
    for param in fsdp_params(model):
        name = f"{param._param_fqn} (unsharded)"
        found += [ResizedStorage(t, name) for t in (*param.all_gather_outputs, *param._unsharded_inner_tensors)]
    return found


_SEEN: list[set[int]] = []  # one set per recording step, of the ids of the storages resized (NOTE 4)
_LOCK = threading.Lock()
_RESIZE = torch.UntypedStorage.resize_


def _noted_resize(storage, size):
    result = _RESIZE(storage, size)
    for seen in _SEEN:
        seen.add(id(storage))
    return result


@contextmanager
def resizes_seen() -> Iterator[set[int]]:
    """The ids of the storages resized through ``resize_`` while inside (NOTE [resized storages] 4)."""
    seen: set[int] = set()
    with _LOCK:
        if not _SEEN:
            torch.UntypedStorage.resize_ = _noted_resize  # type: ignore[method-assign]
        _SEEN.append(seen)
    try:
        yield seen
    finally:
        with _LOCK:
            _SEEN.remove(seen)
            if not _SEEN:
                torch.UntypedStorage.resize_ = _RESIZE  # type: ignore[method-assign]
