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
     a list or dict attribute it filled with one.
  3. A step that fills an lru_cache is not the steady one: every later step finds the entry and
     skips the ops that made it. While the trace runs, each lru_cache reachable from the model's
     classes and their modules is watched (a stand-in takes its place and notes the arguments of
     each call that made an entry); where one made an entry, the step is recorded again, with the
     caches warm, and that second step is the graph. Afterwards each cache is back in its place,
     its fake entries cleared, and, where the trace ran on the device the model is on, filled
     again by the same calls on the real model, outside fake mode: the first real step is then a
     steady one too. A call with a fake tensor among its arguments is not made again (its cache
     is only cleared), and a trace on another device (a CPU standing in for CUDA) fills nothing:
     the model's first step there fills its caches, and a plan that checks its ops (followed op
     by op, or recording windows over the filling call) refuses that first step.
"""

from __future__ import annotations

import functools
import inspect
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._pytree import tree_flatten

from udnn_lab.analysis._fake.memo import flat_tensors

_OWN = ("torch.", "udnn_lab.")  # code whose caches hold no model tensors: not searched
_DEPTH = 3  # closures followed from a class or module attribute to its cache


@dataclass(eq=False)  # called and bound as the function it stands in for, hashed by identity
class _Watched:
    """Stands in for an lru_cache while the trace runs (NOTE [what a traced model keeps] 3)."""

    cache: Any
    put: Callable[[Any], None] | None  # installs a callable where the cache was found; None: cannot be swapped
    made: list[tuple[tuple, dict]] = field(default_factory=list)  # the arguments of the calls that made an entry

    def __call__(self, *args, **kwargs):
        misses = self.cache.cache_info().misses
        result = self.cache(*args, **kwargs)
        if self.cache.cache_info().misses != misses:
            self.made.append((args, kwargs))
        return result

    def __get__(self, instance, owner=None):  # as a class attribute, a method: bound as the cache would be
        return self if instance is None else functools.partial(self, instance)

    def __getattr__(self, name: str):  # cache_info, cache_clear, __wrapped__: the cache's own
        if name == "cache":
            raise AttributeError(name)
        return getattr(self.cache, name)


class KeptModel:
    """The caches of a model being traced, watched (NOTE [what a traced model keeps])."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.attributes = {id(module): (module, _shallow(vars(module))) for module in model.modules()}
        self.watched = _lru_caches(model)
        self.misses = [w.cache.cache_info().misses for w in self.watched]

    def filled(self) -> bool:
        """Whether a cache made an entry since the trace began (the step was not the steady one: 3)."""
        return any(w.cache.cache_info().misses != m for w, m in zip(self.watched, self.misses))

    def release(self, refill: bool) -> None:
        for module, saved in self.attributes.values():
            _put_back(module, saved)
        for watched, misses in zip(self.watched, self.misses):
            if watched.put is not None:
                watched.put(watched.cache)
            if watched.cache.cache_info().misses != misses:
                watched.cache.cache_clear()
                if refill:
                    _refill(watched)


@contextmanager
def model_kept(model: torch.nn.Module, refill: bool) -> Iterator[KeptModel]:
    """While entered, ``model`` may run under fake tensors; afterwards it keeps none of them, and with ``refill``
    its caches hold what the trace put in them, made for real (NOTE [what a traced model keeps])."""
    kept = KeptModel(model)
    for watched in kept.watched:
        if watched.put is not None:
            watched.put(watched)
    try:
        yield kept
    finally:
        kept.release(refill)


def _refill(watched: _Watched) -> None:
    calls = watched.made
    if any(isinstance(leaf, FakeTensor) for args in calls for leaf in tree_flatten(args)[0]):
        return
    with torch.random.fork_rng(devices=[]):
        try:
            for args, kwargs in calls:
                watched.cache(*args, **kwargs)
        except Exception:  # noqa: BLE001 - a cache not filled is filled by the model's first step
            watched.cache.cache_clear()


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
    return any(isinstance(tensor, FakeTensor) for tensor in flat_tensors((value,)))


def _lru_caches(model: torch.nn.Module) -> list[_Watched]:
    """The lru_caches reachable from the classes of ``model``'s modules and the Python modules defining them."""
    found: dict[int, _Watched] = {}
    seen: set[int] = set()
    classes = {klass for module in model.modules() for klass in type(module).__mro__
               if not klass.__module__.startswith(_OWN) and klass is not object}
    sources = {sys.modules.get(klass.__module__) for klass in classes} - {None}
    for owner in [*classes, *sources]:
        for name, value in list(vars(owner).items()):
            _search(value, functools.partial(setattr, owner, name), _DEPTH, seen, found)
    return list(found.values())


def _search(value: Any, put: Callable[[Any], None] | None, depth: int, seen: set[int],
            found: dict[int, _Watched]) -> None:
    if depth < 0 or id(value) in seen:
        return
    seen.add(id(value))
    if isinstance(value, functools._lru_cache_wrapper):
        if not (getattr(value, "__module__", None) or "").startswith(_OWN):
            found[id(value)] = _Watched(value, put)
        return
    if isinstance(value, (staticmethod, classmethod)):
        kind = type(value)
        _search(value.__func__, None if put is None else lambda new: put(kind(new)), depth, seen, found)
    elif isinstance(value, property):
        _search(value.fget, None, depth, seen, found)
    elif inspect.isfunction(value) and not (value.__module__ or "").startswith(_OWN):
        for cell in value.__closure__ or ():
            if _filled(cell):
                _search(cell.cell_contents, functools.partial(setattr, cell, "cell_contents"), depth - 1, seen,
                        found)
        wrapped = getattr(value, "__wrapped__", None)
        if wrapped is not None:
            _search(wrapped, None, depth - 1, seen, found)


def _filled(cell: Any) -> bool:
    try:
        cell.cell_contents  # noqa: B018 (an empty cell raises)
    except ValueError:
        return False
    return True
