"""Managed training: the step loop with the offload runtime, a measurement per step, progress, stop.

``ul.train(model, batches, optimizer, plan=..., steps=...)`` runs steps until ``steps`` or
the batches run out, or until stopped (``stop.set()`` from another thread, or a callback
returning False), and returns a Run: one row per step (loss, time, peak, bytes moved,
stalls). Each step is ``run_step``'s, the step ``trace`` and ``measure`` run: in the
precision asked for, over ``grad_accumulation`` batches, with clipping. With
``fuse_optimizer=True`` each parameter is updated as soon as its gradient is ready and the
gradient is freed at once (document 001's delayed, overlapped weight update, in PyTorch's
form: ``register_post_accumulate_grad_hook``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import nullcontext
from dataclasses import dataclass, field
from datetime import datetime, timezone
from itertools import islice
from typing import Any

import pandas as pd
import torch
from tqdm.auto import tqdm

from udnn_lab.analysis.step import MicroBatch, grad_scaler, map_tensors, run_step, scaler_state, split_input
from udnn_lab.devices import device_name, model_device
from udnn_lab.graph.plan_ir import Plan
from udnn_lab.runtime.live_bytes import LiveBytes
from udnn_lab.runtime.offload import OffloadRuntime
from udnn_lab.units import format_bytes, format_seconds
from udnn_lab.vocabulary import Precision
from udnn_lab.workload import StepOptions, check_weights, precision_of

Callback = Callable[[dict], "bool | None"]
STEP_COLUMNS = ["step", "loss", "time_s", "peak_bytes", "d2h_bytes", "h2d_bytes", "wait_s", "recomputed", "on_demand"]


@dataclass(frozen=True, repr=False)
class Run:
    """What a managed training run did, step by step."""

    model_name: str
    device: str
    device_name: str
    policy: str
    fused_optimizer: bool
    started_at: str
    steps: pd.DataFrame  # STEP_COLUMNS
    stopped: str  # 'steps', 'batches', 'stop requested', 'callback'
    pinned_bytes: int
    notes: tuple[str, ...] = field(default=())
    options: StepOptions = StepOptions()  # precision, micro-batches per step, clipping

    def __repr__(self) -> str:
        if len(self.steps):
            return (f"Run({self.model_name!r}, {len(self.steps)} steps, policy={self.policy}, median step "
                    f"{format_seconds(self.steps['time_s'].median())}, "
                    f"peak {format_bytes(self.steps['peak_bytes'].max())},"
                    f" stopped: {self.stopped})")
        return f"Run({self.model_name!r}, no steps, stopped: {self.stopped})"


def train(model: torch.nn.Module, batches: Iterable, optimizer: torch.optim.Optimizer | None, *,
          loss_fn: Callable | None = None, plan: Plan | None = None, steps: int | None = None,
          callbacks: Iterable[Callback] = (), stop: threading.Event | None = None, fuse_optimizer: bool = False,
          progress: bool = True, track_memory: bool | None = None, name: str | None = None,
          precision: Precision | None = None, grad_accumulation: int = 1,
          clip_grad_norm: float | None = None) -> Run:
    """Train ``model`` on ``batches`` (each an ``(input, target)`` pair, or an input alone).

    ``plan`` runs every step under an OffloadRuntime. ``callbacks`` get each step's row as a
    dict and may return False to stop. ``track_memory``: count live storages each step on
    a CPU (CUDA always reads the allocator's peak); by default on for CPU. ``precision``
    (default: the model's own dtype), ``grad_accumulation`` (batches per optimizer step: a
    step takes that many batches; an incomplete group at the end is not run) and
    ``clip_grad_norm``, as for ``trace``; a row's loss is the step's last batch's. Under
    '16-mixed' one GradScaler runs the whole run.
    """
    options = StepOptions(precision or precision_of(model), grad_accumulation, clip_grad_norm)
    check_weights(model, options)
    if fuse_optimizer and (grad_accumulation > 1 or clip_grad_norm is not None or options.scales_loss):
        raise ValueError("fuse_optimizer=True steps each parameter inside backward, as soon as its gradient is "
                         "ready, so it cannot accumulate gradients, clip them or unscale them (16-mixed): leave "
                         "fuse_optimizer off for those")
    device = model_device(model)
    runtime = OffloadRuntime(plan)
    track = device.type == "cpu" if track_memory is None else track_memory
    fused = _FusedOptimizer(optimizer) if fuse_optimizer and optimizer is not None else None
    scaler = grad_scaler(options, device)
    rows, stopped = [], "batches"
    bar = _progress(steps, progress, name or type(model).__name__)
    groups = _groups(iter(batches), grad_accumulation)
    try:
        for index, group in enumerate(groups):
            if steps is not None and index >= steps:
                stopped = "steps"
                break
            if stop is not None and stop.is_set():
                stopped = "stop requested"
                break
            step = dict(loss_fn=loss_fn, optimizer=None if fused is not None else optimizer, options=options,
                        scaler=scaler)
            row = _one_step(index, model, [_on_device(batch, device) for batch in group], device, step, optimizer,
                            runtime, track)
            rows.append(row)
            bar.update(1)
            bar.set_postfix(loss=f"{row['loss']:.4g}", peak=format_bytes(row["peak_bytes"]))
            if any(callback(row) is False for callback in callbacks):
                stopped = "callback"
                break
        else:
            stopped = "steps" if steps is not None and len(rows) >= steps else "batches"
    finally:
        bar.close()
        if fused is not None:
            fused.remove()
        pinned_bytes = runtime.pool.capacity_bytes if runtime.pool is not None else 0
        runtime.release()
    return Run(model_name=name or type(model).__name__, device=device.type, device_name=device_name(device),
               policy=plan.policy if plan is not None else "none", fused_optimizer=fused is not None,
               started_at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
               steps=pd.DataFrame(rows, columns=STEP_COLUMNS), stopped=stopped,
               pinned_bytes=pinned_bytes, options=options)


def _groups(batches: Iterator, size: int) -> Iterator[list]:
    """Consecutive groups of ``size`` batches, each group one step's micro-batches; a short last one is dropped."""
    while len(group := list(islice(batches, size))) == size:
        yield group


def _on_device(batch, device: torch.device) -> MicroBatch:
    inputs, target = batch if isinstance(batch, (tuple, list)) and len(batch) == 2 else (batch, None)
    args, kwargs = split_input(map_tensors(lambda t: t.to(device, non_blocking=True), inputs))
    return args, kwargs, map_tensors(lambda t: t.to(device, non_blocking=True), target)


def _one_step(index: int, model, micro_batches: list[MicroBatch], device, step: dict, optimizer,
              runtime: OffloadRuntime, track: bool) -> dict:
    args, kwargs, target = micro_batches[0]
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    counter = LiveBytes(_resident(model, optimizer, step["scaler"], micro_batches)) if track else None
    runtime.observer = counter
    start = time.perf_counter()
    with counter if counter is not None else nullcontext(), runtime:
        _, loss = run_step(model, args, kwargs, target=target, micro_batches=micro_batches[1:], **step)
    runtime.observer = None
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elapsed = time.perf_counter() - start
    stats = runtime.last_step
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else (counter.peak if counter else 0)
    return {"step": index, "loss": float(loss.detach()), "time_s": elapsed, "peak_bytes": int(peak),
            "d2h_bytes": stats.d2h_bytes if stats else 0, "h2d_bytes": stats.h2d_bytes if stats else 0,
            "wait_s": stats.wait_s if stats else 0.0, "recomputed": stats.recomputed if stats else 0,
            "on_demand": stats.on_demand if stats else 0}


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



def _progress(total: int | None, enabled: bool, name: str):
    if enabled:
        return tqdm(total=total, desc=f"training {name}", unit="step")
    return _NoBar()


class _NoBar:
    def update(self, n: int) -> None:
        pass

    def set_postfix(self, **values: Any) -> None:
        pass

    def close(self) -> None:
        pass


def _resident(model, optimizer, scaler, micro_batches: list[MicroBatch]):
    """What the step starts with: parameters, buffers, optimizer and scaler state, the micro-batches."""
    yield from model.parameters()
    yield from model.buffers()
    if optimizer is not None:
        for state in optimizer.state.values():
            yield from (v for v in state.values() if isinstance(v, torch.Tensor))
    yield from scaler_state(scaler).values()
    for args, kwargs, target in micro_batches:
        yield from (t for t in (*args, *kwargs.values(), target) if isinstance(t, torch.Tensor))
