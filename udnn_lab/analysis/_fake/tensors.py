"""Fake twins of a model's parameters, buffers, inputs and optimizer, for tracing.

Fake tensors are made directly over meta storage (no fake op per tensor), and a fresh
optimizer's state is created by one step on meta tensors, whose kernels are C++ and
need no fake-mode bookkeeping; only the resulting state is turned into fakes. That is
what keeps a 1,000-layer trace within seconds. The state is made at the traced step's
first optimizer step, for the parameters that have a gradient then (NOTE [optimizer
state of a traced step], step.py).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from functools import partial
from itertools import chain
from typing import Any

import torch
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensor,
    FakeTensorMode,
    UnsupportedOperatorException,
)
from torch.utils._python_dispatch import TorchDispatchMode

from udnn_lab.analysis._fake.unsharded import unsharded_copy
from udnn_lab.analysis._sharded import fsdp_modules
from udnn_lab.analysis.step import map_tensors, same_optimizer, step_on_made_grads

# Ops whose results depend on tensor values: a fake trace cannot go past them.
FAKE_LIMITS = (DataDependentOutputException, DynamicOutputShapeException, UnsupportedOperatorException)
HOST_READ = torch.ops.aten._local_scalar_dense.default  # Tensor.item()


def zero_of(dtype: torch.dtype) -> bool | int | float:
    """What a fake step reads where an optimizer step reads a value (NOTE [host reads in the optimizer step])."""
    if dtype == torch.bool:
        return False
    return 0.0 if dtype.is_floating_point or dtype.is_complex else 0


class _ZeroHostReads(TorchDispatchMode):
    """Tensor.item() of a tensor without data (meta, fake) reads zero: enough to create an optimizer's state."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is HOST_READ and (args[0].is_meta or isinstance(args[0], FakeTensor)):
            return zero_of(args[0].dtype)
        return func(*args, **(kwargs or {}))


def fake_like(tensor: torch.Tensor, fake_mode: FakeTensorMode, device: torch.device) -> FakeTensor:
    """A fake tensor with ``tensor``'s shape, strides, dtype and requires_grad, on ``device``.

    Call outside the fake mode: the meta storage under it must be a plain meta tensor.
    """
    meta = torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype, device="meta")
    fake = FakeTensor(fake_mode, meta, device)
    if tensor.requires_grad and tensor.is_floating_point():
        fake.requires_grad_(True)
    return fake


def fake_inputs(value: Any, fake_mode: FakeTensorMode, device: torch.device) -> Any:
    return map_tensors(lambda t: fake_like(t, fake_mode, device), value)


def fake_state(model: torch.nn.Module, fake_mode: FakeTensorMode, device: torch.device) -> dict[str, torch.Tensor]:
    """Fake parameters and buffers by name; tied tensors stay tied.

    They are plain leaf tensors, not ``nn.Parameter``: the module holds them only for
    the trace.
    """
    made: dict[int, torch.Tensor] = {}
    state = {}
    named = chain(model.named_parameters(remove_duplicate=False), model.named_buffers(remove_duplicate=False))
    for name, tensor in named:
        if id(tensor) not in made:
            made[id(tensor)] = fake_like(tensor, fake_mode, device)
        state[name] = made[id(tensor)]
    return state


def fake_replica(model: torch.nn.Module, fake_mode: FakeTensorMode, device: torch.device) -> torch.nn.Module:
    """A deep copy of ``model`` whose parameters (``nn.Parameter`` still, tied ones still tied) and buffers are
    fake tensors on ``device``: a copy to wrap for several ranks, the user's model untouched. Call outside fake
    mode; costs no memory for the weights, whatever device they are on (meta included)."""
    return _replica(model, lambda t: fake_like(t, fake_mode, device))


def meta_replica(model: torch.nn.Module) -> torch.nn.Module:
    """A deep copy of ``model`` with its parameters (tied ones still tied) and buffers on the meta device."""
    return _replica(model, lambda t: torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta"))


def _replica(model: torch.nn.Module, make: Callable[[torch.Tensor], torch.Tensor]) -> torch.nn.Module:
    made: dict[int, Any] = {}
    for p in model.parameters():
        made[id(p)] = torch.nn.Parameter(make(p), requires_grad=p.requires_grad)
    for b in model.buffers():
        made[id(b)] = make(b)
    if fsdp_modules(model):  # sharded already, in a trainer's job (NOTE [unsharded copies])
        return unsharded_copy(model, made)
    return copy.deepcopy(model, made)


def fake_optimizer(optimizer: torch.optim.Optimizer | None, model: torch.nn.Module, fakes: dict[str, torch.Tensor],
                   fake_mode: FakeTensorMode, device: torch.device, counted_as: str):
    """The same optimizer class and hyperparameters over the fake parameters, with the optimizer's state (if it has
    any) as fakes. A fresh one gets its state from :func:`fake_initial_state` as it first steps.

    For a CUDA step (fake CUDA tensors, or CPU kernels standing in for CUDA ones), a group
    that leaves ``foreach`` to PyTorch gets ``foreach=True``, which is what PyTorch picks for
    real CUDA tensors.
    """
    if optimizer is None:
        return None
    names = {id(p): name for name, p in model.named_parameters(remove_duplicate=False)}
    twin: dict[int, torch.Tensor] = {}
    groups = []
    for group in optimizer.param_groups:
        params = []
        for p in group["params"]:
            fake = fakes[names[id(p)]] if id(p) in names else fake_like(p, fake_mode, device)
            twin[id(p)] = fake
            params.append(fake)
        settings = {k: v for k, v in group.items() if k != "params"}
        # FakeTensor is not among the types PyTorch's default picks foreach for, so a fake CUDA
        # group would step one parameter at a time where the real one steps with foreach.
        if counted_as == "cuda" and settings.get("foreach", False) is None and not settings.get("fused") \
                and not settings.get("differentiable"):
            settings["foreach"] = True
        groups.append({**settings, "params": params})
    clone = same_optimizer(optimizer, groups)
    for p, state in optimizer.state.items():
        clone.state[twin[id(p)]] = _fake_values(state, p.device, fake_mode, device)
    return clone


def _fake_values(state: dict, param_device: torch.device, fake_mode: FakeTensorMode, device: torch.device) -> dict:
    """Tensors on the parameter's device (or meta) become fakes on ``device``; others (host-side
    step counters, which the optimizer reads with .item()) stay real, as copies."""
    out: dict[str, Any] = {}
    for key, value in state.items():
        if _host_counter(key, value):
            out[key] = value.detach().clone()  # a CPU parameter's step counter: a fake would read as 0 in .item()
        elif isinstance(value, torch.Tensor) and value.device in (param_device, torch.device("meta")):
            out[key] = fake_like(value, fake_mode, device)
        elif isinstance(value, torch.Tensor):
            out[key] = value.detach().clone()
        else:
            out[key] = value
    return out


def _host_counter(key: str, value: Any) -> bool:
    """The step count PyTorch's optimizers keep as a CPU scalar (read with .item()) unless capturable or fused."""
    return key == "step" and isinstance(value, torch.Tensor) and value.dim() == 0 and value.device.type == "cpu"


def fake_initial_state(fake_mode: FakeTensorMode,
                       device: torch.device) -> Callable[[torch.optim.Optimizer, list[torch.Tensor]], None]:
    """What makes a fresh fake optimizer's state for the parameters given: the ``create`` of ``state_at_first_step``
    (NOTE [optimizer state of a traced step])."""
    return partial(_initial_state, fake_mode=fake_mode, device=device)


def _initial_state(clone: torch.optim.Optimizer, params: list[torch.Tensor], fake_mode: FakeTensorMode,
                   device: torch.device) -> None:
    """Give ``params`` of a fresh optimizer the state its first step creates, by stepping a meta twin; call it
    with no dispatch mode in force."""
    chosen = {id(p) for p in params}
    metas, groups, stepped = {}, [], []
    for group in clone.param_groups:
        group_metas = []
        for p in group["params"]:
            meta = torch.empty_strided(p.shape, p.stride(), dtype=p.dtype, device="meta",
                                       requires_grad=p.requires_grad)
            metas[id(meta)] = p
            group_metas.append(meta)
            if id(p) in chosen:
                stepped.append(meta)
        groups.append({**{k: v for k, v in group.items() if k not in ("params", "foreach")}, "params": group_metas})
    try:
        twin = same_optimizer(clone, groups)
        with _ZeroHostReads():
            step_on_made_grads(twin, stepped, prefer_foreach=False)
    except (RuntimeError, NotImplementedError):  # an op without a meta kernel: step the fakes instead
        with fake_mode, _ZeroHostReads():
            step_on_made_grads(clone, params, torch.empty_like)
        return
    for meta, state in twin.state.items():
        clone.state[metas[id(meta)]] = _fake_values(state, meta.device, fake_mode, device)
