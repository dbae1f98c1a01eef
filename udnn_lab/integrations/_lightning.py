"""A PyTorch Lightning callback that trains the LightningModule under a plan (NOTE [trainer steps])."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any, cast

import lightning.pytorch as pl
import torch
from torch.nn.parallel import DistributedDataParallel

from udnn_lab.analysis.recording import fsdp_modules
from udnn_lab.graph import Plan
from udnn_lab.hardware import Hardware
from udnn_lab.integrations._planned import PlannedSteps, StepsShown
from udnn_lab.parallel import DDP, FSDP
from udnn_lab.vocabulary import PRECISIONS, Precision
from udnn_lab.workload import StepLoss, Workload


class LightningPlanCallback(StepsShown, pl.Callback):
    """``Trainer(callbacks=[LightningPlanCallback("6 GiB")])``: every step of ``fit`` within the budget.

    At the first batch it traces the step as the trainer runs it (``training_step``, the trainer's optimizer,
    precision, ``accumulate_grad_batches`` and ``gradient_clip_val``), plans it for ``budget`` with ``policy``
    (or checks ``plan``, a Plan or a file saved by ``plan.save``, against it), then runs every step under the
    offload runtime. Each step's predicted and measured peak and time go to the trainer's loggers under
    ``udnn/`` (``log=False``: kept in ``reports`` only). The module and trainer stay as written. Under a DDP
    strategy each process plans its own rank of the step, with the trainer's DDP settings, and under
    ModelParallelStrategy with the modules ``configure_model`` sharded with ``fully_shard`` and their settings
    (``hardware`` then needs the links its collectives take: a GPU profile, or on CPUs one with gloo's figures).
    """

    def __init__(self, budget: int | str | None = None, *, policy: str = "auto", plan: Plan | str | Path | None = None,
                 hardware: Hardware | str | None = None, log: bool = True) -> None:
        self.steps = PlannedSteps(budget, policy=policy, plan=plan, hardware=hardware)
        self.log = log
        self._micro_batches = 0
        self._stepped = False

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        if not self.steps.ready:
            work = _workload(trainer, pl_module, batch, batch_idx)
            # a DDP rank's trace is of the trainer's DDP over a copy of the module: its paths are the DDP's
            self.steps.prepare(work, (batch,), hooked=None if work.parallel is None else trainer.strategy.model)
        if self.steps.in_step:
            self.steps.check_micro_batch((batch,))
            return
        planned = trainer.accumulate_grad_batches
        left = trainer.num_training_batches - batch_idx
        micro_batches = planned if math.isinf(left) or left >= planned else int(left)
        self._stepped = False
        self.steps.begin(trainer.global_step, (batch,), micro_batches, planned)

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                                 optimizer: torch.optim.Optimizer) -> None:
        self._stepped = True

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if not self._stepped:
            self.steps.after_micro_batch()  # a micro-batch before the step's last
            return
        self._stepped = False
        report = self.steps.end()
        if report is not None and self.log:
            pl_module.log_dict(report.logs(), on_step=True, on_epoch=False, batch_size=1)

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self.steps.abort()

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.steps.close()


def _workload(trainer: pl.Trainer, module: pl.LightningModule, batch: Any, batch_idx: int) -> Workload:
    """The step as this trainer runs it (NOTE [trainer steps] 1); a clear error for what the runtime cannot follow."""
    if not module.automatic_optimization:
        raise ValueError("LightningPlanCallback follows Lightning's automatic optimization (one optimizer step a "
                         "batch group); this module sets automatic_optimization = False: plan its step with "
                         "ul.trace and ul.plan, and run it under ul.OffloadRuntime yourself")
    parallel = _rank_of(trainer)
    if len(trainer.optimizers) != 1:
        raise ValueError(f"LightningPlanCallback plans a step with one optimizer; configure_optimizers gave "
                         f"{len(trainer.optimizers)}")
    precision = cast(Precision, str(trainer.precision))
    if precision not in PRECISIONS:
        raise ValueError(f"precision {precision!r} is not one udnn_lab traces: use one of {', '.join(PRECISIONS)}")
    clip = trainer.gradient_clip_val
    if clip and trainer.gradient_clip_algorithm not in (None, "norm"):
        raise ValueError(f"gradient_clip_algorithm={trainer.gradient_clip_algorithm!r}: udnn_lab traces clipping by "
                         "norm (the default, 'norm')")
    name = type(module).__name__
    redirection = getattr(trainer.strategy, "_forward_redirection", None) if parallel is not None else None
    step = StepLoss(partial(_training_step_loss, batch_idx=batch_idx, redirection=redirection),
                    name=f"{name}.training_step")
    return Workload(model=module, example_input=(batch,), loss_fn=step, optimizer=trainer.optimizers[0], name=name,
                    precision=precision, grad_accumulation=trainer.accumulate_grad_batches,
                    clip_grad_norm=float(clip) if clip else None, parallel=parallel)


def _rank_of(trainer: pl.Trainer) -> DDP | FSDP | None:
    """This process's rank as the trainer runs it: None in a one-process fit; a DDP rank with the settings of the
    trainer's own DistributedDataParallel; an FSDP2 rank sharded as the module's ``configure_model`` sharded it
    (ModelParallelStrategy); a clear error for what the callback cannot trace."""
    if trainer.world_size == 1:
        return None
    wrapper = trainer.strategy.model
    if isinstance(wrapper, DistributedDataParallel):
        return DDP.of(wrapper, trainer.world_size, trainer.global_rank)
    if wrapper is not None and fsdp_modules(wrapper):
        spec = FSDP.of(wrapper, trainer.global_rank)
        if spec.world_size != trainer.world_size:
            raise ValueError(f"configure_model shards the module over {spec.world_size} of the trainer's "
                             f"{trainer.world_size} ranks (tensor parallelism beside FSDP), which the callback "
                             "cannot trace: plan with data_parallel_size equal to the ranks")
        return spec
    raise ValueError(f"LightningPlanCallback plans the ranks of DDP strategies and of FSDP2 (ModelParallelStrategy "
                     f"with fully_shard in configure_model); this trainer runs {trainer.world_size} processes with "
                     f"{type(trainer.strategy).__name__}: plan one rank with ul.trace(..., parallel=ul.FSDP(n)) and "
                     "ul.plan, and train with ul.train(..., parallel=...)")


def _training_step_loss(model: torch.nn.Module, batch: Any, *, batch_idx: int,
                        redirection: Callable[..., Any] | None) -> torch.Tensor:
    if isinstance(model, DistributedDataParallel):
        # a DDP rank's trace: training_step through DDP's forward, by the strategy's own redirection, as the trainer
        # calls it (the module is called twice: once for training_step, once in it)
        assert redirection is not None
        module = cast(pl.LightningModule, model.module)
        with _not_logging(module):
            output = redirection(model, module, "training_step", batch, batch_idx)
    else:
        module = cast(pl.LightningModule, model)
        with _not_logging(module):
            output = module.training_step(batch, batch_idx)
    if isinstance(output, Mapping):
        output = output.get("loss")
    if not isinstance(output, torch.Tensor):
        raise ValueError(f"{type(module).__name__}.training_step returned {type(output).__name__}: the callback plans "
                         "a step whose training_step returns the loss (a tensor, or a dict with 'loss')")
    return output


@contextmanager
def _not_logging(module: pl.LightningModule) -> Iterator[None]:
    """While the step is traced, ``self.log`` records nothing: its values are fake tensors."""
    def ignored(*args: Any, **kwargs: Any) -> None:
        return None

    module.log, module.log_dict = ignored, ignored  # type: ignore[method-assign]
    try:
        yield
    finally:
        del module.log, module.log_dict
