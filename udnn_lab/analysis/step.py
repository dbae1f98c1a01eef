"""One training step, the same for tracing, measuring and training.

forward (model, then loss) -> backward -> optimizer step. ``mark(phase, scope)`` is
called at each boundary so a recorder can label the ops that follow.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import contextmanager
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_map

from udnn_lab.vocabulary import LOSS_SCOPE, OPTIMIZER_SCOPE

Mark = Callable[[str, "str | None"], None]


def split_input(example_input: Any) -> tuple[tuple, dict]:
    """A tensor is one positional argument, a tuple/list are the positional arguments, a dict the keywords."""
    if isinstance(example_input, dict):
        return (), dict(example_input)
    if isinstance(example_input, (tuple, list)):
        return tuple(example_input), {}
    return (example_input,), {}


def input_tensors(args: tuple, kwargs: dict) -> list[torch.Tensor]:
    leaves, _ = tree_flatten((args, kwargs))
    return [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]


def map_tensors(fn: Callable[[torch.Tensor], torch.Tensor], value: Any) -> Any:
    return tree_map(lambda x: fn(x) if isinstance(x, torch.Tensor) else x, value)


def default_loss(output: Any) -> torch.Tensor:
    """Sum of every floating output that requires grad (aux heads included)."""
    leaves, _ = tree_flatten(output)
    parts = [t.sum() for t in leaves if isinstance(t, torch.Tensor) and t.requires_grad and t.is_floating_point()]
    if not parts:
        raise ValueError(
            "the model's output has no tensor that requires grad, so there is nothing to train: "
            "are all parameters frozen, or is the model run under torch.no_grad()?"
        )
    loss = parts[0]
    for part in parts[1:]:
        loss = loss + part
    return loss


def compute_loss(output: Any, loss_fn: Callable | None, target: Any) -> torch.Tensor:
    if loss_fn is None:
        loss = default_loss(output)
    elif target is None:
        loss = loss_fn(output)
    else:
        loss = loss_fn(output, target)
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise ValueError(f"loss_fn must return a scalar tensor, got {shape}")
    return loss


def _no_mark(phase: str, scope: str | None) -> None:
    return None


def view_replay():
    """NOTE [view replay]
      1. When an op writes in place into a view, autograd rebuilds the view's history: by
         replaying the view op for tensors that dispatch in Python (fake tensors: an extra
         ``aten.view`` in forward, a ViewBackward in backward), by ``as_strided`` otherwise.
      2. So every real step udnn_lab runs or watches (``run_step``: measure, profile; the
         runtime's steps) turns view replay on, and runs the very ops the trace saw. The
         gradients are the same either way; only the op sequence, and AsStridedBackward's
         full-size zeros, differ.
    The context manager is torch's own (private) switch; it is thread-local and restored on exit.
    """
    return torch.autograd._force_original_view_tracking(True)


def run_step(model: torch.nn.Module, args: tuple, kwargs: dict, *, loss_fn: Callable | None = None,
             target: Any = None, optimizer: torch.optim.Optimizer | None = None,
             mark: Mark = _no_mark) -> tuple[Any, torch.Tensor]:
    """Run forward, loss, backward and (if given) the optimizer step; return output and loss.

    Gradients start empty: ``zero_grad(set_to_none=True)`` runs before ``mark`` is first
    called, as in a training loop where the previous step's gradients are dropped.
    """
    if optimizer is not None:
        optimizer.zero_grad(set_to_none=True)
    model.zero_grad(set_to_none=True)
    with view_replay():  # NOTE [view replay] 2
        mark("forward", None)
        output = model(*args, **kwargs)
        mark("forward", LOSS_SCOPE)
        loss = compute_loss(output, loss_fn, target)
        mark("backward", LOSS_SCOPE)
        loss.backward()
    if optimizer is not None:
        mark("optimizer", OPTIMIZER_SCOPE)
        optimizer.step()
    mark("end", None)
    return output, loss


def ensure_optimizer_state(optimizer: torch.optim.Optimizer | None,
                           make_grad: Callable[[torch.Tensor], torch.Tensor] = torch.zeros_like,
                           prefer_foreach: bool = True) -> None:
    """Create the optimizer's state as a first step would, so the traced step is a steady one.

    Steps once with gradients from ``make_grad`` (zeros); parameters may change (weight
    decay), so call it on fakes or inside :func:`preserved`. With ``prefer_foreach``,
    groups that allow it step with ``foreach=True``: the same state in far fewer ops.
    """
    if optimizer is None or len(optimizer.state) > 0:
        return
    params = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
    foreach = [group.get("foreach", False) for group in optimizer.param_groups]
    with torch.no_grad():
        for p in params:
            p.grad = make_grad(p)
        try:
            for group in optimizer.param_groups:
                if prefer_foreach and group.get("foreach", False) is None and not group.get("fused"):
                    group["foreach"] = True
            optimizer.step()
        finally:
            for group, setting in zip(optimizer.param_groups, foreach):
                if "foreach" in group:
                    group["foreach"] = setting
            for p in params:
                p.grad = None


@contextmanager
def preserved(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None):
    """Restore parameters, buffers, gradients and optimizer state after the block, even on error.

    Copies go to host memory so a GPU run is not charged for them.
    """
    with torch.no_grad():
        state = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict(keep_vars=True).items()}
        grads = {id(p): (p.grad.detach().to("cpu", copy=True) if p.grad is not None else None)
                 for p in model.parameters()}
    optimizer_state = _host_copy(optimizer.state_dict()) if optimizer is not None else None
    try:
        yield
    finally:
        with torch.no_grad():
            live = model.state_dict(keep_vars=True)
            for key, saved in state.items():
                live[key].copy_(saved)
            for p in model.parameters():
                saved_grad = grads.get(id(p))
                p.grad = None if saved_grad is None else saved_grad.to(p.device)
        if optimizer is not None:
            assert optimizer_state is not None  # copied above, with the optimizer
            optimizer.load_state_dict(optimizer_state)


def _host_copy(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {k: _host_copy(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_host_copy(v) for v in value]
    return value
