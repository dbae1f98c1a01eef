"""A CUDA step traced with CPU kernels standing in calls the fused attention kernel CUDA would run
(NOTE [stand-in attention]), not the CPU's math path with its seq × seq probabilities."""

from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import udnn_lab as ul
from udnn_lab import zoo


class Attention(nn.Module):
    def __init__(self, dropout: float, mask: bool) -> None:
        super().__init__()
        self.qkv, self.dropout, self.mask = nn.Linear(32, 96), dropout, mask

    def forward(self, x):
        q, k, v = (t.unflatten(-1, (4, 8)).transpose(1, 2) for t in self.qkv(x).chunk(3, dim=-1))
        mask = torch.ones(x.shape[1], x.shape[1], dtype=torch.bool, device=x.device).tril() if self.mask else None
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=self.dropout)
        return out.transpose(1, 2).flatten(2).sum()


def _attention_ops(graph) -> set[str]:
    return {op.name for op in graph.ops if "attention" in op.name or "softmax" in op.name}


def _trace(model, x, device, **options):
    return ul.trace(model, x, loss_fn=lambda out, _: out, target=torch.zeros(()), device=device, **options)


@pytest.mark.parametrize("dropout, mask, dtype, kernel", [
    (0.1, False, torch.float32, "aten._scaled_dot_product_efficient_attention.default"),
    (0.1, False, torch.bfloat16, "aten._scaled_dot_product_flash_attention.default"),
    (0.1, True, torch.bfloat16, "aten._scaled_dot_product_efficient_attention.default"),
])
def test_the_cuda_step_calls_cuda_s_fused_kernel_and_saves_no_probabilities(dropout, mask, dtype, kernel):
    model, x = Attention(dropout, mask).to(dtype), torch.randn(2, 128, 32, dtype=dtype)
    cpu, cuda = _trace(model, x, "cpu"), _trace(model, x, "cuda")
    assert "aten._safe_softmax.default" in _attention_ops(cpu)  # the CPU's own step keeps its math path
    assert kernel in _attention_ops(cuda) and "aten._safe_softmax.default" not in _attention_ops(cuda)
    assert any(note.startswith("sdpa:") for note in cuda.notes)
    probabilities = 2 * 4 * 128 * 128 * dtype.itemsize
    assert cpu.peak_bytes - cuda.peak_bytes >= probabilities


def test_autocast_casts_the_fused_kernel_s_inputs_as_it_casts_sdpa_s():
    model, x = Attention(0.1, True), torch.randn(2, 64, 32)
    graph = _trace(model, x, "cuda", precision="bf16-mixed")
    fused = next(op for op in graph.ops if op.name == "aten._scaled_dot_product_efficient_attention.default")
    assert {graph.tensors[t].dtype for t in fused.inputs} == {"bfloat16"}


class Checkpointed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = Attention(0.1, False)

    def forward(self, x):
        return torch.utils.checkpoint.checkpoint(self.inner, x, use_reentrant=False)


def test_a_checkpointed_segment_rebuilds_with_the_same_kernel_in_backward():
    graph = _trace(Checkpointed(), torch.randn(2, 64, 32), "cuda")
    fused = [op for op in graph.ops if op.name == "aten._scaled_dot_product_efficient_attention.default"]
    assert [op.phase for op in fused] == ["forward", "backward"]  # the forward, and its rebuild in backward
    assert F.scaled_dot_product_attention is torch._C._nn.scaled_dot_product_attention  # put back afterwards


def test_a_gpt2_step_with_attention_dropout_is_no_longer_overestimated_for_cuda():
    pytest.importorskip("transformers")
    work = zoo.get("hf:gpt2", batch=2, small=True, seq_len=256, device="meta", precision="bf16-mixed")
    cpu, cuda = ul.trace(work, device="cpu"), ul.trace(work, device="cuda")
    assert "aten._scaled_dot_product_flash_attention_backward.default" in _attention_ops(cuda)
    assert cuda.peak_bytes < 0.6 * cpu.peak_bytes


class Dropped(nn.Module):
    def __init__(self, inplace: bool = False) -> None:
        super().__init__()
        self.first, self.dropout, self.last = nn.Linear(32, 64), nn.Dropout(0.1, inplace=inplace), nn.Linear(64, 8)

    def forward(self, x):
        return self.last(self.dropout(self.first(x))).sum()


def test_the_cuda_step_calls_cuda_s_fused_dropout_and_saves_a_one_byte_mask():
    x = torch.randn(256, 32)  # activations above the weights
    cpu, cuda = _trace(Dropped(), x, "cpu"), _trace(Dropped(), x, "cuda")
    assert "aten.bernoulli_.float" in {op.name for op in cpu.ops}  # the CPU's own step keeps its noise tensor
    fused = [op for op in cuda.ops if op.name == "aten.native_dropout.default"]
    assert len(fused) == 1 and "aten.bernoulli_.float" not in {op.name for op in cuda.ops}
    mask = cuda.tensors[fused[0].allocated[1]]
    assert mask.dtype == "bool" and mask.saved and mask.nbytes == 256 * 64
    assert any(note.startswith("dropout:") for note in cuda.notes)
    assert cpu.peak_bytes - cuda.peak_bytes >= 3 * 256 * 64  # a float32 noise tensor saved against a one-byte mask
    assert F.dropout is torch.nn.functional.dropout and F.dropout.__module__ == "torch.nn.functional"  # put back
    in_place = _trace(Dropped(inplace=True), x, "cuda")  # CUDA's in-place dropout is not the fused kernel either
    assert "aten.native_dropout.default" not in {op.name for op in in_place.ops}


@pytest.mark.gpu
def test_the_stand_in_trace_matches_the_trace_made_with_cuda_s_own_kernels():
    pytest.importorskip("transformers")
    failed = []
    for name, precision in (("hf:gpt2", "32-true"), ("hf:gpt2", "bf16-mixed"), ("hf:bert-base", "bf16-mixed"),
                            ("hf:llama-3-8b", "bf16-mixed")):
        work = zoo.get(name, batch=2, small=True, seq_len=256, device="meta", precision=precision)
        on_cuda = ul.trace(work, device="cuda")
        with mock.patch("torch.cuda.is_available", return_value=False):
            stand_in = ul.trace(work, device="cuda")
        if abs(stand_in.peak_bytes - on_cuda.peak_bytes) > 0.01 * on_cuda.peak_bytes:
            failed.append(f"{name} {precision}: peak {stand_in.peak_bytes} against CUDA's {on_cuda.peak_bytes}, "
                          f"attention ops {sorted(_attention_ops(stand_in))} against "
                          f"{sorted(_attention_ops(on_cuda))}; {_differences(stand_in, on_cuda)}")
    assert not failed, "\n\n".join(failed)


def _differences(stand_in, on_cuda, at_most: int = 12) -> str:
    """Where the two traces part: op counts, then the ops whose new storages differ (name, shapes, bytes)."""
    def made(graph, op) -> list[tuple[str, int]]:
        return [(graph.tensors[t].dtype, graph.tensors[t].nbytes) for t in op.allocated]

    found = [f"{len(stand_in.ops)} ops against {len(on_cuda.ops)}; peak at op {stand_in.peak_step} against "
             f"{on_cuda.peak_step}"]
    for a, b in zip(stand_in.ops, on_cuda.ops):
        if a.name != b.name or made(stand_in, a) != made(on_cuda, b):
            found.append(f"op {a.index} {a.name} {list(a.output_shapes)} made {made(stand_in, a)}; CUDA's op "
                         f"{b.index} {b.name} {list(b.output_shapes)} made {made(on_cuda, b)}")
            if len(found) > at_most:
                break
    return "\n".join(found)
