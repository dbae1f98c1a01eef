"""Run one training step for real and record live bytes per op, aligned to the traced Graph.

On CPU the live bytes are the real storages that exist after each op (see NOTE
[storage lifetimes] in analysis/_recorder.py). On CUDA they are also read from the caching
allocator (``memory_allocated``, ``max_memory_allocated``, ``memory_reserved``) after
each op, and NVML reports the device as the driver sees it (or why it cannot).
The step runs as plain eager PyTorch; the model and optimizer are restored afterwards.
"""

from __future__ import annotations

import statistics
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

import numpy as np
import pandas as pd
import torch
from tqdm.auto import tqdm

from udnn_lab.analysis.recording import is_distributed, record_real_step
from udnn_lab.analysis.step import (
    ensure_optimizer_state,
    grad_scaler,
    map_tensors,
    preserved,
    run_step,
    split_input,
)
from udnn_lab.analysis.tracing import trace
from udnn_lab.devices import device_name, model_device
from udnn_lab.errors import LargeMeasurementWarning, TraceMismatch, UdnnLabError
from udnn_lab.graph.plan_ir import check_plan
from udnn_lab.graph.step_graph import Graph
from udnn_lab.measurement import nvml
from udnn_lab.measurement._cost_estimate import PROGRESS_SECONDS, MeasurementEstimate, estimate
from udnn_lab.runtime.offload import OffloadRuntime
from udnn_lab.units import Bytes, format_bytes
from udnn_lab.vocabulary import Precision
from udnn_lab.workload import Workload, as_workload, check_one_process

SETTLE_STEPS = 24  # recorded steps tried again under 16-mixed while the GradScaler's scale falls


@dataclass(frozen=True)
class CudaCounters:
    """Caching-allocator counters read after each op (bytes)."""

    allocated: tuple[int, ...]  # memory_allocated() right after the op
    max_allocated: tuple[int, ...]  # max_memory_allocated() since the previous op (workspaces included)
    reserved: tuple[int, ...]  # memory_reserved() right after the op
    baseline_allocated: int  # memory_allocated() before the first op
    baseline_reserved: int


@dataclass(frozen=True, repr=False)
class Measurement:
    """A real training step: live bytes per op, step time, allocator and NVML readings."""

    model_name: str
    device: str  # 'cpu' or 'cuda'
    device_name: str
    torch_version: str
    measured_at: str  # ISO 8601, UTC
    ops: tuple[str, ...]  # op names, in the Graph's order
    phases: tuple[str, ...]
    live_bytes: tuple[int, ...]  # tracked storages live right after each op
    baseline_bytes: int  # tracked storages live before the first op
    step_time_s: float | None  # median of plain (unrecorded) steps
    step_times_s: tuple[float, ...] = ()
    cuda: CudaCounters | None = None
    nvml_before: nvml.NvmlReading | None = None
    nvml_after: nvml.NvmlReading | None = None
    recorded: Graph | None = field(default=None, compare=False)  # the real run as a Graph (categories approximate)
    # on a CPU, (op, bytes): the most live while an offload runtime's recomputations before that op ran, what they
    # made out of the recording's sight counted (CUDA's counters see it)
    replayed_bytes: tuple[tuple[int, int], ...] = ()

    def __repr__(self) -> str:
        time_text = f"{self.step_time_s * 1e3:.1f} ms" if self.step_time_s is not None else "untimed"
        return (f"Measurement({self.model_name!r} on {self.device_name}, ops={len(self.ops)}, "
                f"peak={format_bytes(self.peak_bytes)}, step={time_text})")

    @property
    def peak_bytes(self) -> Bytes:
        """Peak of tracked live bytes (exact storage sizes), with what recomputations made while they ran."""
        return Bytes(max(self.baseline_bytes, max(self.live_bytes, default=0), self._replays_peak()))

    def _replays_peak(self) -> int:
        return max((live for _, live in self.replayed_bytes), default=0)

    @property
    def cuda_peak_allocated(self) -> int | None:
        """``max_memory_allocated`` over the step, workspaces included."""
        if self.cuda is None:
            return None
        return max(self.cuda.baseline_allocated, max(self.cuda.max_allocated, default=0))

    def curve(self) -> pd.DataFrame:
        """One row per op: measured live bytes (and CUDA counters when on CUDA)."""
        frame = pd.DataFrame({"index": np.arange(len(self.ops)), "phase": self.phases, "op": self.ops,
                              "live_bytes": self.live_bytes})
        if self.cuda is not None:
            frame["allocated_bytes"] = self.cuda.allocated
            frame["max_allocated_bytes"] = self.cuda.max_allocated
            frame["reserved_bytes"] = self.cuda.reserved
        frame.attrs["baseline_bytes"] = self.baseline_bytes
        return frame

    def compare(self, predicted) -> pd.DataFrame:
        """Predicted (a Graph, or a Simulation of a plan) against measured, one row per op.

        On CPU, predicted live bytes against tracked storages. On CUDA, the prediction in
        512-byte blocks against ``memory_allocated``, less what was on the device before
        the step that the step does not account for (reported in ``attrs['offset_bytes']``).
        """
        graph = predicted if isinstance(predicted, Graph) else None
        curve = predicted.memory_curve()
        _check_ops(tuple(curve["op"]), self.ops)
        frame = curve[["index", "phase", "module", "op"]].copy()
        if self.cuda is None:
            frame["predicted_bytes"] = curve["live_bytes"].to_numpy()
            frame["measured_bytes"] = np.asarray(self.live_bytes)
            offset = 0
        else:
            base = graph.cuda_baseline_bytes if graph is not None else int(curve.attrs.get("cuda_baseline_bytes", 0))
            offset = self.cuda.baseline_allocated - base
            frame["predicted_bytes"] = curve["cuda_live_bytes"].to_numpy()
            frame["measured_bytes"] = np.asarray(self.cuda.allocated) - offset
        frame["error_bytes"] = frame["predicted_bytes"] - frame["measured_bytes"]
        frame["relative_error"] = frame["error_bytes"].abs() / frame["measured_bytes"].clip(lower=1)
        frame.attrs["offset_bytes"] = offset
        return frame

    def summary(self, predicted) -> dict[str, Any]:
        """Peak predicted (by a Graph or a Simulation) against measured, and the worst step of the curve."""
        frame = self.compare(predicted)
        predicted_peak = int(frame["predicted_bytes"].max()) if len(frame) else 0
        if isinstance(predicted, Graph):
            predicted_peak = predicted.peak_bytes if self.cuda is None else predicted.cuda_peak_bytes
        measured_peak = int(frame["measured_bytes"].max()) if len(frame) else 0
        measured_peak = max(measured_peak, self.peak_bytes if self.cuda is None
                            else self.cuda.baseline_allocated - frame.attrs["offset_bytes"])
        worst = int(frame["relative_error"].idxmax()) if len(frame) else -1
        return {
            "model": self.model_name, "device": self.device_name, "ops": len(self.ops),
            "predicted_peak_bytes": int(predicted_peak), "measured_peak_bytes": int(measured_peak),
            "peak_relative_error": abs(predicted_peak - measured_peak) / max(measured_peak, 1),
            "max_step_relative_error": float(frame["relative_error"].max()) if len(frame) else 0.0,
            "worst_step": worst, "offset_bytes": int(frame.attrs["offset_bytes"]),
        }


def _check_ops(predicted: tuple[str, ...], measured: tuple[str, ...]) -> None:
    """Raise TraceMismatch naming the first op where the two runs differ."""
    if predicted == measured:
        return
    for i, (a, b) in enumerate(zip(predicted, measured)):
        if a != b:
            raise TraceMismatch(f"the traced graph and the measured run differ at op {i}: traced {a}, measured {b}. "
                                "Trace and measure the same model, input shapes, loss and optimizer.")
    raise TraceMismatch(f"the traced graph has {len(predicted)} ops, the measured run {len(measured)}; "
                        f"trace and measure the same model, input shapes, loss and optimizer")


class _OpsShown:
    """The recorded step's ops, as 'op k/N' beside the bar: the bar itself counts whole steps."""

    def __init__(self, bar, total: int) -> None:
        self.bar, self.total, self.done = bar, total, 0
        self.every = max(1, total // 20)  # at most 20 refreshes a step

    def one_more(self) -> None:
        self.done += 1
        if self.total and (self.done % self.every == 0 or self.done == self.total):
            self.bar.set_postfix_str(f"recording op {min(self.done, self.total)}/{self.total}")


def measure(model: torch.nn.Module | Workload, example_input: Any = None, loss_fn: Callable | None = None,
            optimizer: torch.optim.Optimizer | None = None, *, target: Any = None, plan=None, warmup: int = 1,
            repeats: int = 0, name: str | None = None, graph: Graph | None = None,
            progress: bool | None = None, precision: Precision | None = None, grad_accumulation: int | None = None,
            clip_grad_norm: float | None = None) -> Measurement:
    """Run real training steps where the model lives and record the last one op by op.

    ``warmup`` steps run first (they create optimizer state and warm caches), then
    ``repeats`` timed plain steps (``step_time_s`` is their median; untimed with the default
    0), then one recorded step; with a ``plan`` every step runs under an OffloadRuntime
    carrying it out. Parameters, buffers, gradients and optimizer state are restored afterwards.

    Before it starts, a step that will take long or hold much memory is announced with a
    LargeMeasurementWarning saying what it will cost, from ``graph`` (the traced step; traced
    here under fake tensors when not given and the model is on a CPU). ``progress``: show a
    progress bar (default: when the measurement is expected to take more than a few seconds).
    ``precision``, ``grad_accumulation``, ``clip_grad_norm``: how the step runs, as for ``trace``.
    Under '16-mixed' one GradScaler runs every step, and the recorded step is run again (up to
    SETTLE_STEPS more times, after a warm-up) while the scaler skips it for infs: the traced step
    is the steady one, which finds none.
    """
    work = as_workload(model, example_input, loss_fn=loss_fn, optimizer=optimizer, target=target, name=name,
                       precision=precision, grad_accumulation=grad_accumulation, clip_grad_norm=clip_grad_norm)
    if not is_distributed(work.model):  # a model wrapped in a rank's process is that rank's step
        check_one_process(work, "measure")
    device = model_device(work.model)
    if warmup < 0 or repeats < 0:
        raise ValueError(f"warmup and repeats count steps: 0 or more, got warmup={warmup}, repeats={repeats}")
    args, kwargs = split_input(map_tensors(lambda t: t.to(device), work.example_input))
    runtime = OffloadRuntime(check_plan(plan, graph), model=work.model)  # a graph given: the plan must be its step's
    if graph is None and device.type == "cpu":
        graph = _traced(work)
    cost = _announce(graph, warmup + repeats, device)
    show = progress if progress is not None else cost is not None and cost.seconds > PROGRESS_SECONDS
    bar = tqdm(total=warmup + repeats + 1, desc=f"measuring {work.name}", unit="step", disable=not show, leave=False)
    steps = _Steps(work, device, args, kwargs, map_tensors(lambda t: t.to(device), work.target),
                   grad_scaler(work.step_options, device), runtime, bar,
                   _OpsShown(bar, len(graph.ops) if graph is not None else 0))
    with bar, preserved(work.model, work.optimizer):
        for _ in range(warmup):
            steps.one()
        ensure_optimizer_state(work.optimizer, graded=graph.graded_parameters if graph is not None else None,
                               model=work.model)
        times = [_timed(steps.one, device) for _ in range(repeats)]
        before = nvml.read(_index(device)) if device.type == "cuda" else None
        real, counters = _steady(steps.recorded, steps.scaler, tries=1 + (SETTLE_STEPS if warmup else 0),
                                 name=work.name)
        bar.update(max(0, warmup + repeats + 1 - bar.n))
        after = nvml.read(_index(device)) if device.type == "cuda" else None
    return Measurement(
        model_name=work.name, device=device.type, device_name=device_name(device),
        torch_version=torch.__version__, measured_at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        ops=tuple(op.name for op in real.ops), phases=tuple(op.phase for op in real.ops),
        live_bytes=tuple(int(v) for v in real.memory_curve()["live_bytes"]), baseline_bytes=real.baseline_bytes,
        step_time_s=statistics.median(times) if times else None, step_times_s=tuple(times),
        cuda=counters.freeze() if counters else None, nvml_before=before, nvml_after=after, recorded=real,
        replayed_bytes=real.replayed_bytes,
    )


@dataclass
class _Steps:
    """The steps ``measure`` runs: plain ones (under the plan's runtime) and the recorded one."""

    work: Workload
    device: torch.device
    args: tuple
    kwargs: dict
    target: Any
    scaler: torch.amp.GradScaler | None
    runtime: OffloadRuntime
    bar: Any  # tqdm
    ops_shown: _OpsShown

    def one(self) -> None:
        work = self.work
        with self.runtime:
            run_step(work.model, self.args, self.kwargs, loss_fn=work.loss_fn, target=self.target,
                     optimizer=work.optimizer, options=work.step_options, scaler=self.scaler,
                     replay_views=self.runtime.replays_views)
        self.bar.update(1)

    def recorded(self) -> tuple[Graph, _CudaSampler | None]:
        work = self.work
        work.model.zero_grad(set_to_none=True)  # the recorded step starts without gradients (allocator baseline)
        counters = _CudaSampler() if self.device.type == "cuda" else None
        self.ops_shown.done = 0  # a step the GradScaler skipped is recorded again

        def after_op() -> None:
            if counters is not None:
                counters.sample()
            self.ops_shown.one_more()

        if counters:
            counters.start()
        recorded = record_real_step(work.model, self.args, self.kwargs, target=self.target, loss_fn=work.loss_fn,
                                    optimizer=work.optimizer, name=work.name, device_type=self.device.type,
                                    options=work.step_options, scaler=self.scaler,
                                    runtime=self.runtime if self.runtime.enabled else None, after_op=after_op)
        return recorded, counters


def _steady(recorded_step: Callable[[], Any], scaler: torch.amp.GradScaler | None, tries: int, name: str) -> Any:
    """The recorded step, again while 16-mixed's GradScaler skips it for infs (it halves its scale after each such
    step, from 2**16): the trace is of the steady step, which does not skip (NOTE [host reads in the optimizer
    step] 2)."""
    for _ in range(tries):
        scale = scaler.get_scale() if scaler is not None else 0.0
        recorded = recorded_step()
        if scaler is None or scaler.get_scale() >= scale:  # update() backs off after a step it skipped
            return recorded
    raise TraceMismatch(
        f"the recorded 16-mixed step of {name} found inf or NaN gradients in {tries} tries, so the GradScaler "
        "skipped its optimizer step; a trace is of the steady step, which does not skip: measure with warm-up "
        "(warmup=1 or more) for the scale to settle, or check the model for NaNs")


def _traced(work: Workload) -> Graph | None:
    """The step under fake tensors, for the estimate and the progress bar (a second or so, no real memory).

    None for a model already wrapped for several ranks: its trace is ``trace(..., parallel=spec)`` of the model
    before wrapping, which only the caller has."""
    if is_distributed(work.model):
        return None
    try:
        return trace(work)
    except UdnnLabError:  # a step fake tensors cannot run can still run for real: measure it without an estimate
        return None


def _announce(graph: Graph | None, plain_steps: int, device: torch.device) -> MeasurementEstimate | None:
    """Warn before a measurement that will take long or hold much memory; return its estimate (None: unknown)."""
    if graph is None or device.type not in ("cpu", "cuda"):
        return None
    cost = estimate(graph, plain_steps, device)
    if cost.large:
        warnings.warn(cost.message(), LargeMeasurementWarning, stacklevel=3)
    return cost


def _timed(fn: Callable[[], Any], device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


class _CudaSampler:
    def __init__(self) -> None:
        self.allocated: list[int] = []
        self.max_allocated: list[int] = []
        self.reserved: list[int] = []
        self.baseline = (0, 0)

    def start(self) -> None:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        self.baseline = (torch.cuda.memory_allocated(), torch.cuda.memory_reserved())

    def sample(self) -> None:
        self.allocated.append(torch.cuda.memory_allocated())
        self.max_allocated.append(torch.cuda.max_memory_allocated())
        self.reserved.append(torch.cuda.memory_reserved())
        torch.cuda.reset_peak_memory_stats()

    def freeze(self) -> CudaCounters:
        return CudaCounters(tuple(self.allocated), tuple(self.max_allocated), tuple(self.reserved), *self.baseline)


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()
