"""A mixed-precision CUDA step traced with CPU kernels standing in follows CUDA's autocast lists where they differ from
the CPU's (NOTE [stand-in autocast])."""

import torch
from torch import nn

import udnn_lab as ul


class TanhGelu(nn.Module):
    """GPT-2's tanh GELU written out, as transformers writes it: a pow of the bf16 matmul's output."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(32, 128), nn.Linear(128, 32)

    def forward(self, x):
        h = self.up(x)
        h = 0.5 * h * (1.0 + torch.tanh(0.79788456 * (h + 0.044715 * torch.pow(h, 3.0))))
        return self.down(h).softmax(-1).sum()


class Checkpointed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = TanhGelu()

    def forward(self, x):
        return torch.utils.checkpoint.checkpoint(self.inner, x, use_reentrant=False)


def _trace(model, device):
    return ul.trace(model, torch.randn(64, 32), loss_fn=lambda out, _: out, target=torch.zeros(()), device=device,
                    precision="bf16-mixed")


def _dtypes_made_by(graph, name):
    return [graph.tensors[t].dtype for op in graph.ops if op.name == name and op.phase == "forward"
            for t in op.allocated]


def test_pow_runs_in_float32_and_softmax_gives_float32_as_cuda_s_autocast_has_them():
    cpu, cuda = _trace(TanhGelu(), "cpu"), _trace(TanhGelu(), "cuda")
    assert _dtypes_made_by(cpu, "aten.pow.Tensor_Scalar") == ["bfloat16"]  # the CPU's autocast leaves pow alone
    assert _dtypes_made_by(cuda, "aten.pow.Tensor_Scalar") == ["float32"]
    assert _dtypes_made_by(cuda, "aten.tanh.default") == ["float32"]  # what follows the pow is float32 on CUDA
    assert _dtypes_made_by(cpu, "aten._softmax.default") == ["bfloat16"]
    assert _dtypes_made_by(cuda, "aten._softmax.default") == ["float32"]
    assert any(note.startswith("autocast:") for note in cuda.notes)
    assert cuda.peak_bytes > cpu.peak_bytes
    assert not any(note.startswith("autocast:") for note in _trace(TanhGelu(), "cpu").notes)


def test_a_checkpointed_segment_recomputes_with_the_same_casts():
    graph = _trace(Checkpointed(), "cuda")
    pows = [op for op in graph.ops if op.name == "aten.pow.Tensor_Scalar"]
    # the forward's, the rebuild's in backward and pow's own backward's: all of them in float32
    assert [op.phase for op in pows] == ["forward", "backward", "backward"]
    assert {graph.tensors[t].dtype for op in pows for t in op.allocated} == {"float32"}


def test_the_functions_are_put_back():
    before = (torch.pow, torch.Tensor.__pow__, torch.Tensor.softmax, torch.nn.functional.layer_norm)
    _trace(TanhGelu(), "cuda")
    assert (torch.pow, torch.Tensor.__pow__, torch.Tensor.softmax, torch.nn.functional.layer_norm) == before
    assert "softmax" not in vars(torch.Tensor)  # the shadow of the C method is gone


def test_a_float32_step_is_left_as_it_is():
    model = TanhGelu()
    graph = ul.trace(model, torch.randn(64, 32), loss_fn=lambda out, _: out, target=torch.zeros(()), device="cuda")
    assert not any(note.startswith("autocast:") for note in graph.notes)
    assert "aten._to_copy.default" not in {op.name for op in graph.ops}


class Cache(nn.Module):
    """A key and value cache as transformers' DynamicCache grows it: the cat of an empty float32 tensor made for the
    keys (float32 after the rotary embedding) and the bf16 values, then addcmul's promotion."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(32, 32)

    def forward(self, x):
        values = self.proj(x)  # bf16 under autocast
        empty = torch.tensor([], dtype=torch.float32)
        cached = torch.cat([empty, values], dim=-1)
        stacked = torch.stack([x, values])
        return (cached.sum() + stacked.sum()) + torch.addcmul(x, values, values).sum()


def test_cat_and_stack_leave_promotion_to_the_op_as_on_cuda_and_promote_types_is_no_op_of_the_step():
    """On an H200, a Llama cache's cat of float32 and bf16 tensors is one op with a float32 result: CUDA's autocast
    casts nothing before it, where the CPU's casts the bf16 one; addcmul's arguments CUDA's promotes."""
    cpu, cuda = _trace(Cache(), "cpu"), _trace(Cache(), "cuda")
    for graph, casts_before_cat in ((cpu, True), (cuda, False)):
        names = [op.name for op in graph.ops if op.phase == "forward"]
        cat = names.index("aten.cat.default")
        assert (names[cat - 1] == "aten._to_copy.default") is casts_before_cat, names[:cat + 1]
        assert _dtypes_made_by(graph, "aten.cat.default") == ["float32"]
        assert _dtypes_made_by(graph, "aten.stack.default") == ["float32"]
        assert "aten.promote_types.default" not in names
    names = [op.name for op in cuda.ops if op.phase == "forward"]
    addcmul = names.index("aten.addcmul.default")
    assert names[addcmul - 1] == "aten._to_copy.default"  # CUDA's autocast promotes addcmul's bf16 arguments
