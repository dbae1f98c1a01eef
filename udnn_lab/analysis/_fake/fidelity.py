"""Ops whose fake (meta) kernel disagrees with the real kernel about its outputs.

PyTorch's meta kernel for oneDNN's LSTM layer returns an empty workspace (the real one
holds the gates for backward, often megabytes) and returns one bias gradient twice
(autograd then clones it, an op the real run never does). The CPU's ``mse_loss`` returns
its 0-dim loss as a view into the whole elementwise buffer, which lives as long as the
loss does (the meta kernel gives it 4 bytes). The CPU's batch norm returns a contiguous
output for a strided input (a transposed image), where the meta kernel keeps the input's
strides, so a later reshape copies in the trace and views in the step. Under autocast,
batch norm and layer norm get a bfloat16 or float16 input with float32 weights: the real
kernels (CPU and CUDA) then keep the saved mean and inverse deviation in float32, the meta
kernels in the input's dtype. For such ops (batch norm only when its input is strided or
of another dtype than its weights, layer norm only in the latter case) the trace sizes the outputs by
one real call on zeros, on the CPU, and gives the step fake outputs of exactly those
sizes, strides and storage sizes. Nothing is kept: the real tensors are
released as soon as their sizes are read. Each entry is checked by a test that
compares the traced step with a measured one.

Some disagreements need no probe, as the real kernels' rule is simple and the same on every
device. Layer norm's backward allocates its three gradients contiguous on the CPU and on CUDA
(``empty_like(X.contiguous(), LEGACY_CONTIGUOUS_MEMORY_FORMAT)``), whatever the strides of the
incoming gradient; its decomposition, which fake mode runs, lets the input's gradient follow the
incoming gradient's strides. A layer norm of a permuted tensor (Swin's and MaxViT's channels-last
blocks) then hands backward a strided gradient, and a later reshape copies it in the trace
(clone, _unsafe_view) where it views it in the step: the op sequences differ, and a plan that
recomputes by them fails. Such ops' fake outputs are made contiguous (:func:`contiguous_outputs`).
A reduction with no elements to make (a sum over an empty slice, as DINOv3's gradient of its zero
register tokens is) gets contiguous strides from TensorIterator, where the meta kernel gives a kept
dimension stride 0; autograd then finds the gradient's strides other than its parameter's and copies
it (new_empty_strided, copy_) in the trace alone. Such outputs get the real strides
(:func:`contiguous_when_empty`).
"""

from __future__ import annotations

import torch
from torch._prims_common import make_contiguous_strides_for
from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily
from torch.utils._pytree import tree_map

PROBED_OPS = frozenset({
    "aten.mkldnn_rnn_layer.default",
    "aten.mkldnn_rnn_layer_backward.default",
    "aten.mse_loss.default",
})


PROBED_WHEN_STRIDED = frozenset({
    "aten.native_batch_norm.default",
    "aten._native_batch_norm_legit.default",
})

PROBED_WHEN_MIXED = frozenset({
    "aten.native_batch_norm.default",
    "aten._native_batch_norm_legit.default",
    "aten.native_layer_norm.default",
})


# ops whose real kernels, CPU and CUDA, return every output contiguous where the meta kernel may not
CONTIGUOUS_OUTPUTS = frozenset({
    "aten.native_layer_norm_backward.default",
})


# reductions whose real kernels give an output with no elements contiguous strides (TensorIterator's), where the
# meta kernel gives a kept dimension stride 0
EMPTY_CONTIGUOUS = frozenset({
    "aten.sum.dim_IntList",
    "aten.amax.default",
    "aten.amin.default",
})


def needs_probe(name: str, args: tuple) -> bool:
    """Only CPU fake tensors can be probed on this machine."""
    first = args[0] if args else None
    if name in PROBED_WHEN_MIXED and isinstance(first, FakeTensor) and first.device.type == "cpu" \
            and _mixed(first, args[1:]):
        return True
    if name in PROBED_WHEN_STRIDED:
        strided = isinstance(first, FakeTensor) and not (
            first.is_contiguous() or first.is_contiguous(memory_format=torch.channels_last))
        return strided and first is not None and first.device.type == "cpu"
    if name not in PROBED_OPS:
        return False
    return any(isinstance(a, FakeTensor) and a.device.type == "cpu" for a in args)


def _mixed(first: torch.Tensor, others: tuple) -> bool:
    """A half-precision input with weights of another floating dtype (autocast's float32 weights)."""
    return first.dtype in (torch.bfloat16, torch.float16) and any(
        isinstance(a, torch.Tensor) and a.is_floating_point() and a.dtype != first.dtype for a in others)


def probed_call(func, args: tuple, kwargs: dict):
    """Run ``func`` for real on zeros shaped like ``args`` and return fake outputs shaped like its outputs.

    Call it from a dispatch mode that sits above FakeTensorMode, so that the factory
    calls below create fake tensors.
    """
    with unset_fake_temporarily():
        real_args, real_kwargs = tree_map(_zeros_like_fake, (args, kwargs))
        real_out = func(*real_args, **real_kwargs)
        shapes = tree_map(_metadata, real_out)
        del real_args, real_kwargs, real_out
    return tree_map(_fake_from_metadata, shapes, is_leaf=lambda x: isinstance(x, _Meta))


class _Meta(tuple):
    """(shape, stride, dtype, storage offset, storage elements) of one real output."""


def _zeros_like_fake(value):
    if isinstance(value, FakeTensor):
        return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device="cpu").zero_()
    return value


def _metadata(value):
    if isinstance(value, torch.Tensor):
        elements = value.untyped_storage().nbytes() // value.element_size()
        return _Meta((tuple(value.shape), tuple(value.stride()), value.dtype, value.storage_offset(), elements))
    return value


def _fake_from_metadata(value):
    if isinstance(value, _Meta):
        shape, stride, dtype, offset, elements = value
        return torch.empty(elements, dtype=dtype, device="cpu").as_strided(shape, stride, offset)
    return value


def contiguous_outputs(out):
    """``out`` with each fake tensor that is not contiguous replaced by a contiguous one of the same shape, dtype
    and device, as the real kernel allocates it (see CONTIGUOUS_OUTPUTS).

    Call it from a dispatch mode that sits above FakeTensorMode, so that the factory
    calls below create fake tensors.
    """
    return tree_map(_contiguous, out)


def _contiguous(value):
    if isinstance(value, FakeTensor) and not value.is_contiguous():
        return torch.empty(value.shape, dtype=value.dtype, device=value.device)
    return value


def contiguous_when_empty(out):
    """``out`` with each fake tensor of no elements given contiguous strides, as the real reduction allocates it (see
    EMPTY_CONTIGUOUS); called as :func:`contiguous_outputs` is."""
    return tree_map(_contiguous_empty, out)


def _contiguous_empty(value):
    if isinstance(value, FakeTensor) and value.numel() == 0 and value.stride() != make_contiguous_strides_for(
            value.shape):
        return torch.empty(value.shape, dtype=value.dtype, device=value.device)
    return value
