"""A Hugging Face TrainerCallback that trains the Trainer's model under a plan (NOTE [trainer steps])."""

from __future__ import annotations

import inspect
from functools import partial
from pathlib import Path
from typing import Any

import torch
from accelerate.utils import DistributedType
from torch.nn.parallel import DistributedDataParallel
from transformers import Trainer, TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from udnn_lab.analysis.recording import fsdp_modules
from udnn_lab.graph import Plan
from udnn_lab.hardware import Hardware
from udnn_lab.integrations._planned import PlannedSteps, StepsShown
from udnn_lab.parallel import DDP, FSDP
from udnn_lab.workload import StepLoss, Workload, precision_of, weights_dtype


class HFPlanCallback(StepsShown, TrainerCallback):
    """``Trainer(..., callbacks=[HFPlanCallback("6 GiB")])``: every step of ``train()`` within the budget.

    At the first micro-batch it traces the step as the Trainer runs it (its ``compute_loss``, with the
    ``num_items_in_batch`` it passes, its optimizer, ``bf16``/``fp16``, ``gradient_accumulation_steps`` and
    ``max_grad_norm``), plans it for ``budget`` with ``policy`` (or checks ``plan``, a Plan or a file saved by
    ``plan.save``, against it), then runs every step under the offload runtime. Each step's predicted and
    measured peak and time go through ``Trainer.log`` (so to every ``report_to`` logger) under ``udnn/`` when the
    Trainer logs, and on the first planned step (``log=False``: kept in ``reports`` only). The callback finds its
    Trainer when training begins (``trainer=``: name it); the model and the Trainer stay as written. Under DDP
    (``torchrun``) each process plans its own rank of the step, with the Trainer's DDP settings, and under
    accelerate's FSDP2 with the modules and settings it sharded (``hardware`` then needs the links its collectives
    take: a GPU profile, or on CPUs one with gloo's figures).
    """

    def __init__(self, budget: int | str | None = None, *, policy: str = "auto", plan: Plan | str | Path | None = None,
                 hardware: Hardware | str | None = None, log: bool = True, trainer: Trainer | None = None) -> None:
        self.steps = PlannedSteps(budget, policy=policy, plan=plan, hardware=hardware)
        self.log = log
        self.trainer = trainer
        self._micro_batch = 0
        self._planned_micro_batches = 1
        self._micro_batches = 1  # the current step's
        self._guarded: list[tuple[object, str]] = []  # (object, method name): guarded while training runs

    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                       **kwargs: Any) -> None:
        trainer = self.trainer or _calling_trainer()
        self.trainer = trainer
        self._let_go()  # anything still ours from a train() that an interrupt ended
        trainer.training_step = partial(_followed_step, self, trainer.training_step)  # type: ignore[method-assign]
        # the rest of the step (clipping, the optimizer's step) runs after the last training_step: an error there
        # must let the runtime go too (NOTE [trainer steps] 5)
        for owner, name in ((trainer, "_clip_grad_norm"), (trainer.optimizer, "step")):
            if callable(getattr(owner, name, None)):
                setattr(owner, name, partial(_guarded, self, getattr(owner, name)))
                self._guarded.append((owner, name))

    def on_step_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                      **kwargs: Any) -> None:
        self._micro_batch = 0

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                    **kwargs: Any) -> None:
        report = self.steps.end()
        first = report is not None and report.planned and sum(r.planned for r in self.reports) == 1
        if report is not None and self.log and (control.should_log or first):
            assert self.trainer is not None
            self.trainer.log(report.logs())

    def on_train_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                     **kwargs: Any) -> None:
        self._let_go()

    def _let_go(self) -> None:
        """The Trainer as it was: its own methods, the host pool given back."""
        if self.trainer is not None and "training_step" in vars(self.trainer):
            del self.trainer.training_step
        for owner, name in self._guarded:
            if name in vars(owner):
                delattr(owner, name)
        self._guarded.clear()
        self.steps.close()

    def micro_batch(self, model: torch.nn.Module, inputs: dict, num_items_in_batch: Any) -> None:
        """Before the Trainer's training_step: plan at the first, start or check the step (NOTE [trainer steps])."""
        trainer = self.trainer
        assert trainer is not None
        # the batch as training_step gets it: its shapes and dtypes are the ones _prepare_inputs leaves on the device
        example = (dict(inputs),) if num_items_in_batch is None else (dict(inputs), num_items_in_batch)
        if not self.steps.ready:
            work = _workload(trainer, model, _on_device(trainer, example))
            self._planned_micro_batches = work.grad_accumulation
            # a DDP rank's trace is of the Trainer's DDP over a copy of the model: its paths are the DDP's
            self.steps.prepare(work, example, hooked=None if work.parallel is None else model)
        self._micro_batch += 1
        if self._micro_batch == 1:
            self._micro_batches = getattr(trainer, "current_gradient_accumulation_steps",
                                          trainer.args.gradient_accumulation_steps)
            self.steps.begin(trainer.state.global_step, example, self._micro_batches, self._planned_micro_batches)
        else:
            self.steps.check_micro_batch(example)

    def micro_batch_done(self) -> None:
        """After the Trainer's training_step: the count pauses until the next micro-batch of the step (NOTE
        [trainer steps] 6)."""
        if self._micro_batch < self._micro_batches:
            self.steps.after_micro_batch()


def _followed_step(callback: HFPlanCallback, training_step, model: torch.nn.Module, inputs: dict,
                   num_items_in_batch: Any = None) -> torch.Tensor:
    """The Trainer's training_step, with the plan started before the step's first micro-batch (NOTE [trainer
    steps] 2) and let go when anything in it fails (NOTE [trainer steps] 5)."""
    try:
        callback.micro_batch(model, inputs, num_items_in_batch)
        loss = training_step(model, inputs, num_items_in_batch)
        callback.micro_batch_done()
        return loss
    except BaseException:
        callback.steps.abort()
        callback._let_go()  # train() ends with the error: on_train_end will not come
        raise


def _guarded(callback: HFPlanCallback, method, *args: Any, **kwargs: Any) -> Any:
    """One of the Trainer's methods in a step, letting the runtime go when it fails (NOTE [trainer steps] 5)."""
    try:
        return method(*args, **kwargs)
    except BaseException:
        callback.steps.abort()
        callback._let_go()
        raise


def _calling_trainer() -> Trainer:
    """The Trainer whose ``train()`` is calling its callbacks: a few frames up, as its ``self``."""
    frame = inspect.currentframe()
    for _ in range(12):
        frame = frame.f_back if frame is not None else None
        if frame is None:
            break
        candidate = frame.f_locals.get("self")
        if isinstance(candidate, Trainer):
            return candidate
    raise RuntimeError("HFPlanCallback could not find the Trainer calling it: pass it, "
                       "HFPlanCallback(..., trainer=trainer), or add the callback with trainer.add_callback")


def _on_device(trainer: Trainer, example: tuple) -> tuple:
    """The micro-batch as training_step computes its loss from it: the inputs where _prepare_inputs puts them."""
    return (dict(trainer._prepare_inputs(example[0])), *example[1:])


def _workload(trainer: Trainer, model: torch.nn.Module, example: tuple) -> Workload:
    """The step as this Trainer runs it (NOTE [trainer steps] 1): ``model`` as training_step gets it, under DDP
    the Trainer's DistributedDataParallel, traced as this process's rank."""
    args = trainer.args
    parallel: DDP | FSDP | None = None
    if isinstance(model, DistributedDataParallel):
        parallel = DDP.of(model, args.world_size, args.process_index)
        model = model.module
    elif fsdp_modules(model):  # accelerate's FSDP2 plugin sharded it in place
        parallel = FSDP.of(model, args.process_index)
        if parallel.world_size != args.world_size:
            raise ValueError(f"the model is sharded over {parallel.world_size} of the Trainer's {args.world_size} "
                             "ranks (another parallelism beside FSDP), which the callback cannot trace")
    elif args.world_size > 1:
        raise ValueError(f"HFPlanCallback plans the ranks of DDP and FSDP2 (accelerate's fsdp_version 2); this "
                         f"Trainer runs {args.world_size} processes with its model in {type(model).__name__}: plan "
                         "one rank with ul.trace(..., parallel=ul.FSDP(n)) and ul.plan, and train with "
                         "ul.train(..., parallel=...)")
    optimizer = trainer.optimizer
    optimizer = getattr(optimizer, "optimizer", optimizer)  # accelerate's AcceleratedOptimizer wraps the optimizer
    name = type(model).__name__
    return Workload(model=model, example_input=example, optimizer=optimizer, name=name,
                    loss_fn=StepLoss(partial(_trainer_loss, trainer), name=f"{type(trainer).__name__}.compute_loss",
                                     scales_for_accumulation=True),
                    precision=_precision(args, model), grad_accumulation=args.gradient_accumulation_steps,
                    clip_grad_norm=args.max_grad_norm if args.max_grad_norm and args.max_grad_norm > 0 else None,
                    parallel=parallel)


def _precision(args: TrainingArguments, model: torch.nn.Module):
    """Lightning's name for the Trainer's precision: autocast over float32 weights, or the weights' own dtype."""
    full = weights_dtype(model) in (None, torch.float32)
    if args.bf16:
        return "bf16-mixed" if full else "bf16-true"
    if args.fp16:
        return "16-mixed" if full else "16-true"
    return precision_of(model)


def _trainer_loss(trainer: Trainer, model: torch.nn.Module, inputs: dict,
                  num_items_in_batch: Any = None) -> torch.Tensor:
    """What training_step computes before backward: compute_loss, the division for accumulation where the Trainer
    makes it, and the one Accelerator.backward makes before it calls backward."""
    with trainer.compute_loss_context_manager():
        loss = trainer.compute_loss(model, dict(inputs), num_items_in_batch=num_items_in_batch)
    assert isinstance(loss, torch.Tensor)  # return_outputs is off: the loss alone
    if trainer.args.n_gpu > 1:
        loss = loss.mean()
    scaled = getattr(trainer, "loss_is_scaled_for_ga", None)
    if scaled is None:
        scaled = (trainer.model_accepts_loss_kwargs and num_items_in_batch is not None) \
            or trainer.compute_loss_func is not None
    if not scaled:
        loss = loss / trainer.current_gradient_accumulation_steps
    accelerator = trainer.accelerator
    if accelerator.distributed_type != DistributedType.DEEPSPEED:  # Accelerator.backward divides again, by 1 too
        loss = loss / accelerator.gradient_accumulation_steps
    return loss
