"""A traced step gives optimizer state to the parameters the real optimizer keeps state for: those with a gradient."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import udnn_lab as ul
from udnn_lab import zoo
from udnn_lab.zoo import OPTIMIZERS


class UnusedBranch(nn.Module):
    """A trunk the loss reaches and a branch it does not."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10))
        self.unused = nn.Linear(32, 256)

    def forward(self, x):
        return self.trunk(x)


def _state_bytes(graph):
    return {t.name: t.nbytes for t in graph.tensors if t.category == "optimizer_state"}


@pytest.mark.parametrize("optimizer", [o for o in OPTIMIZERS if o != "none"])
def test_parameters_without_a_gradient_get_no_state(optimizer):
    torch.manual_seed(0)
    work = zoo.get(UnusedBranch(), batch=4, input_shape=(32,), optimizer=optimizer)
    fake, real = ul.trace(work), ul.trace(work, fake=False)
    assert not any(name.startswith("unused.") for name in _state_bytes(fake))
    assert _state_bytes(fake) == _state_bytes(real)
    summary = ul.measure(work).summary(fake)
    assert summary["predicted_peak_bytes"] == summary["measured_peak_bytes"] == real.peak_bytes
    assert len(work.optimizer.state) == 0  # the user's optimizer is left as it was


def test_state_the_optimizer_has_is_kept():
    torch.manual_seed(0)
    work = zoo.get(UnusedBranch(), batch=4, input_shape=(32,), optimizer="sgd")
    for p in work.model.parameters():  # state for every parameter, as a checkpoint from other steps may hold
        p.grad = torch.zeros_like(p)
    work.optimizer.step()
    work.model.zero_grad(set_to_none=True)
    assert any(name.startswith("unused.") for name in _state_bytes(ul.trace(work)))
    assert any(name.startswith("unused.") for name in _state_bytes(ul.trace(work, fake=False)))


def _main_logits_loss(output, target):
    return F.cross_entropy(output.logits, target)  # the aux heads run, but the loss does not use them


def test_googlenet_trained_on_its_main_head_alone_peaks_as_measured():
    torchvision = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    model = torchvision.models.googlenet(weights=None, num_classes=10, aux_logits=True, init_weights=True)
    x, target = torch.randn(2, 3, 64, 64), torch.randint(0, 10, (2,))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    graph = ul.trace(model, x, _main_logits_loss, optimizer, target=target)
    summary = ul.measure(model, x, _main_logits_loss, optimizer, target=target).summary(graph)
    assert summary["predicted_peak_bytes"] == summary["measured_peak_bytes"]


@pytest.mark.parametrize("optimizer", [name for name in OPTIMIZERS if name != "none"])
def test_a_step_traced_again_after_training_is_the_same_graph(optimizer):
    work = zoo.get("mlp3", batch=4, optimizer=optimizer)
    before = ul.trace(work)  # a fresh optimizer: its state is made as it first steps
    ul.train(work.model, [(work.example_input, work.target)], work.optimizer, loss_fn=work.loss_fn, progress=False)
    assert len(work.optimizer.state) > 0
    after = ul.trace(work)  # the state exists before the step now
    assert after.fingerprint == before.fingerprint and after.peak_bytes == before.peak_bytes
    assert [t.category for t in after.tensors] == [t.category for t in before.tensors]
    ul.simulate(after, ul.plan(before, None, "vdnn-all", hardware="h100-sxm"), hardware="h100-sxm")  # not refused


class _SlicedBias(torch.nn.Module):
    """A query and a value bias around a fixed key bias, concatenated into one (EVA's attention): their gradients
    are slices of one storage, named after the first."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.qkv = torch.nn.Linear(width, 3 * width, bias=False)
        self.q_bias, self.v_bias = torch.nn.Parameter(torch.randn(width)), torch.nn.Parameter(torch.randn(width))
        self.register_buffer("k_bias", torch.zeros(width), persistent=False)
        self.unused = torch.nn.Parameter(torch.randn(width))

    def forward(self, x):
        return torch.nn.functional.linear(x, self.qkv.weight, torch.cat((self.q_bias, self.k_bias, self.v_bias)))


def test_the_graph_names_every_parameter_that_gets_a_gradient_even_one_sharing_another_s_storage():
    model = _SlicedBias()
    graph = ul.trace(model, torch.randn(4, 8), optimizer=torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    assert graph.graded_parameters == {"qkv.weight", "q_bias", "v_bias"}
    assert graph.graded_parameters == ul.trace(model, torch.randn(4, 8), fake=False).graded_parameters
