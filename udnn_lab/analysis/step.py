"""One training step, the same for tracing, measuring and training.

Per micro-batch: forward (model, then loss; under autocast for a mixed precision) -> backward;
then gradients unscaled (16-mixed) and clipped, and the optimizer step. ``mark(phase, scope)``
is called at each boundary so a recorder can label the ops that follow.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Collection, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from itertools import chain
from typing import Any

import torch
from torch.utils._foreach_utils import _device_has_foreach_support
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils._pytree import tree_flatten, tree_map

from udnn_lab.vocabulary import CLIP_SCOPE, GRAD_SCALER_SCOPE, LOSS_SCOPE, OPTIMIZER_SCOPE
from udnn_lab.workload import DEFAULT_STEP, StepLoss, StepOptions

Mark = Callable[[str, "str | None"], None]
MicroBatch = tuple[tuple, dict, Any]  # positional inputs, keyword inputs, target


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


def _itself(loss: Any) -> Any:
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
      3. A training loop runs its step without it, and following a plan turns it on (the
         runtime's steps): so what it costs is the runtime's. The plain steps a profile times
         for the step's own time (``Profile.step_time_s``), and the step its probes time a
         plan's host work against, run without it.
      4. Autograd consults view replay only where the step writes in place, while it records, into a
         storage a view shares (a view itself, or a tensor something viewed): the trace says whether
         the step does (``Graph.rebuilds_views``; analysis/_view_writes.py). A step that never does
         runs the same ops either way, and every view op costs host time under replay (about 2% of a
         small GPT-2's step on one CPU thread), so the runtime turns it on only for a plan whose step
         does (``Plan.replays_views``). Not seen: a write into a tensor whose view was made before
         the step began, which the step then reads.
    The context manager is torch's own (private) switch; it is thread-local and restored on exit.
    """
    return torch.autograd._force_original_view_tracking(True)


def step_device_type(model: torch.nn.Module, args: tuple, kwargs: dict) -> str:
    """The device type the step's tensors are on ('cpu', 'cuda'): autocast's and the GradScaler's."""
    first = next(chain(model.parameters(), model.buffers(), input_tensors(args, kwargs)), None)
    return first.device.type if first is not None else "cpu"


def grad_scaler(options: StepOptions, device: torch.device) -> torch.amp.GradScaler | None:
    """16-mixed's GradScaler for a step on ``device`` (None for the other precisions).

    Make one per training run and pass it to every step: its scale carries over from step to step.
    Its scale and growth tracker (which its first ``scale()`` would make, inside the first step's
    forward) are made here, so every step, the first too, runs the ops of a steady one.
    """
    if not options.scales_loss:
        return None
    scaler = torch.amp.GradScaler(device.type)
    scaler.scale(torch.zeros((), device=device))
    return scaler


def scaler_state(scaler: torch.amp.GradScaler | None) -> dict[str, torch.Tensor]:
    """The GradScaler's tensors by name: the state that lives from step to step."""
    # GradScaler keeps them in private attributes; its public API reads them only as Python numbers
    found = {"grad_scaler.scale": getattr(scaler, "_scale", None),
             "grad_scaler.growth_tracker": getattr(scaler, "_growth_tracker", None)}
    return {name: value for name, value in found.items() if isinstance(value, torch.Tensor)}


def autocast(options: StepOptions, device_type: str) -> AbstractContextManager:
    """torch.autocast in the precision's dtype for a mixed precision; nothing otherwise."""
    return torch.autocast(device_type, dtype=options.compute_dtype) if options.mixed else nullcontext()


def forward_loss(model: torch.nn.Module, args: tuple, kwargs: dict, *, loss_fn: Callable | None, target: Any,
                 options: StepOptions, scaler: torch.amp.GradScaler | None,
                 mark: Mark = _no_mark) -> tuple[Any, torch.Tensor, torch.Tensor]:
    """One micro-batch's forward and loss; return the output, the loss and the tensor backward starts from.

    Model and loss run under autocast for a mixed precision (left before backward, as PyTorch's AMP recipe
    says); backward starts from the loss divided by the number of micro-batches, and scaled by 16-mixed's
    GradScaler.
    """
    with autocast(options, step_device_type(model, args, kwargs)):
        mark("forward", None)
        if isinstance(loss_fn, StepLoss):
            output = loss_fn.step(model, *args, **kwargs)
            loss = compute_loss(output, _itself, None)
        else:
            output = model(*args, **kwargs)
            mark("forward", LOSS_SCOPE)
            loss = compute_loss(output, loss_fn, target)
    divides = options.grad_accumulation > 1 and not (isinstance(loss_fn, StepLoss) and loss_fn.scales_for_accumulation)
    start = loss / options.grad_accumulation if divides else loss
    if scaler is not None:
        start = scaler.scale(start)
    return output, loss, start


def run_step(model: torch.nn.Module, args: tuple, kwargs: dict, *, loss_fn: Callable | None = None,
             target: Any = None, optimizer: torch.optim.Optimizer | None = None,
             options: StepOptions = DEFAULT_STEP, scaler: torch.amp.GradScaler | None = None,
             micro_batches: Sequence[MicroBatch] = (), mark: Mark = _no_mark,
             replay_views: bool = True) -> tuple[Any, torch.Tensor]:
    """Run forward, loss and backward of each micro-batch, then (if given) the optimizer step.

    Return the output and loss (as ``loss_fn`` gives it) of the last micro-batch.

    ``options``: precision, micro-batches per step, gradient clipping. ``scaler``: the GradScaler
    16-mixed needs (``grad_scaler``), kept by the caller across steps. ``micro_batches``: the
    (args, kwargs, target) of micro-batches 2 to N; by default the first one again.
    Gradients start empty: ``zero_grad(set_to_none=True)`` runs before ``mark`` is first
    called, as in a training loop where the previous step's gradients are dropped.
    ``replay_views=False``: the step as a training loop runs it, without view replay (NOTE [view replay] 3), to
    time what the user's own step costs.
    """
    later = _later_micro_batches(options, (args, kwargs, target), micro_batches)
    if options.scales_loss and scaler is None:
        raise ValueError("precision='16-mixed' scales the loss with a GradScaler: pass "
                         "scaler=grad_scaler(options, device), one per training run")
    if scaler is not None and options.clip_grad_norm is not None and optimizer is None:
        raise ValueError("clipping under precision='16-mixed' needs the optimizer: the GradScaler unscales the "
                         "optimizer's gradients before they are clipped")
    if optimizer is not None:
        optimizer.zero_grad(set_to_none=True)
    model.zero_grad(set_to_none=True)
    output = loss = None
    with view_replay() if replay_views else nullcontext():  # NOTE [view replay] 2
        every = [(args, kwargs, target), *later]
        for number, (micro_args, micro_kwargs, micro_target) in enumerate(every, 1):
            output = loss = None  # a training loop lets the previous micro-batch's output and loss go
            with _gradients_kept_on_the_rank(model, last=number == len(every)):
                output, loss, start = forward_loss(model, micro_args, micro_kwargs, loss_fn=loss_fn,
                                                   target=micro_target, options=options, scaler=scaler, mark=mark)
                mark("backward", LOSS_SCOPE)
                start.backward()
                del start
    if optimizer is not None:
        _optimizer_step(optimizer, options, scaler, mark)
    elif options.clip_grad_norm is not None:
        mark("optimizer", CLIP_SCOPE)
        _clip(list(model.parameters()), options.clip_grad_norm)
    mark("end", None)
    assert loss is not None  # at least one micro-batch ran
    return output, loss


def _gradients_kept_on_the_rank(model: torch.nn.Module, last: bool) -> AbstractContextManager:
    """DDP all-reduces a step's gradients once, in its last micro-batch's backward: the earlier ones run under
    ``no_sync``, as Lightning, accelerate and PyTorch's own advice for gradient accumulation have it."""
    if last or not isinstance(model, torch.nn.parallel.DistributedDataParallel):
        return nullcontext()
    return model.no_sync()


def _later_micro_batches(options: StepOptions, first: MicroBatch, given: Sequence[MicroBatch]) -> list[MicroBatch]:
    if not given:
        return [first] * (options.grad_accumulation - 1)
    if len(given) != options.grad_accumulation - 1:
        raise ValueError(f"grad_accumulation={options.grad_accumulation} runs {options.grad_accumulation} "
                         f"micro-batches a step: give {options.grad_accumulation - 1} after the first, not "
                         f"{len(given)}")
    return list(given)


def _optimizer_step(optimizer: torch.optim.Optimizer, options: StepOptions, scaler: torch.amp.GradScaler | None,
                    mark: Mark) -> None:
    """Unscale (16-mixed), clip, step, update the scale: PyTorch's AMP recipe, as Lightning runs it."""
    # a fused optimizer unscales inside its own kernel, unless the gradients must be unscaled to be clipped
    unscales_itself = getattr(optimizer, "_step_supports_amp_scaling", False)
    if scaler is not None and (options.clip_grad_norm is not None or not unscales_itself):
        mark("optimizer", GRAD_SCALER_SCOPE)
        scaler.unscale_(optimizer)
    if options.clip_grad_norm is not None:
        mark("optimizer", CLIP_SCOPE)
        _clip([p for group in optimizer.param_groups for p in group["params"]], options.clip_grad_norm)
    mark("optimizer", OPTIMIZER_SCOPE)
    if scaler is None:
        optimizer.step()
        return
    scaler.step(optimizer)  # reads the inf check on the host (NOTE [host reads in the optimizer step])
    mark("optimizer", GRAD_SCALER_SCOPE)
    scaler.update()


def _clip(params: list[torch.Tensor], max_norm: float) -> None:
    """clip_grad_norm_ with the kernels the real step picks: foreach=None chooses foreach only for plain
    tensors, so a traced step (fake tensors) would otherwise norm the gradients one by one."""
    with_grads = [p for p in params if p.grad is not None]
    if not with_grads:
        return
    foreach = _device_has_foreach_support(with_grads[0].device)
    torch.nn.utils.clip_grad_norm_(with_grads, max_norm, foreach=foreach)


def same_optimizer(optimizer: torch.optim.Optimizer, groups: list[dict]) -> torch.optim.Optimizer:
    """The optimizer's class over ``groups``, made with the defaults its constructor takes: some settings also
    set up the optimizer itself (``fused=True`` tells a GradScaler that the step unscales), and some defaults
    are not constructor arguments (AdamW's ``decoupled_weight_decay``)."""
    kind: Callable[..., torch.optim.Optimizer] = type(optimizer)  # a subclass, with its own constructor
    accepted = inspect.signature(kind).parameters
    any_keyword = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in accepted.values())
    defaults = {k: v for k, v in optimizer.defaults.items() if any_keyword or k in accepted}
    try:
        return kind(groups, **defaults)
    except TypeError:
        return kind(groups)


def ensure_optimizer_state(optimizer: torch.optim.Optimizer | None,
                           make_grad: Callable[[torch.Tensor], torch.Tensor] = torch.zeros_like,
                           prefer_foreach: bool = True, graded: Collection[str] | None = None,
                           model: torch.nn.Module | None = None) -> None:
    """Create the optimizer's state as a first step would, so the traced step is a steady one.

    Steps once with gradients from ``make_grad`` (zeros) for every parameter that requires one;
    parameters may change (weight decay), so call it on fakes or inside :func:`preserved`. With
    ``prefer_foreach``, groups that allow it step with ``foreach=True``: the same state in far fewer
    ops. A step whose loss leaves some parameters without a gradient wants :func:`state_at_first_step`
    instead, or ``graded``: the names in ``model`` of the parameters that get one (``Graph.graded_parameters``
    of the step's trace), the only ones given state (NOTE [optimizer state of a traced step]).
    """
    if optimizer is None or len(optimizer.state) > 0:
        return
    params = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
    if graded is not None:
        if model is None:
            raise ValueError("graded names parameters of a model: give ensure_optimizer_state the model too")
        named = {id(p): name for name, p in model.named_parameters()}
        if set(graded) <= set(named.values()):  # else the names are another model's (a wrapper's): state for all
            params = [p for p in params if named.get(id(p)) in graded]
    step_on_made_grads(optimizer, params, make_grad, prefer_foreach)


def step_on_made_grads(optimizer: torch.optim.Optimizer, params: Sequence[torch.Tensor],
                       make_grad: Callable[[torch.Tensor], torch.Tensor] = torch.zeros_like,
                       prefer_foreach: bool = True) -> None:
    """Step ``optimizer`` once with gradients from ``make_grad`` for ``params``, which creates their state; a
    parameter whose gradient is None stays out of the step, as PyTorch's optimizers skip it. The gradients
    ``params`` had are theirs again afterwards."""
    foreach = [group.get("foreach", False) for group in optimizer.param_groups]
    grads = [p.grad for p in params]
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
            for p, grad in zip(params, grads):
                p.grad = grad


# NOTE [optimizer state of a traced step]
#   A traced step is a steady one: the optimizer's state exists before it starts. PyTorch's optimizers
#   create state only for parameters that have a gradient when they step, so a parameter the loss does
#   not reach (GoogLeNet's aux heads, a branch left unused) has none, however many steps ran. Which
#   parameters get a gradient is known only once backward has run, so a fresh optimizer's state is
#   made then: a pre-hook of its first step creates the state of exactly the parameters holding a
#   gradient, with every dispatch mode set aside (a recorder sees none of it). A storage the recorder
#   first meets as an op's input counts as one that existed before the step, so that state is live
#   from the step's start, as state from earlier steps would be.


@contextmanager
def state_at_first_step(optimizer: torch.optim.Optimizer | None,
                        create: Callable[[torch.optim.Optimizer, list[torch.Tensor]], None]):
    """While entered, a fresh ``optimizer``'s first step starts by ``create(optimizer, params)`` for the parameters
    that hold a gradient then (NOTE [optimizer state of a traced step]); an optimizer with state is left as it is."""
    if optimizer is None or len(optimizer.state) > 0:
        yield
        return

    def before_step(stepping: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        handle.remove()
        params = [p for group in stepping.param_groups for p in group["params"] if p.grad is not None]
        with _disable_current_modes():
            create(stepping, params)

    handle = optimizer.register_step_pre_hook(before_step)
    try:
        yield
    finally:
        handle.remove()


def state_made_at_first_step(optimizer: torch.optim.Optimizer | None):
    """While entered, a fresh ``optimizer``'s first real step makes its state first, by a step on zero gradients for
    the parameters holding one then: the step is a steady one, as after a warm-up step, and a parameter the loss
    does not reach gets no state (NOTE [optimizer state of a traced step]). Parameters may change: use it inside
    :func:`preserved`."""
    return state_at_first_step(optimizer, step_on_made_grads)


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
