"""torch's grouped matmul (``aten._grouped_mm``, which transformers' MoE experts call) on fake tensors.

NOTE [grouped matmul stand-in]
  1. The meta kernel of aten._grouped_mm accepts only bfloat16 and float16 inputs, as CUDA's fast grouped GEMM
     does. The kernels a step runs take float32 too (ATen's shared check, _grouped_mm_validate_inputs, allows
     float32, bfloat16 and float16; the CPU kernel, and CUDA's for other than its fast path, loop over the
     groups with mm), so a float32 or bf16-mixed MoE step runs for real but not on fake tensors.
  2. Every real kernel (CPU, CUDA) allocates its output with ATen's create_grouped_gemm_output_tensor: the
     shapes below, and the last dimension's stride padded to a multiple of 16 bytes, so its storage is the
     padded extent. The meta kernel pads only in a CUDA build of torch.
  3. So a fake step makes the output itself, for every dtype, by that rule (:func:`fake_grouped_mm`), after
     ATen's checks of dtypes, dimensions and offsets; its backward calls the same op, and is made the same way.
"""

from __future__ import annotations

import torch

GROUPED_MM = "aten._grouped_mm.default"
GROUPED_MM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
TMA_ALIGNMENT_BYTES = 16  # each output row starts on a 16-byte boundary (NOTE [grouped matmul stand-in] 2)


def fake_grouped_mm(mat_a: torch.Tensor, mat_b: torch.Tensor, offs: torch.Tensor | None = None,
                    bias: torch.Tensor | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """The output the real kernel allocates, without computing it (NOTE [grouped matmul stand-in]).

    Call it from a dispatch mode that sits above FakeTensorMode, so that the factory call below creates a
    fake tensor.
    """
    _check(mat_a, mat_b, offs, bias)
    dtype = out_dtype or mat_a.dtype
    size = _output_size(mat_a, mat_b, offs)
    alignment = TMA_ALIGNMENT_BYTES // dtype.itemsize
    padded = (size[-1] + alignment - 1) // alignment * alignment
    stride = (padded, 1) if len(size) == 2 else (size[1] * padded, padded, 1)
    return torch.empty_strided(size, stride, dtype=dtype, device=mat_a.device)


def _check(mat_a: torch.Tensor, mat_b: torch.Tensor, offs: torch.Tensor | None, bias: torch.Tensor | None) -> None:
    """ATen's checks (_grouped_mm_validate_inputs), with its messages."""
    for name, mat in (("mat_a", mat_a), ("mat_b", mat_b)):
        if mat.dtype not in GROUPED_MM_DTYPES:
            raise RuntimeError(f"Expected {name} to be Float32, BFloat16 or Float16 matrix, got {mat.dtype}")
        if mat.dim() not in (2, 3):
            raise RuntimeError(f"{name} has to be 2 or 3d")
    if (mat_a.dim() == 3 or mat_b.dim() == 3) and mat_a.size(-1) != mat_b.size(-2):
        raise RuntimeError("contraction dimension of mat_a and mat_b must match")
    if (mat_a.dim() == 2 or mat_b.dim() == 2) and (offs is None or offs.dim() != 1 or offs.dtype != torch.int32):
        raise RuntimeError("a 2d multiplicand needs offsets: a 1d int32 tensor of the groups' ends")
    if bias is not None:
        raise RuntimeError("Bias not supported yet")


def _output_size(mat_a: torch.Tensor, mat_b: torch.Tensor, offs: torch.Tensor | None) -> tuple[int, ...]:
    """create_grouped_gemm_output_tensor's shapes: 2d x 2d (groups along the contraction) gives one matrix per
    group, 2d x 3d and 3d x 2d (groups along the rows) one matrix, 3d x 3d a batched product."""
    if mat_a.dim() == 2 and mat_b.dim() == 2:
        assert offs is not None  # _check asks for it
        return offs.size(0), mat_a.size(0), mat_b.size(1)
    if mat_a.dim() == 2:
        _same(offs, mat_b.size(0), "matrix batch sizes have to match")
        return mat_a.size(0), mat_b.size(-1)
    if mat_b.dim() == 2:
        _same(offs, mat_a.size(0), "matrix batch sizes have to match")
        return mat_a.size(1), mat_b.size(1)
    if mat_a.size(0) != mat_b.size(0):
        raise RuntimeError("batched dimension has to match")
    return mat_a.size(0), mat_a.size(1), mat_b.size(-1)


def _same(offs: torch.Tensor | None, groups: int, message: str) -> None:
    if offs is None or offs.size(0) != groups:
        raise RuntimeError(message)
