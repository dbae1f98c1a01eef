"""CUDA's fused attention kernels in a CUDA step traced with CPU kernels standing in.

NOTE [stand-in attention]: with dropout (GPT-2, BERT) or a mask, the CPU picks sdpa's math path, which
saves the batch × heads × seq × seq probabilities and the dropout mask for backward. CUDA picks a fused
kernel that saves only the output and one float per query row (the log-sum-exp) and regenerates the
dropout mask from a seed. A CUDA step traced with CPU kernels therefore calls the kernel CUDA would
pick, on fake tensors, by CUDA's order: FlashAttention for float16/bfloat16 without a mask and with a
head size up to 256 (as on sm80 and later), memory-efficient attention otherwise. Where the CPU picks a
fused kernel itself, or key/value heads are shared (enable_gqa), the CPU's choice stands: its saved
tensors are those of CUDA's to within the log-sum-exp's padding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

MATH = 0  # torch._fused_sdp_choice's number for the math path (SDPBackend.MATH)
FLASH_HEAD_LIMIT = 256
HALF_TYPES = (torch.float16, torch.bfloat16)
STAND_IN_ATTENTION_NOTE = ("sdpa: where the CPU would take the math path, CUDA's fused kernel was traced "
                           "(FlashAttention for half types without a mask, memory-efficient attention otherwise)")


class CudaAttentionKernels:
    """While entered, F.scaled_dot_product_attention on this trace's fake tensors runs the fused kernel CUDA would
    run (NOTE [stand-in attention]); any other call runs as it would.

    A module attribute is replaced, not a TorchFunctionMode pushed: torch.utils.checkpoint rebuilds its
    segment in backward where function modes are not in force, and would then save other tensors than
    its forward did.
    """

    def __init__(self, fake_mode: FakeTensorMode) -> None:
        self.fake_mode = fake_mode
        self.substituted = 0
        self._original = F.scaled_dot_product_attention

    def __enter__(self) -> CudaAttentionKernels:
        original = self._original

        def scaled_dot_product_attention(query, key, value, *args, **kwargs):
            if isinstance(query, FakeTensor) and query.fake_mode is self.fake_mode:
                fused = _fused(query, key, value, *args, **kwargs)
                if fused is not None:
                    self.substituted += 1
                    return fused
            return original(query, key, value, *args, **kwargs)

        F.scaled_dot_product_attention = scaled_dot_product_attention
        return self

    def __exit__(self, *exc) -> None:
        F.scaled_dot_product_attention = self._original


def _fused(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """CUDA's fused kernel's output, or None where the CPU's own choice stands."""
    if enable_gqa and key.shape[-3] != query.shape[-3]:
        return None
    query, key, value, attn_mask = _autocast(query, key, value, attn_mask)
    if torch._fused_sdp_choice(query, key, value, attn_mask, dropout_p, is_causal, scale=scale) != MATH:
        return None
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
    if attn_mask is None and query.dtype in HALF_TYPES and query.shape[-1] <= FLASH_HEAD_LIMIT:
        return torch.ops.aten._scaled_dot_product_flash_attention(
            query, key, value, dropout_p, is_causal, False, scale=scale)[0]
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        attn_mask = torch.zeros_like(attn_mask, dtype=query.dtype).masked_fill(~attn_mask, float("-inf"))
    return torch.ops.aten._scaled_dot_product_efficient_attention(
        query, key, value, attn_mask, needs_grad, dropout_p, is_causal, scale=scale)[0]


def _autocast(*tensors: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
    """The casts autocast makes of sdpa's inputs (it lists sdpa, not the fused kernels called in its place)."""
    if not torch.is_autocast_enabled("cpu"):
        return tensors
    dtype = torch.get_autocast_dtype("cpu")
    return tuple(t.to(dtype) if t is not None and t.is_floating_point() else t for t in tensors)
