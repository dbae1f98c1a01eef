"""CUDA's fused dropout kernel in a CUDA step traced with CPU kernels standing in.

NOTE [stand-in dropout]: in training, CUDA's dropout is one fused kernel (aten.native_dropout) that saves a mask of
one byte per element for backward. The CPU has no fused kernel: it multiplies by a noise tensor of the input's
dtype and saves that, four bytes per element in float32. A CUDA step traced with CPU kernels therefore calls
native_dropout where CUDA would (at::dropout's is_fused_kernel_acceptable: 0 < p < 1, a tensor with elements, and
not in place). On GPT-2 small the CPU's masks put the peak 491,520 B (2.5%) above the trace made with CUDA's own
kernels: five dropouts of 2 x 256 x 64 elements, three bytes more each.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

STAND_IN_DROPOUT_NOTE = "dropout: CUDA's fused kernel was traced, which saves a one-byte mask (native_dropout)"


class CudaDropoutKernel:
    """While entered, F.dropout on this trace's fake tensors in training runs native_dropout, as CUDA would (NOTE
    [stand-in dropout]); any other call runs as it would. A module attribute is replaced, as for attention (NOTE
    [stand-in attention]): torch.utils.checkpoint's recomputation in backward runs without function modes."""

    def __init__(self, fake_mode: FakeTensorMode) -> None:
        self.fake_mode = fake_mode
        self.substituted = 0
        self._original = F.dropout

    def __enter__(self) -> CudaDropoutKernel:
        original = self._original

        def dropout(input, p: float = 0.5, training: bool = True, inplace: bool = False):
            if training and not inplace and 0 < p < 1 and isinstance(input, FakeTensor) \
                    and input.fake_mode is self.fake_mode and input.numel() > 0:
                self.substituted += 1
                return torch.ops.aten.native_dropout(input, p, True)[0]
            return original(input, p, training, inplace)

        F.dropout = dropout
        return self

    def __exit__(self, *exc) -> None:
        F.dropout = self._original
