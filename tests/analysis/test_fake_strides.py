"""The fake trace lays out outputs as the real kernels do, so its op sequence is the real step's."""

import copy

import pytest
import torch
from torch import nn

import udnn_lab as ul
from udnn_lab.analysis.step import run_step
from udnn_lab.runtime import OffloadRuntime


class PermutedLayerNorm(nn.Module):
    """Linear blocks on a channels-last image, then a layer norm of a permuted view, as Swin's and MaxViT's are."""

    def __init__(self, channels: int = 16) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*[nn.Sequential(nn.Linear(channels, channels), nn.GELU()) for _ in range(4)])
        self.norm = nn.LayerNorm(channels)
        self.head = nn.Linear(channels, 3)

    def forward(self, x):  # x: batch, height, width, channels
        x = self.blocks(x).permute(0, 3, 1, 2)
        x = self.norm(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)
        return self.head(x.mean((2, 3)))


def _op_names(graph):
    return [op.name for op in graph.ops]


def _step(model, x, optimizer_state, runtime=None):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    optimizer.load_state_dict(optimizer_state)
    with runtime if runtime is not None else torch.enable_grad():
        _, loss = run_step(model, (x,), {}, optimizer=optimizer)
    return loss.detach(), [p.grad for p in model.parameters()], [p.detach() for p in model.parameters()]


def test_layer_norm_of_a_permuted_tensor_traces_the_real_op_sequence():
    torch.manual_seed(0)
    model, x = PermutedLayerNorm(), torch.randn(2, 5, 6, 16)
    real = _op_names(ul.trace(model, x, fake=False))
    assert _op_names(ul.trace(model, x)) == real
    assert _op_names(ul.trace(model, x, fast_paths=False)) == real  # the rule holds without the fast paths too


def test_a_recompute_plan_runs_the_permuted_layer_norm_exactly():
    torch.manual_seed(0)
    model, x = PermutedLayerNorm(), torch.randn(2, 5, 6, 16)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    graph = ul.trace(model, x, optimizer=optimizer)
    chosen = ul.plan(graph, ul.min_budget(graph, "recompute"), "recompute")
    assert chosen.recomputes
    state = optimizer.state_dict()
    loss, grads, params = _step(copy.deepcopy(model), x, state)
    loss_b, grads_b, params_b = _step(copy.deepcopy(model), x, state, OffloadRuntime(chosen))
    assert torch.equal(loss, loss_b)
    assert all(torch.equal(a, b) for a, b in zip(grads, grads_b))
    assert all(torch.equal(a, b) for a, b in zip(params, params_b))


def test_swin_traces_the_real_op_sequence():
    torchvision = pytest.importorskip("torchvision")
    torch.manual_seed(0)  # a batch of 2: with one image the strides of its size-1 dimension do not matter
    model, x = torchvision.models.swin_t(weights=None, num_classes=10), torch.randn(2, 3, 64, 64)
    assert _op_names(ul.trace(model, x)) == _op_names(ul.trace(model, x, fake=False))


class EmptyTokens(nn.Module):
    """A class token and a set of register tokens that may be empty, put before the patches, as DINOv3's are."""

    def __init__(self, registers: int, width: int = 16) -> None:
        super().__init__()
        self.cls_token = nn.Parameter(torch.randn(1, 1, width))
        self.register_tokens = nn.Parameter(torch.randn(1, registers, width))
        self.proj = nn.Linear(width, width)

    def forward(self, x):  # x: batch, tokens, width
        batch = x.shape[0]
        tokens = torch.cat([self.cls_token.expand(batch, -1, -1), self.register_tokens.expand(batch, -1, -1), x], 1)
        return self.proj(tokens).amax(1).sum()


@pytest.mark.parametrize("registers", [0, 4])
def test_a_gradient_summed_over_an_empty_slice_traces_the_real_op_sequence(registers):
    """The meta kernel gives an empty sum a kept dimension of stride 0, the real one contiguous strides; autograd
    copied the gradient in the trace alone, to give it its parameter's strides."""
    torch.manual_seed(0)
    model, x = EmptyTokens(registers), torch.randn(2, 5, 16)
    real = _op_names(ul.trace(model, x, fake=False))
    assert _op_names(ul.trace(model, x)) == real
    assert _op_names(ul.trace(model, x, fast_paths=False)) == real
