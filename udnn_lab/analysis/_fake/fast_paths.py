"""How the recorder runs an op on fake tensors: by the shortest path that gives fake mode's answer.

NOTE [fake fast paths]
  Fake-mode dispatch costs 100 us to several ms an op (a general cache key, checks,
  Python meta kernels and decompositions on a miss). Most ops of a training step need
  none of it, so when every tensor argument is a FakeTensor of the step's mode:
  1. prim.device, which autograd asks of every fake input, is the fake device.
  2. A view op (its schema returns an alias it does not write: detach, slice, view, t,
     expand, ...) runs its meta kernel inside fake mode's kernel-invocation context and
     is wrapped as FakeTensor, as fake mode itself does: same storage, device and keys.
  3. An in-place op whose only written argument is its first, and which changes no
     metadata (not an inplace_view op, not resize_/set_), returns that argument and
     allocates nothing (optimizer updates, gradient accumulation).
  4. Other ops go through the memo of memo.py (NOTE [fake op memo]).
  tests/analysis/test_fake_fast_paths.py traces the zoo with and without these paths and requires
  identical graphs. Two rules hold with or without them: an op all of whose tensor
  arguments are real runs for real, outside fake mode (host-side scalars such as Adam's
  step counters stay real and can be read with .item()), and ops whose meta kernels
  disagree with the real ones are sized by a real call, or, where the real kernels' rule is
  known (layer norm's backward returns contiguous gradients), follow that rule (fidelity.py).
  The grouped matmul, whose meta kernel refuses float32, is made by the real kernels' rule
  (NOTE [grouped matmul stand-in], grouped_mm.py).
"""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import (
    FakeTensor,
    FakeTensorMode,
    in_kernel_invocation_manager,
    unset_fake_temporarily,
)

from udnn_lab.analysis._fake import fidelity
from udnn_lab.analysis._fake.grouped_mm import GROUPED_MM, fake_grouped_mm
from udnn_lab.analysis._fake.memo import FakeOpMemo, flat_tensors

_PRIM_DEVICE = torch.ops.prim.device.default
_METADATA_MUTATORS = ("aten::resize_", "aten::resize_as_", "aten::set_", "aten::_resize_output_")
_DEVICE, _VIEW, _INPLACE, _INPLACE_LIST, _PROBE, _MEMO = "device", "view", "inplace", "inplace_list", "probe", "memo"
_CONTIGUOUS = "contiguous"  # run as a memoized op, its outputs then laid out as the real kernel lays them out
_CONTIGUOUS_EMPTY = "contiguous when empty"  # the same, for outputs with no elements only
_STAND_IN = "stand_in"  # on fake tensors, made by udnn_lab's own rule (NOTE [grouped matmul stand-in])


class FakeFastPaths:
    """Runs ops of one fake step (NOTE [fake fast paths])."""

    def __init__(self, mode: FakeTensorMode, enabled: bool = True) -> None:
        self.mode = mode
        self.enabled = enabled
        self._memo = FakeOpMemo(mode)
        self._kinds: dict = {}

    def run(self, func, args: tuple, kwargs: dict):
        kind = self._kinds.get(func)
        if kind is None:
            kind = self._kinds[func] = _kind(func)
        if kind is _PROBE:
            if fidelity.needs_probe(str(func), args):
                return fidelity.probed_call(func, args, kwargs)
            kind = _MEMO
        if kind is _CONTIGUOUS:
            return fidelity.contiguous_outputs(self._dispatch(func, args, kwargs, _MEMO))
        if kind is _CONTIGUOUS_EMPTY:
            return fidelity.contiguous_when_empty(self._dispatch(func, args, kwargs, _MEMO))
        if kind is _STAND_IN and any(isinstance(t, FakeTensor) for t in flat_tensors((args, kwargs))):
            return fake_grouped_mm(*args, **kwargs)
        return self._dispatch(func, args, kwargs, kind)

    def _dispatch(self, func, args: tuple, kwargs: dict, kind: str):
        tensors = list(flat_tensors((args, kwargs)))
        if tensors and not any(isinstance(t, FakeTensor) for t in tensors):
            with unset_fake_temporarily():  # real tensors stay real
                return func(*args, **kwargs)
        if not self.enabled:
            return func(*args, **kwargs)
        if not tensors or not all(isinstance(t, FakeTensor) and t.fake_mode is self.mode for t in tensors):
            return self._memo.call(func, args, kwargs) if kind is _MEMO else func(*args, **kwargs)
        if kind is _DEVICE:
            return tensors[0].fake_device
        if kind is _VIEW:
            return self._view(func, args, kwargs, tensors[0].fake_device)
        if kind is _INPLACE:
            return args[0]
        if kind is _INPLACE_LIST:
            return None
        return self._memo.call(func, args, kwargs) if kind is _MEMO else func(*args, **kwargs)

    def _view(self, func, args: tuple, kwargs: dict, device: torch.device):
        with in_kernel_invocation_manager(self.mode):
            out = func(*args, **kwargs)
        if isinstance(out, torch.Tensor):
            return FakeTensor(self.mode, out, device)
        return type(out)(FakeTensor(self.mode, t, device) if isinstance(t, torch.Tensor) else t for t in out)


def _kind(func) -> str:
    if func is _PRIM_DEVICE:
        return _DEVICE
    if str(func) in fidelity.PROBED_OPS | fidelity.PROBED_WHEN_STRIDED | fidelity.PROBED_WHEN_MIXED:
        return _PROBE  # probed when needs_probe says so, else run as a memoized op
    if str(func) in fidelity.CONTIGUOUS_OUTPUTS:
        return _CONTIGUOUS
    if str(func) in fidelity.EMPTY_CONTIGUOUS:
        return _CONTIGUOUS_EMPTY
    if str(func) == GROUPED_MM:
        return _STAND_IN
    schema = func._schema
    returns, arguments = schema.returns, schema.arguments
    if returns and all(r.alias_info is not None and not r.alias_info.is_write for r in returns) \
            and torch.Tag.inplace_view not in func.tags and all(str(r.type) in ("Tensor", "Tensor[]") for r in returns):
        return _VIEW
    return _inplace_kind(func, arguments, returns) or _MEMO


def _inplace_kind(func, arguments, returns) -> str | None:
    if not arguments or func._schema.name in _METADATA_MUTATORS or torch.Tag.inplace_view in func.tags:
        return None
    first = arguments[0].alias_info
    if first is None or not first.is_write:
        return None
    if any(a.alias_info is not None and a.alias_info.is_write for a in arguments[1:]):
        return None
    if not returns and str(arguments[0].type) == "List[Tensor]":
        return _INPLACE_LIST
    if len(returns) == 1 and returns[0].alias_info is not None and returns[0].alias_info.is_write \
            and str(arguments[0].type) == "Tensor":
        return _INPLACE
    return None
