"""A deep copy of a model that ``fully_shard`` was applied to, as the model was before it.

NOTE [unsharded copies]
  1. A trainer's strategy may shard the user's model before the callback sees it (FSDP2 changes it in place:
     each sharded module's class becomes FSDP<class>, its parameters DTensor shards, and FSDP's state and
     hooks are attached to it). A parallel trace shards a copy of the plain model itself (NOTE [one rank of
     N]), so the copy is made plain: each module keeps its own class, its attributes and its own hooks, and
     drops what FSDP added. A parameter's copy is made from its global shape (a DTensor's ``shape``).
  2. FSDP's modules refuse ``copy.deepcopy``. The copy is made module by module, children first, each from
     its ``__getstate__`` (Lightning's drops the trainer) and set with ``__setstate__``; everything else is
     deep-copied with the memo holding the made parameters, buffers and child modules.
"""

from __future__ import annotations

import copy
from typing import Any

from torch import nn
from torch.distributed.fsdp import FSDPModule

_FSDP_HOMES = ("torch.distributed.fsdp", "torch.distributed._composable")
_FSDP_MARKS = ("_is_fsdp_managed_module", "_fsdp_use_orig_params")  # set on each module an FSDP module manages
_STATE_KEYS = "__composable_api_"  # fully_shard's state and registry, kept in the module's __dict__


def unsharded_copy(model: nn.Module, memo: dict[int, Any]) -> nn.Module:
    """``model`` deep-copied without FSDP2 (NOTE [unsharded copies]); ``memo`` maps parameters and buffers
    (by id) to their copies, as for ``copy.deepcopy``."""
    found = memo.get(id(model))
    if found is not None:
        return found
    for child in model.children():
        unsharded_copy(child, memo)
    made: nn.Module = object.__new__(_plain_class(model))
    memo[id(model)] = made
    state = {key: value for key, value in model.__getstate__().items()
             if not key.startswith(_STATE_KEYS) and key not in _FSDP_MARKS}
    made.__setstate__({key: copy.deepcopy(value, memo) for key, value in _without_fsdp_hooks(state).items()})
    return made


def _plain_class(module: nn.Module) -> type:
    """A sharded module's own class (FSDP puts FSDP<class> over it)."""
    if not isinstance(module, FSDPModule):
        return type(module)
    return next(cls for cls in type(module).__mro__ if not issubclass(cls, FSDPModule))


def _without_fsdp_hooks(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` with FSDP's hooks taken out of every hook dict (each keyed by its handle's id)."""
    hook_dicts = {key: value for key, value in state.items() if "hooks" in key and isinstance(value, dict)}
    dropped = {handle for hooks in hook_dicts.values() for handle, hook in hooks.items() if _from_fsdp(hook)}
    if not dropped:
        return state
    kept = {key: type(hooks)((handle, hook) for handle, hook in hooks.items() if handle not in dropped)
            for key, hooks in hook_dicts.items()}
    return {**state, **kept}


def _from_fsdp(hook: Any) -> bool:
    function = getattr(hook, "__func__", None) or getattr(hook, "func", None) or hook
    return isinstance(getattr(function, "__module__", None), str) and function.__module__.startswith(_FSDP_HOMES)

