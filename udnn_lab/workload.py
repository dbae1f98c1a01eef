"""What one training step is made of: a model, an example input, a loss, an optimizer."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch


@dataclass(frozen=True, repr=False)
class Workload:
    """A model with everything needed to run one training step of it."""

    model: torch.nn.Module
    example_input: Any  # a tensor, a tuple of positional tensors, or a dict of keyword tensors
    target: Any = None  # passed to loss_fn(output, target) when not None
    loss_fn: Callable | None = None  # None: the sum of the outputs
    optimizer: torch.optim.Optimizer | None = None
    name: str = ""
    batch_size: int | None = None

    def __repr__(self) -> str:
        """A summary: the model's class, the shapes and dtypes of the input and target, the loss and the optimizer."""
        loss = "sum of outputs" if self.loss_fn is None else \
            getattr(self.loss_fn, "__name__", type(self.loss_fn).__name__)
        optimizer = "none" if self.optimizer is None else type(self.optimizer).__name__
        target = "" if self.target is None else f", target={_summary(self.target)}"
        return (f"Workload({self.name!r}: {type(self.model).__name__}, input={_summary(self.example_input)}{target}, "
                f"loss={loss}, optimizer={optimizer})")


def _summary(value: Any) -> str:
    """Tensors as dtype[shape] (and the device, when not the CPU), inside whatever holds them."""
    if isinstance(value, torch.Tensor):
        dtype = str(value.dtype).removeprefix("torch.")
        device = "" if value.device.type == "cpu" else f" on {value.device}"
        return f"{dtype}[{', '.join(map(str, value.shape))}]{device}"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{key}: {_summary(item)}" for key, item in value.items()) + "}"
    if isinstance(value, (tuple, list)):
        return "(" + ", ".join(_summary(item) for item in value) + ")"
    return type(value).__name__


def as_workload(model: Any, example_input: Any = None, *, loss_fn: Callable | None = None,
                optimizer: torch.optim.Optimizer | None = None, target: Any = None,
                name: str | None = None) -> Workload:
    """Accept a Workload (fields given here override it) or a module with its example input."""
    if isinstance(model, Workload):
        overrides: dict[str, Any] = {
            key: value for key, value in (("example_input", example_input), ("loss_fn", loss_fn),
                                          ("optimizer", optimizer), ("target", target), ("name", name))
            if value is not None}
        return replace(model, **overrides)
    if isinstance(model, str):
        raise TypeError(f"got the name {model!r} where a model is needed: build it first with "
                        f"ul.zoo.get({model!r}, batch=...) and pass that")
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"expected a torch.nn.Module (or a zoo Workload), got {type(model).__name__}")
    if example_input is None:
        raise TypeError("an example input is needed: a tensor, a tuple of tensors or a dict of tensors "
                        "shaped like one training batch")
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    return Workload(model=model, example_input=example_input, target=target, loss_fn=loss_fn,
                    optimizer=optimizer, name=name or type(model).__name__)
