"""A memo of fake op results by argument metadata, cheaper than fake mode's own dispatch.

NOTE [fake op memo]
  Under fake tensors an op's outputs are a pure function of the op and its arguments'
  metadata (shape, strides, dtype, device, offset) and plain values. Deep networks
  repeat the same op on the same shapes hundreds of times (ResNet-1001 has 333
  identical blocks), and each fake dispatch costs 150-500 us, most of it building
  and hashing a general cache key. This memo keys on exactly that metadata and, on a
  hit, makes fresh outputs directly over meta storage, as fake mode itself would.
  It only takes ops whose schema declares no aliasing return, all of whose tensor
  arguments are fake tensors of one mode, and whose outputs, checked on the first call,
  are fresh storages of the minimal size at offset 0; anything else is dispatched
  normally every time.
  A few shape rules answer before the memo is asked, for ops whose outputs are shaped
  like their inputs whatever the shapes (elementwise ops on equal contiguous inputs,
  batch norm and its backward): a network with many distinct shapes (DenseNet's growing
  concatenations) would otherwise miss the memo at every layer.
"""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

_UNMEMOIZABLE = object()
_OPAQUE = object()  # an argument the key cannot hold


class FakeOpMemo:
    def __init__(self, mode: FakeTensorMode) -> None:
        self._mode = mode
        self._entries: dict = {}
        self._eligible: dict = {}  # op -> whether its schema allows memoizing

    def call(self, func, args: tuple, kwargs: dict):
        eligible = self._eligible.get(func)
        if eligible is None:
            eligible = self._eligible[func] = _schema_allows(func)
        if not eligible:
            return func(*args, **kwargs)
        ruled = _shape_rule(func, args, kwargs)
        if ruled is not None:
            return _build(ruled, self._mode)
        key = _key(func, args, kwargs, self._mode)
        if key is None:
            return func(*args, **kwargs)
        entry = self._entries.get(key)
        if entry is None:
            out = func(*args, **kwargs)
            self._entries[key] = _describe(out, args)
            return out
        if entry is _UNMEMOIZABLE:
            return func(*args, **kwargs)
        return _build(entry, self._mode)


def _schema_allows(func) -> bool:
    returns = func._schema.returns
    return bool(returns) and all(r.alias_info is None for r in returns) and \
        all(str(r.type) in ("Tensor", "Tensor?") for r in returns)


def _key(func, args: tuple, kwargs: dict, mode: FakeTensorMode):
    parts = [func]
    for value in args:
        part = _part(value, mode)
        if part is _OPAQUE:
            return None
        parts.append(part)
    for name, value in kwargs.items():
        part = _part(value, mode)
        if part is _OPAQUE:
            return None
        parts.append((name, part))
    return tuple(parts)


def _part(value, mode: FakeTensorMode):
    if isinstance(value, FakeTensor):
        if value.fake_mode is not mode:
            return _OPAQUE
        return tuple(value.shape), value.stride(), value.dtype, value.fake_device, value.storage_offset()
    if isinstance(value, torch.Tensor):
        return _OPAQUE
    if isinstance(value, (list, tuple)):
        parts = tuple(_part(item, mode) for item in value)
        return _OPAQUE if _OPAQUE in parts else ("seq", parts)
    if value is None or isinstance(value, (bool, int, float, str, torch.dtype, torch.device, torch.layout,
                                           torch.memory_format)):
        return value
    return _OPAQUE


def _describe(out, args: tuple):
    outputs = [out] if isinstance(out, torch.Tensor) else list(out) if isinstance(out, (tuple, list)) else None
    if outputs is None:
        return _UNMEMOIZABLE
    taken = {id(a.untyped_storage()) for a in flat_tensors(args)}
    described: list[tuple | None] = []
    for tensor in outputs:
        if tensor is None:
            described.append(None)
            continue
        if not isinstance(tensor, FakeTensor) or tensor.storage_offset() != 0:
            return _UNMEMOIZABLE
        storage = tensor.untyped_storage()
        if id(storage) in taken or storage.nbytes() != _minimal_nbytes(tensor):
            return _UNMEMOIZABLE
        taken.add(id(storage))
        described.append((tuple(tensor.shape), tensor.stride(), tensor.dtype, tensor.fake_device))
    return (isinstance(out, torch.Tensor), tuple(described))


def flat_tensors(values):
    """Tensors in nested lists, tuples and dicts."""
    for value in values:
        if isinstance(value, torch.Tensor):
            yield value
        elif isinstance(value, (list, tuple)):
            yield from flat_tensors(value)
        elif isinstance(value, dict):
            yield from flat_tensors(value.values())


_aten = torch.ops.aten
_ELEMENTWISE = {_aten.add.Tensor, _aten.sub.Tensor, _aten.mul.Tensor, _aten.div.Tensor,
                _aten.threshold_backward.default, _aten.relu.default, _aten.sigmoid.default, _aten.tanh.default,
                _aten.gelu.default, _aten.gelu_backward.default, _aten.sigmoid_backward.default,
                _aten.tanh_backward.default}


def _shape_rule(func, args: tuple, kwargs: dict):
    """A memo entry for outputs shaped like the inputs, or None when no rule applies."""
    if func in _ELEMENTWISE:
        return _elementwise(args, kwargs)
    if func is _aten.native_batch_norm.default:
        return _batch_norm(*args)
    if func is _aten.native_batch_norm_backward.default:
        return _batch_norm_backward(args)
    return None


def _plain(t) -> bool:
    return bool(isinstance(t, FakeTensor) and t.dtype == torch.float32 and t.is_contiguous()
                and t.storage_offset() == 0)


def _like(t: FakeTensor):
    return tuple(t.shape), t.stride(), t.dtype, t.fake_device


def _elementwise(args: tuple, kwargs: dict):
    """Same-shaped inputs each laid out in row-major order (contiguous, or a slice of such) give a
    contiguous output: TensorIterator keeps the dimension order they all agree on."""
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    if kwargs or not tensors:
        return None
    first = tensors[0]
    if not isinstance(first, FakeTensor):  # a real tensor (a plain module attribute, say) has no fake device
        return None
    same = (first.shape, torch.float32, first.fake_device)
    if not all(isinstance(t, FakeTensor) and (t.shape, t.dtype, t.fake_device) == same and _row_major(t)
               for t in tensors):
        return None
    return True, ((tuple(first.shape), _contiguous_strides(first.shape), first.dtype, first.fake_device),)


def _row_major(t: torch.Tensor) -> bool:
    """Strides that decrease with the dimension and never overlap: a contiguous tensor or a slice of one."""
    expected = 1
    for size, stride in reversed(list(zip(t.shape, t.stride()))):
        if size == 1:
            continue
        if stride < expected:
            return False
        expected = stride * size
    return True


def _contiguous_strides(shape) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def _batch_norm(data, weight, bias, running_mean, running_var, training, momentum, eps):
    if not (_plain(data) and data.dim() >= 2 and training and weight is not None):
        return None
    channels = ((data.shape[1],), (1,), torch.float32, data.fake_device)
    return False, (_like(data), channels, channels)


def _batch_norm_backward(args: tuple):
    """native_batch_norm_backward(grad, input, weight, running_mean, running_var, save_mean, save_invstd, train,
    eps, output_mask): what of its ten arguments the outputs' shapes depend on."""
    grad, data, weight, train, mask = args[0], args[1], args[2], args[7], args[9]
    if not (_plain(grad) and _plain(data) and _like(grad) == _like(data) and isinstance(weight, FakeTensor)
            and train):
        return None
    shapes = (_like(data), _like(weight), _like(weight))
    return False, tuple(shape if wanted else None for shape, wanted in zip(shapes, mask))

def _minimal_nbytes(tensor: torch.Tensor) -> int:
    if tensor.numel() == 0:
        return 0
    span = 1 + sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride()))
    return span * tensor.element_size()


def _build(entry, mode: FakeTensorMode):
    single, described = entry
    outputs: list[FakeTensor | None] = []
    with torch._C._DisableTorchDispatch():  # plain meta storage, not another fake op
        for item in described:
            if item is None:
                outputs.append(None)
                continue
            shape, stride, dtype, device = item
            meta = torch.empty_strided(shape, stride, dtype=dtype, device="meta")
            outputs.append(FakeTensor(mode, meta, device))
    return outputs[0] if single else tuple(outputs)
