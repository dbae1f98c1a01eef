"""CUDA's autocast lists in a CUDA step traced with CPU kernels standing in.

NOTE [stand-in autocast]: a mixed-precision CUDA step traced on a CPU runs under the CPU's autocast, whose lists of
ops to cast differ from CUDA's. Both run matrix products and convolutions in the low precision (and cache the cast
weights alike), but CUDA also runs a list of ops in float32 that the CPU leaves in the low precision: pow, exp, log,
rsqrt, softplus, layer and group norm, the losses, ...; gives softmax, log_softmax, sum, cumsum, prod and the norms a
float32 result; and promotes the arguments of addcmul, addcdiv, dot, cross, ... to the widest. Their outputs, and
what autograd saves of them, are then twice the bytes on CUDA: GPT-2's tanh GELU raises a bf16 tensor to the third
power, and on CUDA everything after that pow in the MLP is float32. While the CPU's autocast is on, a stand-in
trace casts these ops' arguments as CUDA's autocast would (torch/csrc/autograd autocast_mode's CUDA lists), at the
torch function level, above autograd, as autocast does. What CPU's autocast casts to float32 and CUDA's does not
(3D pooling, padding, fft) is not undone: no model of the corpus calls them under autocast. What the CPU's promotes
and CUDA's leaves to the op's own type promotion (cat, stack, index_copy: a Llama cache's cat) runs with the CPU's
autocast off, as one op with no cast before it.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

# CUDA's float32 list ("fp32" in autocast_mode.cpp), by the torch function's name
FLOAT32 = frozenset({
    "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p", "reciprocal", "rsqrt", "sinh",
    "tan", "pow", "softplus", "layer_norm", "group_norm", "frobenius_norm", "nuclear_norm", "cosine_similarity",
    "poisson_nll_loss", "cosine_embedding_loss", "nll_loss", "nll_loss2d", "hinge_embedding_loss", "kl_div",
    "l1_loss", "smooth_l1_loss", "huber_loss", "mse_loss", "margin_ranking_loss", "multilabel_margin_loss",
    "soft_margin_loss", "triplet_margin_loss", "multi_margin_loss", "binary_cross_entropy_with_logits", "dist",
    "pdist", "cdist", "renorm", "logsumexp"})
# CUDA's "fp32_set_opt_dtype" list: run with dtype=float32 where no dtype is given
FLOAT32_RESULT = frozenset({"prod", "softmax", "log_softmax", "cumprod", "cumsum", "linalg_vector_norm",
                            "linalg_matrix_norm", "sum"})
# CUDA's "promote" list: every floating argument cast to the widest floating type among them
PROMOTE = frozenset({"addcdiv", "addcmul", "atan2", "bilinear", "cross", "dot", "grid_sampler", "index_put",
                     "scatter_add", "tensordot"})
# the CPU's promote list has these too, CUDA's not: there the op's own type promotion makes the widest, with no cast
# before it (on an H200, a Llama cache's cat of an empty float32 tensor and bfloat16 values is one op, a float32 result)
NATIVE_PROMOTION = frozenset({"stack", "cat", "index_copy"})
# widths for the widest floating type without torch.promote_types, which is an op a trace would record
_WIDTH = {torch.float16: 1, torch.bfloat16: 1, torch.float32: 2, torch.float64: 3}
_DUNDERS = {"__pow__": "pow", "__rpow__": "pow"}
LOW = (torch.float16, torch.bfloat16)
STAND_IN_AUTOCAST_NOTE = ("autocast: CUDA's lists were followed where they differ from the CPU's (float32 for pow, "
                          "exp, norms, losses; a float32 result for softmax, sum, cumsum)")


class CudaAutocastLists:
    """While entered, the torch functions and tensor methods of CUDA's lists cast their arguments as CUDA's autocast
    would, on this trace's fake tensors while the CPU's autocast is on (NOTE [stand-in autocast]); any other call
    runs as it would. ``cast`` counts the calls changed. Attributes are replaced, not a TorchFunctionMode pushed, as
    for attention (NOTE [stand-in attention]): torch.utils.checkpoint's recomputation in backward runs without
    function modes, and would then save other dtypes than its forward did."""

    def __init__(self, fake_mode: FakeTensorMode) -> None:
        self.fake_mode = fake_mode
        self.cast = 0
        self._replaced: list[tuple[object, str, object | None]] = []

    def __enter__(self) -> CudaAutocastLists:
        for owner in (torch, torch.Tensor, F):
            for name in sorted(FLOAT32 | FLOAT32_RESULT | PROMOTE | NATIVE_PROMOTION | set(_DUNDERS)):
                original = getattr(owner, name, None)
                if original is None or not callable(original):
                    continue
                # a tensor method torch.Tensor inherits from its C base is shadowed, and the shadow removed after
                own = name in vars(owner)
                self._replaced.append((owner, name, original if own else None))
                setattr(owner, name, self._casting(original, _DUNDERS.get(name, name)))
        return self

    def __exit__(self, *exc) -> None:
        for owner, name, original in reversed(self._replaced):
            if original is None:
                delattr(owner, name)
            else:
                setattr(owner, name, original)
        self._replaced.clear()

    def _casting(self, original, name: str):
        def call(*args, **kwargs):
            if torch.is_autocast_enabled("cpu") and self._ours(args, kwargs):
                if name in NATIVE_PROMOTION:
                    self.cast += _widest(args, kwargs) is not None
                    with torch.autocast("cpu", enabled=False):
                        return original(*args, **kwargs)
                args, kwargs = self._as_cuda(name, args, kwargs)
            return original(*args, **kwargs)
        return functools.wraps(original)(call)

    def _ours(self, args, kwargs) -> bool:
        return any(isinstance(t, FakeTensor) and t.fake_mode is self.fake_mode for t in _tensors((args, kwargs)))

    def _as_cuda(self, name: str, args, kwargs):
        if name in FLOAT32 and _any_low(args, kwargs):
            self.cast += 1
            return _cast(args, torch.float32), _cast(kwargs, torch.float32)
        if name in FLOAT32_RESULT and kwargs.get("dtype") is None and _first_low(args):
            self.cast += 1
            return args, {**kwargs, "dtype": torch.float32}
        if name in PROMOTE:
            widest = _widest(args, kwargs)
            if widest is not None:
                self.cast += 1
                return _cast(args, widest), _cast(kwargs, widest)
        return args, kwargs


def _tensors(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)


def _any_low(args, kwargs) -> bool:
    return any(t.dtype in LOW for t in _tensors((args, kwargs)))


def _first_low(args) -> bool:
    return bool(args) and isinstance(args[0], torch.Tensor) and args[0].dtype in LOW


def _widest(args, kwargs) -> torch.dtype | None:
    """The widest floating dtype among the arguments where they differ (None: nothing to promote)."""
    floating = {t.dtype for t in _tensors((args, kwargs)) if t.is_floating_point()}
    if len(floating) < 2:
        return None
    if floating == {torch.float16, torch.bfloat16}:
        return torch.float32
    return max(floating, key=lambda dtype: _WIDTH.get(dtype, 2))


def _cast(value, dtype: torch.dtype):
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() and value.dtype != torch.float64 else value
    if isinstance(value, (list, tuple)):
        cast = [_cast(item, dtype) for item in value]
        return type(value)(cast) if isinstance(value, list) or type(value) is tuple else value
    if isinstance(value, dict):
        return {key: _cast(item, dtype) for key, item in value.items()}
    return value
