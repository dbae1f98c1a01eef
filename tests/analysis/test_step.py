"""One training step: a StepLoss runs the model itself, and gives the step a loss_fn would."""

import torch

import udnn_lab as ul
from udnn_lab.analysis.step import run_step, split_input
from udnn_lab.workload import StepLoss, StepOptions


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))


def _grads(model, example, loss_fn, target=None, accumulation=2):
    args, kwargs = split_input(example)
    run_step(model, args, kwargs, loss_fn=loss_fn, target=target, options=StepOptions(grad_accumulation=accumulation))
    return [p.grad.clone() for p in model.parameters()]


def test_a_step_loss_gives_the_gradients_of_the_model_and_its_loss_fn():
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    cross_entropy = torch.nn.functional.cross_entropy
    direct = _grads(_model(), x, cross_entropy, target=y)
    stepped = _grads(_model(), ((x, y),), StepLoss(lambda m, batch: cross_entropy(m(batch[0]), batch[1])))
    assert all(torch.equal(a, b) for a, b in zip(direct, stepped))


def test_a_step_loss_that_scales_for_accumulation_is_not_divided_again():
    x = torch.randn(8, 16)
    divided = _grads(_model(), (x,), StepLoss(lambda m, batch: m(batch).square().mean()))
    own = _grads(_model(), (x,), StepLoss(lambda m, batch: m(batch).square().mean() / 2, scales_for_accumulation=True))
    assert all(torch.allclose(a, b) for a, b in zip(divided, own))
    doubled = _grads(_model(), (x,), StepLoss(lambda m, batch: m(batch).square().mean(), scales_for_accumulation=True))
    assert all(torch.allclose(2 * a, b) for a, b in zip(divided, doubled))


def test_a_step_loss_traces_as_the_model_and_its_loss():
    x = torch.randn(8, 16)
    model = _model()
    direct = ul.trace(model, x, loss_fn=lambda out: out.square().mean())
    stepped = ul.trace(ul.Workload(model, (x,), loss_fn=StepLoss(lambda m, batch: m(batch).square().mean(),
                                                                    name="squares")))
    assert [op.name for op in stepped.ops] == [op.name for op in direct.ops]
    # the step keeps only its loss through backward; the model's output (8 x 4 floats) goes when the step returns
    assert direct.peak_bytes - stepped.peak_bytes == 8 * 4 * 4
