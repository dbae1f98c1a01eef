"""Managed training: the step loop with the offload runtime, a measurement per step, progress, stop.

``ul.train(model, batches, optimizer, plan=..., steps=...)`` runs steps until ``steps`` or
the batches run out, or until stopped (``stop.set()`` from another thread, or a callback
returning False), and returns a Run: one row per step (loss, time, peak, bytes moved,
stalls). Each step is ``run_step``'s, the step ``trace`` and ``measure`` run: in the
precision asked for, over ``grad_accumulation`` batches, with clipping. With
``fuse_optimizer=True`` each parameter is updated as soon as its gradient is ready and the
gradient is freed at once (document 001's delayed, overlapped weight update, in PyTorch's
form: ``register_post_accumulate_grad_hook``). With ``parallel=ul.DDP(n)`` or ``ul.FSDP(n)`` the same
steps run in n rank processes (training_ranks.py).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Sequence
from datetime import datetime, timezone
from typing import Any

import pandas as pd
import torch

from udnn_lab.analysis.step import grad_scaler
from udnn_lab.devices import device_name, model_device
from udnn_lab.graph.plan_ir import Plan
from udnn_lab.parallel import Parallel
from udnn_lab.runtime._step_loop import STEP_COLUMNS, Run, groups, on_device, one_step, progress_bar
from udnn_lab.runtime.offload import OffloadRuntime
from udnn_lab.runtime.training_ranks import train_ranks
from udnn_lab.units import format_bytes
from udnn_lab.vocabulary import Precision
from udnn_lab.workload import StepOptions, check_weights, precision_of

Callback = Callable[[dict], "bool | None"]


def train(model: torch.nn.Module, batches: Iterable, optimizer: torch.optim.Optimizer | None, *,
          loss_fn: Callable | None = None, plan: Plan | Sequence[Plan] | None = None, steps: int | None = None,
          callbacks: Iterable[Callback] = (), stop: threading.Event | None = None, fuse_optimizer: bool = False,
          progress: bool = True, track_memory: bool | None = None, name: str | None = None,
          precision: Precision | None = None, grad_accumulation: int = 1,
          clip_grad_norm: float | None = None, parallel: Parallel | None = None) -> Run:
    """Train ``model`` on ``batches`` (each an ``(input, target)`` pair, or an input alone).

    ``plan`` runs every step under an OffloadRuntime. ``callbacks`` get each step's row as a
    dict and may return False to stop. ``track_memory``: count live storages each step on
    a CPU (CUDA always reads the allocator's peak); by default on for CPU. ``precision``
    (default: the model's own dtype), ``grad_accumulation`` (batches per optimizer step: a
    step takes that many batches; an incomplete group at the end is not run) and
    ``clip_grad_norm``, as for ``trace``; a row's loss is the step's last batch's. Under
    '16-mixed' one GradScaler runs the whole run.

    ``parallel``: a DDP or FSDP spec; the run takes ``world_size`` processes started here, one per rank, each
    training on its share of every batch (its size must be a multiple of ``world_size``), and the trained
    weights come back into ``model`` and the optimizer's state into ``optimizer`` (training_ranks.py says how).
    ``plan`` is then one Plan for every rank or a list of one per rank; rows carry each rank's peak as
    ``peak_bytes_rank<r>``.
    """
    options = StepOptions(precision or precision_of(model), grad_accumulation, clip_grad_norm)
    check_weights(model, options)
    if parallel is not None:
        if fuse_optimizer:
            raise ValueError("fuse_optimizer=True is for one process: over ranks the wrapper owns the gradients "
                             "(DDP's buckets, FSDP's reduce-scatter); leave fuse_optimizer off with parallel=")
        return train_ranks(model, batches, optimizer, parallel=parallel, options=options, loss_fn=loss_fn,
                           plan=plan, steps=steps, callbacks=callbacks, stop=stop, progress=progress,
                           track_memory=track_memory, name=name)
    one_plan = _one_process_plan(plan, fuse_optimizer, options)
    device = model_device(model)
    runtime = OffloadRuntime(one_plan, model=model)
    track = device.type == "cpu" if track_memory is None else track_memory
    fused = _FusedOptimizer(optimizer) if fuse_optimizer and optimizer is not None else None
    scaler = grad_scaler(options, device)
    bar = progress_bar(steps, progress, name or type(model).__name__)
    step = dict(loss_fn=loss_fn, optimizer=None if fused is not None else optimizer, options=options, scaler=scaler)

    def run_one(index: int, group: list) -> dict:
        return one_step(index, model, [on_device(batch, device) for batch in group], device, step, optimizer,
                        runtime, track)

    try:
        rows, stopped = _loop(groups(iter(batches), grad_accumulation), steps, stop, callbacks, bar, run_one)
    finally:
        bar.close()
        if fused is not None:
            fused.remove()
        pinned_bytes = runtime.pool.capacity_bytes if runtime.pool is not None else 0
        runtime.release()
    return Run(model_name=name or type(model).__name__, device=device.type, device_name=device_name(device),
               policy=one_plan.policy if one_plan is not None else "none", fused_optimizer=fused is not None,
               started_at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
               steps=pd.DataFrame(rows, columns=STEP_COLUMNS), stopped=stopped,
               pinned_bytes=pinned_bytes, options=options)


class _FusedOptimizer:
    """Steps each parameter inside backward, when its gradient is complete, then frees the gradient.

    One single-parameter optimizer of the same class per parameter, sharing the user's
    optimizer's hyperparameters and its state dict entries, so the user's optimizer sees
    the state it would have had.
    """

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.handles = []
        kind: Callable[..., torch.optim.Optimizer] = type(optimizer)  # a subclass, with its own constructor
        for group in optimizer.param_groups:
            settings = {k: v for k, v in group.items() if k != "params"}
            settings["foreach"] = False
            for param in group["params"]:
                if not param.requires_grad:
                    continue
                single = kind([{"params": [param], **settings}])
                single.state[param] = optimizer.state[param]  # the same dict: updates land in both
                self.handles.append(param.register_post_accumulate_grad_hook(_stepper(single)))

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()


def _stepper(single: torch.optim.Optimizer):
    def step(param: torch.Tensor) -> None:
        single.step()
        param.grad = None
    return step


def _one_process_plan(plan: Plan | Sequence[Plan] | None, fuse_optimizer: bool, options: StepOptions) -> Plan | None:
    """The plan of a run in this process, once the run's settings are checked to be one process's."""
    if plan is not None and not isinstance(plan, Plan):
        raise TypeError(f"plan is one Plan (a list of Plans, one per rank, is for parallel=), got "
                        f"{type(plan).__name__}")
    if fuse_optimizer and (options.grad_accumulation > 1 or options.clip_grad_norm is not None
                           or options.scales_loss):
        raise ValueError("fuse_optimizer=True steps each parameter inside backward, as soon as its gradient is "
                         "ready, so it cannot accumulate gradients, clip them or unscale them (16-mixed): leave "
                         "fuse_optimizer off for those")
    return plan


def _why_stop(index: int, steps: int | None, stop: threading.Event | None) -> str | None:
    """Why the run stops before step ``index`` (None: it goes on)."""
    if steps is not None and index >= steps:
        return "steps"
    if stop is not None and stop.is_set():
        return "stop requested"
    return None


def _loop(step_batches: Iterable[list], steps: int | None, stop: threading.Event | None,
          callbacks: Iterable[Callback], bar: Any, run_one: Callable[[int, list], dict]) -> tuple[list[dict], str]:
    """Run ``run_one`` on each step's batches until they, ``steps``, ``stop`` or a callback end the run: the rows,
    and why it ended."""
    rows: list[dict] = []
    for index, group in enumerate(step_batches):
        if (why := _why_stop(index, steps, stop)) is not None:
            return rows, why
        row = run_one(index, group)
        rows.append(row)
        bar.update(1)
        bar.set_postfix(loss=f"{row['loss']:.4g}", peak=format_bytes(row["peak_bytes"]))
        if any(callback(row) is False for callback in callbacks):
            return rows, "callback"
    return rows, "steps" if steps is not None and len(rows) >= steps else "batches"
