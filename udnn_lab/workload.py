"""What one training step is made of: a model, an example input, a loss, an optimizer, and how the step runs."""

from __future__ import annotations

import inspect
import sys
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from typing import TYPE_CHECKING, Any

import torch

from udnn_lab.vocabulary import PRECISIONS, Precision

if TYPE_CHECKING:
    from udnn_lab.parallel import Parallel

# the dtype the step computes in: the weights' for '-true' precisions, autocast's for '-mixed' ones
COMPUTE_DTYPES: dict[Precision, torch.dtype] = {
    "64-true": torch.float64, "32-true": torch.float32, "16-true": torch.float16, "bf16-true": torch.bfloat16,
    "16-mixed": torch.float16, "bf16-mixed": torch.bfloat16}
_TRUE_PRECISION = {dtype: name for name, dtype in COMPUTE_DTYPES.items() if name.endswith("-true")}


@dataclass(frozen=True)
class StepOptions:
    """How a training step runs besides its model and data: precision, gradient accumulation, clipping."""

    precision: Precision = "32-true"
    grad_accumulation: int = 1  # micro-batches whose gradients add up before the one optimizer step
    clip_grad_norm: float | None = None  # max total norm of the gradients (clip_grad_norm_); None: no clipping

    def __post_init__(self) -> None:
        if self.precision not in PRECISIONS:
            raise ValueError(f"unknown precision {self.precision!r}: use one of {', '.join(PRECISIONS)} "
                             "(PyTorch Lightning's names)")
        if isinstance(self.grad_accumulation, bool) or not isinstance(self.grad_accumulation, int) \
                or self.grad_accumulation < 1:
            raise ValueError(f"grad_accumulation counts micro-batches per optimizer step: a positive int, got "
                             f"{self.grad_accumulation!r}")
        if self.clip_grad_norm is not None and (isinstance(self.clip_grad_norm, bool)
                                                or not isinstance(self.clip_grad_norm, (int, float))
                                                or not self.clip_grad_norm > 0):
            raise ValueError(f"clip_grad_norm is the largest total gradient norm allowed: a positive number (or "
                             f"None for no clipping), got {self.clip_grad_norm!r}")

    @property
    def mixed(self) -> bool:
        """Forward and loss run under torch.autocast over float32 weights."""
        return self.precision.endswith("-mixed")

    @property
    def compute_dtype(self) -> torch.dtype:
        return COMPUTE_DTYPES[self.precision]

    @property
    def weights_dtype(self) -> torch.dtype:
        return torch.float32 if self.mixed else self.compute_dtype

    @property
    def scales_loss(self) -> bool:
        """16-mixed: a GradScaler scales the loss, unscales the gradients and skips steps with infs."""
        return self.precision == "16-mixed"


DEFAULT_STEP = StepOptions()  # 32-true, one micro-batch, no clipping


@dataclass(frozen=True)
class StepLoss:
    """A ``loss_fn`` that runs the model itself: ``step(model, *args, **kwargs)`` returns the micro-batch's loss,
    with the example input split as for the model (a tensor or a tuple's items as arguments, a dict's as keywords).

    For steps whose loss does not come from ``loss_fn(model(input))``: a LightningModule's ``training_step``, a
    Hugging Face Trainer's ``compute_loss``. The step then runs ``step`` where it would call the model, under
    the same autocast; everything the step does inside it (module calls, the loss) is the step's forward.
    ``scales_for_accumulation``: the step already divides its loss by the number of micro-batches (or
    normalizes it otherwise), so the step does not divide it again.
    """

    step: Callable[..., torch.Tensor]
    name: str = "training step"
    scales_for_accumulation: bool = False

    @property
    def __name__(self) -> str:  # Workload's summary names the loss by its __name__
        return self.name

    def __call__(self, model: torch.nn.Module, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self.step(model, *args, **kwargs)


def weights_dtype(model: torch.nn.Module) -> torch.dtype | None:
    """The floating dtype holding most of the model's parameter elements (None: no floating parameter)."""
    counts: Counter[torch.dtype] = Counter()
    for p in model.parameters():
        if p.is_floating_point():
            counts[p.dtype] += p.numel()
    return counts.most_common(1)[0][0] if counts else None


def precision_of(model: torch.nn.Module) -> Precision:
    """The '-true' precision of the model's own weights: the step as the model is built."""
    dtype = weights_dtype(model)
    if dtype is None:
        return "32-true"
    if dtype not in _TRUE_PRECISION:
        raise ValueError(f"the model's weights are {dtype}, which no precision of udnn_lab trains "
                         f"({', '.join(PRECISIONS)}): convert it, e.g. model.to(torch.bfloat16)")
    return _TRUE_PRECISION[dtype]


def check_weights(model: torch.nn.Module, options: StepOptions) -> None:
    """Raise ValueError when the model's weights are not in the dtype its precision trains (never converts them)."""
    found = weights_dtype(model)
    wanted = options.weights_dtype
    if found is None or found == wanted:
        return
    name = str(wanted).removeprefix("torch.")
    if options.mixed:
        raise ValueError(
            f"precision={options.precision!r} runs autocast over float32 weights, but the model's weights are "
            f"{str(found).removeprefix('torch.')}: build it in float32 (model.float()), or ask for "
            f"precision={_TRUE_PRECISION.get(found, '32-true')!r}")
    raise ValueError(
        f"precision={options.precision!r} trains weights in {name}, but the model's weights are "
        f"{str(found).removeprefix('torch.')}: convert the model yourself, model.to(torch.{name}) (before making "
        f"its optimizer), or ask for precision={_TRUE_PRECISION.get(found, '32-true')!r}; udnn_lab does not "
        "convert your model")


@dataclass(frozen=True, repr=False)
class Workload:
    """A model with everything needed to run one training step of it, and, with ``parallel``, how the step is
    spread over ranks (``ul.DDP(n)``, ``ul.FSDP(n)``): ``ul.trace`` then traces one rank of it."""

    model: torch.nn.Module
    example_input: Any  # a tensor, a tuple of positional tensors, or a dict of keyword tensors (one micro-batch)
    target: Any = None  # passed to loss_fn(output, target) when not None
    loss_fn: Callable | None = None  # None: the sum of the outputs; a StepLoss runs the model itself
    optimizer: torch.optim.Optimizer | None = None
    name: str = ""
    batch_size: int | None = None
    precision: Precision | None = None  # None: the model's own dtype as a '-true' precision (precision_of)
    grad_accumulation: int = 1  # micro-batches per optimizer step
    clip_grad_norm: float | None = None  # max total gradient norm; None: no clipping
    parallel: Parallel | None = None  # a DDP or FSDP spec: the step is one rank of parallel.world_size; None: one

    def __post_init__(self) -> None:
        if self.precision is None:
            object.__setattr__(self, "precision", precision_of(self.model))
        check_weights(self.model, self.step_options)
        if self.parallel is not None:
            _check_parallel(self.parallel)

    @property
    def step_options(self) -> StepOptions:
        assert self.precision is not None  # set in __post_init__
        return StepOptions(self.precision, self.grad_accumulation, self.clip_grad_norm)

    def __repr__(self) -> str:
        """A summary: the model's class, the shapes and dtypes of the input and target, the loss and the optimizer,
        and the step's options that are not the default."""
        loss = "sum of outputs" if self.loss_fn is None else \
            getattr(self.loss_fn, "__name__", type(self.loss_fn).__name__)
        optimizer = "none" if self.optimizer is None else type(self.optimizer).__name__
        target = "" if self.target is None else f", target={_summary(self.target)}"
        options = "".join(f", {key}={value}" for key, value, default in (
            ("precision", self.precision, "32-true"), ("grad_accumulation", self.grad_accumulation, 1),
            ("clip_grad_norm", self.clip_grad_norm, None)) if value != default)
        if self.parallel is not None:
            options += f", parallel={_spec_summary(self.parallel)}"
        return (f"Workload({self.name!r}: {type(self.model).__name__}, input={_summary(self.example_input)}{target}, "
                f"loss={loss}, optimizer={optimizer}{options})")


def _check_parallel(parallel: Any) -> None:
    """Raise TypeError unless ``parallel`` is a DDP or FSDP spec of udnn_lab.parallel."""
    # udnn_lab.parallel loads FSDP2 and DTensor (half a second), so it is not imported here, where every trace
    # passes; a spec can only exist once that module is loaded
    specs = sys.modules.get("udnn_lab.parallel")
    if specs is None or not isinstance(parallel, (specs.DDP, specs.FSDP)):
        raise TypeError(f"parallel is ul.DDP(world_size, ...) or ul.FSDP(world_size, ...) (or None for one "
                        f"process), got {type(parallel).__name__}")


def _spec_summary(spec: Any) -> str:
    """'FSDP(world_size=8)': the spec's class, its world size and the settings that are not the default."""
    settings = [f"{field.name}={getattr(spec, field.name)!r}" for field in fields(spec)
                if field.name == "world_size" or getattr(spec, field.name) != field.default]
    return f"{type(spec).__name__}({', '.join(settings)})"


def check_one_process(work: Workload, action: str) -> None:
    """Raise ValueError when ``work`` is one rank of a parallel step: ``action`` runs it for real in this process."""
    if work.parallel is not None:
        raise ValueError(f"{action} runs the step for real in this one process, but the Workload is one rank of "
                         f"{_spec_summary(work.parallel)}: give it dataclasses.replace(work, parallel=None) to run the "
                         f"whole step here, or train the ranks with ul.train(..., parallel=work.parallel)")


def optimizer_like(optimizer: torch.optim.Optimizer, params: Any) -> torch.optim.Optimizer:
    """A new optimizer of ``optimizer``'s class and settings over ``params`` (another copy of the model), with no state.

    ``defaults`` may hold settings the constructor does not take (AdamW's ``decoupled_weight_decay``): only the
    ones it takes are passed.
    """
    accepted = inspect.signature(type(optimizer).__init__).parameters
    settings = {key: value for key, value in optimizer.defaults.items() if key in accepted}
    return type(optimizer)(params, **settings)


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
                name: str | None = None, precision: Precision | None = None, grad_accumulation: int | None = None,
                clip_grad_norm: float | None = None, parallel: Parallel | None = None) -> Workload:
    """Accept a Workload (fields given here override it) or a module with its example input."""
    if isinstance(model, Workload):
        overrides: dict[str, Any] = {
            key: value for key, value in (("example_input", example_input), ("loss_fn", loss_fn),
                                          ("optimizer", optimizer), ("target", target), ("name", name),
                                          ("precision", precision), ("grad_accumulation", grad_accumulation),
                                          ("clip_grad_norm", clip_grad_norm), ("parallel", parallel))
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
                    optimizer=optimizer, name=name or type(model).__name__, precision=precision,
                    grad_accumulation=1 if grad_accumulation is None else grad_accumulation,
                    clip_grad_norm=clip_grad_norm, parallel=parallel)
