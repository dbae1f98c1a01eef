"""torch's grouped matmul on fake tensors, in every dtype the real kernels take (NOTE [grouped matmul stand-in])."""

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

import udnn_lab as ul
from udnn_lab.analysis._fake.grouped_mm import fake_grouped_mm

OFFS = torch.tensor([3, 5, 8, 10], dtype=torch.int32)  # four groups' ends along 10 rows


def _cases(dtype):
    """(mat_a, mat_b, offs) for each layout; an output width of 5 is not a multiple of 16 bytes, so rows are padded."""
    rows = torch.randn(10, 8, dtype=dtype)
    experts = torch.randn(4, 5, 8, dtype=dtype).transpose(1, 2)  # 4 x 8 x 5, strides that ATen accepts
    return {"2d x 3d": (rows, experts, OFFS),
            "2d x 2d": (torch.randn(6, 16, dtype=dtype), torch.randn(5, 16, dtype=dtype).t(),  # groups along 16
                        torch.tensor([3, 5, 8, 16], dtype=torch.int32)),
            "3d x 3d": (torch.randn(4, 6, 8, dtype=dtype), experts, None)}


def _layout(t):
    return tuple(t.shape), tuple(t.stride()), t.dtype, t.untyped_storage().nbytes()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", ["2d x 3d", "2d x 2d", "3d x 3d"])
def test_the_fake_output_is_laid_out_as_the_real_one(dtype, layout):
    mat_a, mat_b, offs = _cases(dtype)[layout]
    real = torch._grouped_mm(mat_a, mat_b, offs)
    mode = FakeTensorMode()
    fakes = [None if t is None else mode.from_tensor(t) for t in (mat_a, mat_b, offs)]
    with mode:
        fake = fake_grouped_mm(*fakes)
    assert _layout(fake) == _layout(real)


class Experts(nn.Module):
    """Tokens routed to four experts, each a float32 matrix, by torch's grouped matmul (as transformers' MoE)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(8, 8)  # so that backward takes the grouped matmul's gradient for its input too
        self.weight = nn.Parameter(torch.randn(4, 8, 8).transpose(1, 2))
        self.register_buffer("offs", OFFS.clone())

    def forward(self, x):
        # squared: backward's grouped matmuls take the gradient, which must not be the sum's expanded one
        return torch._grouped_mm(self.embed(x), self.weight, self.offs).square()


def test_a_float32_grouped_matmul_traces_as_it_runs():
    torch.manual_seed(0)
    model, x = Experts(), torch.randn(10, 8)
    fake, real = ul.trace(model, x), ul.trace(model, x, fake=False)
    assert [op.name for op in fake.ops] == [op.name for op in real.ops]
    assert [(t.nbytes, t.shape) for t in fake.tensors] == [(t.nbytes, t.shape) for t in real.tensors]
    assert fake.peak_bytes == real.peak_bytes == ul.measure(model, x).summary(fake)["measured_peak_bytes"]
    assert fake.peak_bytes == ul.trace(model, x, fast_paths=False).peak_bytes
