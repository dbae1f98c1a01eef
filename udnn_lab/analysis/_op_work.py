"""What one aten op computes and moves: FLOPs (torch.utils.flop_counter's formulas) and bytes.

Bytes are those of the tensors as the op sees them (views, not whole storages). A view op
moves nothing; an in-place op reads and writes its first argument.
"""

from __future__ import annotations

import torch
from torch.utils.flop_counter import flop_registry

from udnn_lab.analysis._fake.memo import flat_tensors


class OpWork:
    """Per-op FLOPs and bytes, with the per-op-kind look-ups cached."""

    def __init__(self) -> None:
        self._kinds: dict = {}  # op -> (flop formula over shapes or None, is_view)
        self._flops: dict = {}  # (op, argument shapes and values) -> FLOPs

    def measure(self, func, args: tuple, kwargs: dict, out) -> tuple[int, int, int]:
        """(flops, bytes_read, bytes_written) of one call."""
        kind = self._kinds.get(func)
        if kind is None:
            kind = self._kinds[func] = (_shape_formula(func), _is_view(func))
        formula, is_view = kind
        if is_view:
            return 0, 0, 0
        read = sum(_nbytes(t) for t in flat_tensors((*args, *kwargs.values())))
        written = sum(_nbytes(t) for t in flat_tensors((out,)))
        return (self._count(func, formula, args, kwargs, out) if formula is not None else 0), read, written

    def _count(self, func, formula, args: tuple, kwargs: dict, out) -> int:
        shapes, kw_shapes, out_shape = _shapes(args), {k: _shapes(v) for k, v in kwargs.items()}, _shapes(out)
        try:
            key = (func, shapes, tuple(kw_shapes.items()), out_shape)
            hash(key)
        except TypeError:
            key = None
        if key is not None and key in self._flops:
            return self._flops[key]
        try:
            flops = int(formula(*shapes, out_shape=out_shape, **kw_shapes))
        except Exception:  # a formula that does not take this overload's arguments: count no FLOPs
            flops = 0
        if key is not None:
            self._flops[key] = flops
        return flops


def _shape_formula(func):
    """flop_counter's formula for ``func``, taking shapes (its registry wraps it to take tensors)."""
    formula = flop_registry.get(func.overloadpacket)
    return getattr(formula, "__wrapped__", None) if formula is not None else None


def _shapes(value):
    """Tensors replaced by their shapes, as flop_counter's formulas expect."""
    if isinstance(value, torch.Tensor):
        return value.shape
    if isinstance(value, (list, tuple)):
        return type(value)(_shapes(v) for v in value) if not hasattr(value, "_fields") else tuple(map(_shapes, value))
    return value


def _is_view(func) -> bool:
    returns = func._schema.returns
    return bool(returns) and all(r.alias_info is not None and not r.alias_info.is_write for r in returns)


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()
