"""What a model's own Python keeps from a fake step, taken back when the trace ends.

NOTE [what a traced model keeps]
  1. A fake trace runs the user's model itself, its parameters and buffers swapped for fakes,
     so whatever the model's Python keeps from a call keeps a fake tensor: an attribute a
     module sets in forward (a table made on first use), or an entry of a functools.lru_cache
     of a method or function of the model's code (transformers' BEiT, DETR and DINOv3 cache
     position tables so). A real step after the trace would compute with that fake tensor:
     its loss, gradients and updates would all be fake, without an error.
  2. So the trace puts back each module attribute it changed whose value now holds a fake
     tensor (the attribute as it was, or none where it was not there), and the contents of
     a list or dict attribute it filled with one. It clears each lru_cache reachable from
     the model's classes and their modules that made an entry during the trace (its misses
     grew): a cache's entries cannot be taken out one by one, and a cleared cache refills.
"""

from __future__ import annotations

import functools
import inspect
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor

_OWN = ("torch.", "udnn_lab.")  # code whose caches hold no model tensors: not searched
_DEPTH = 3  # closures and wrappers followed from a class or module attribute to its cache


@contextmanager
def model_kept(model: torch.nn.Module) -> Iterator[None]:
    """While entered, ``model`` may run under fake tensors; afterwards it keeps none of them (NOTE [what a traced
    model keeps])."""
    attributes = {id(module): (module, _shallow(vars(module))) for module in model.modules()}
    caches = {id(cache): (cache, cache.cache_info().misses) for cache in _lru_caches(model)}
    try:
        yield
    finally:
        for module, saved in attributes.values():
            _put_back(module, saved)
        for cache, misses in caches.values():
            if cache.cache_info().misses != misses:  # NOTE [what a traced model keeps] 2: it made an entry
                cache.cache_clear()


def _shallow(attributes: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """Each attribute with a copy of its contents where it is a list or a dict (filled in place, it stays itself)."""
    return {name: (value, value.copy() if isinstance(value, (list, dict)) else None)
            for name, value in attributes.items()}


def _put_back(module: torch.nn.Module, saved: dict[str, tuple[Any, Any]]) -> None:
    own = vars(module)
    for name in [name for name in own if name not in saved and _holds_fake(own[name])]:
        del own[name]
    for name, (value, contents) in saved.items():
        now = own.get(name, value)
        if now is not value and _holds_fake(now):
            own[name] = value
        elif contents is not None and _holds_fake(value):
            value.clear()
            value.extend(contents) if isinstance(value, list) else value.update(contents)


def _holds_fake(value: Any) -> bool:
    if isinstance(value, FakeTensor):
        return True
    if isinstance(value, (list, tuple)):
        return any(isinstance(item, FakeTensor) for item in value)
    if isinstance(value, dict):
        return any(isinstance(item, FakeTensor) for item in value.values())
    return False


def _lru_caches(model: torch.nn.Module) -> list[Any]:
    """The lru_caches reachable from the classes of ``model``'s modules and the Python modules defining them."""
    found: dict[int, Any] = {}
    seen: set[int] = set()
    classes = {klass for module in model.modules() for klass in type(module).__mro__
               if not klass.__module__.startswith(_OWN) and klass is not object}
    sources = {sys.modules.get(klass.__module__) for klass in classes} - {None}
    for namespace in [vars(klass) for klass in classes] + [vars(source) for source in sources]:
        for value in list(namespace.values()):
            _search(value, _DEPTH, seen, found)
    return list(found.values())


def _search(value: Any, depth: int, seen: set[int], found: dict[int, Any]) -> None:
    if depth < 0 or id(value) in seen:
        return
    seen.add(id(value))
    if isinstance(value, functools._lru_cache_wrapper):
        if not (getattr(value, "__module__", None) or "").startswith(_OWN):
            found[id(value)] = value
        return
    if isinstance(value, (staticmethod, classmethod)):
        _search(value.__func__, depth, seen, found)
    elif isinstance(value, property):
        _search(value.fget, depth, seen, found)
    elif inspect.isfunction(value) and not (value.__module__ or "").startswith(_OWN):
        inner = [cell.cell_contents for cell in value.__closure__ or () if _filled(cell)]
        for item in [*inner, getattr(value, "__wrapped__", None)]:
            if item is not None:
                _search(item, depth - 1, seen, found)


def _filled(cell: Any) -> bool:
    try:
        cell.cell_contents  # noqa: B018 (an empty cell raises)
    except ValueError:
        return False
    return True
