"""The pieces of a managed training step that one process and a run over ranks share: the Run, one step's row,
the batches grouped into steps, the progress bar."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import nullcontext
from dataclasses import dataclass, field
from itertools import islice
from typing import Any

import pandas as pd
import torch
from tqdm.auto import tqdm

from udnn_lab.analysis.recording import resized_storages
from udnn_lab.analysis.step import MicroBatch, map_tensors, run_step, split_input
from udnn_lab.runtime.live_bytes import LiveBytes, resident
from udnn_lab.runtime.offload import OffloadRuntime
from udnn_lab.units import format_bytes, format_seconds
from udnn_lab.workload import StepOptions

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


def groups(batches: Iterator, size: int) -> Iterator[list]:
    """Consecutive groups of ``size`` batches, each group one step's micro-batches; a short last one is dropped."""
    while len(group := list(islice(batches, size))) == size:
        yield group


def on_device(batch, device: torch.device) -> MicroBatch:
    inputs, target = batch if isinstance(batch, (tuple, list)) and len(batch) == 2 else (batch, None)
    args, kwargs = split_input(map_tensors(lambda t: t.to(device, non_blocking=True), inputs))
    return args, kwargs, map_tensors(lambda t: t.to(device, non_blocking=True), target)


def one_step(index: int, model, micro_batches: list[MicroBatch], device, step: dict, optimizer,
              runtime: OffloadRuntime, track: bool) -> dict:
    args, kwargs, target = micro_batches[0]
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    counter = LiveBytes(resident(model, optimizer, step["scaler"], micro_batches),
                        [r.tensor for r in resized_storages(model)]) if track else None
    runtime.observer = counter
    start = time.perf_counter()
    with counter if counter is not None else nullcontext(), runtime:
        _, loss = run_step(model, args, kwargs, target=target, micro_batches=micro_batches[1:],
                           replay_views=runtime.replays_views, **step)
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


def progress_bar(total: int | None, enabled: bool, name: str):
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
