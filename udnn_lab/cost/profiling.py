"""Measure what each op of a training step costs here: FLOPs, bytes and time, aligned to the Graph's ops.

FLOPs come from torch.utils.flop_counter's formulas, bytes from the tensors each op
reads and writes. Times are CUDA events around each op on a GPU (the device kept busy while the host issues
the op: ``_DEVICE_LEAD_S``; perf_counter around the call times the host's issuing it, ``host_time_s``), and
perf_counter around each op on a CPU (where ops run synchronously), taken over
``repeats`` steps
after ``warmup`` steps; the median of each op is kept. Plain steps are also timed,
so the framework's cost between ops (Python, autograd) is known: ``overhead_per_op_s``; and steps under a
pass-through dispatch mode, so what following this step op by op costs is known: ``dispatch_mode_op_s``;
and the probes the later stages register measure their host work on this step (``replay_op_s``, ``hook_call_s``:
NOTE [host probes] 4).
"""

from __future__ import annotations

import copy
import statistics
import time
import warnings
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from typing import Any

import numpy as np
import pandas as pd
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from udnn_lab.analysis.recording import record_real_step, records_op
from udnn_lab.analysis.step import (
    autocast,
    grad_scaler,
    map_tensors,
    preserved,
    run_step,
    same_optimizer,
    split_input,
    state_made_at_first_step,
)
from udnn_lab.devices import device_name, model_device
from udnn_lab.errors import TraceMismatch, UnmeasuredFigureWarning
from udnn_lab.graph.step_graph import Graph
from udnn_lab.hardware import PassThroughMode
from udnn_lab.hardware.host_probes import ProbedStep, step_probes
from udnn_lab.units import format_seconds
from udnn_lab.workload import StepOptions, Workload, as_workload, check_one_process


@dataclass(frozen=True, repr=False)
class Profile:
    """Per-op cost of one training step on one device."""

    model_name: str
    device: str  # 'cpu' or 'cuda'
    device_name: str
    torch_version: str
    measured_at: str  # ISO 8601, UTC
    graph_fingerprint: str  # of the graph of the profiled step
    ops: tuple[str, ...]
    phases: tuple[str, ...]
    modules: tuple[str, ...]
    flops: tuple[int, ...]
    bytes_read: tuple[int, ...]
    bytes_written: tuple[int, ...]
    time_s: tuple[float, ...]  # median over the timed steps
    time_min_s: tuple[float, ...]
    repeats: int
    step_time_s: float  # median of plain (untimed) steps
    threads: int  # torch CPU threads during the measurement
    # host seconds per op that a step under a pass-through dispatch mode takes beyond a plain one (NOTE [simulated
    # streams] 6); None: not measured
    dispatch_mode_op_s: float | None = None
    # host seconds a recomputation adds to each op it records and re-runs, measured on this step's forward by the
    # runtime's step probe (NOTE [host probes] 4); None: not measured
    replay_op_s: float | None = None
    # host seconds each recomputation the runtime records costs besides its ops, and once more a step in which it
    # records any, measured by the same probe (NOTE [host probes] 4); None: not measured
    replay_recompute_s: float | None = None
    recording_step_s: float | None = None
    # host seconds each module call the runtime re-runs to recompute (NOTE [hook points] 7) costs beyond its ops and
    # its packs, measured by the same probe on the step's repeated block; None: not measured
    rerun_call_s: float | None = None
    # host seconds the runtime spends per module or saved-tensor hook call it handles, measured on this step by the
    # runtime's step probe (NOTE [host probes] 4); None: not measured, or not above the step's own variation
    hook_call_s: float | None = None
    # host seconds of one offload's actions, and of the runtime's own work once per step (setting up and tearing
    # down, the view replay it turns on), measured on this step by the same probe; None: not measured
    offload_action_s: float | None = None
    runtime_step_s: float | None = None
    # bytes per second of the runtime's copies to its host pool and back in this step, on a CPU (which runs them from
    # its caches where they fit), measured by the runtime's step probe (NOTE [host probes] 4); None: not measured, and
    # on a GPU, whose copies run at the link's rate
    copy_bytes_per_s: float | None = None
    # per op, the most bytes the caching allocator held while the op ran beyond what it held before and after it
    # (a library's scratch: cuDNN's convolution workspaces), the largest over the timed steps; CUDA only, None
    # elsewhere (NOTE [op scratch])
    scratch_bytes: tuple[int, ...] | None = None
    # CUDA: host seconds each op takes to be issued (its dispatch and kernel launches, the device kept busy), the
    # median over the timed steps (NOTE [simulated streams] 9); None on a CPU, where the host runs the op
    host_time_s: tuple[float, ...] | None = None

    def __repr__(self) -> str:
        return (f"Profile({self.model_name!r} on {self.device_name}, ops={len(self.ops)}, "
                f"step={format_seconds(self.step_time_s)}, ops sum={format_seconds(self.op_time_s)})")

    @property
    def op_time_s(self) -> float:
        """Sum of the ops' median times."""
        return float(sum(self.time_s))

    @property
    def overhead_per_op_s(self) -> float:
        """What a plain step spends outside the ops (Python, autograd), per op; never negative."""
        return between_ops_s(self.step_time_s, self.time_s)

    def frame(self) -> pd.DataFrame:
        """One row per op: FLOPs, bytes, time and achieved rates."""
        frame = pd.DataFrame({
            "index": np.arange(len(self.ops)), "phase": self.phases, "module": self.modules, "op": self.ops,
            "flops": self.flops, "bytes_read": self.bytes_read, "bytes_written": self.bytes_written,
            "time_s": self.time_s, "time_min_s": self.time_min_s,
        })
        seconds = frame["time_s"].clip(lower=1e-12)
        frame["flops_per_s"] = frame["flops"] / seconds
        frame["bytes_per_s"] = (frame["bytes_read"] + frame["bytes_written"]) / seconds
        return frame

    def layers(self) -> pd.DataFrame:
        """Per module and phase: ops, FLOPs, bytes and time."""
        frame = self.frame()
        grouped = frame.groupby(["module", "phase"], sort=False).agg(
            ops=("op", "size"), flops=("flops", "sum"), bytes_read=("bytes_read", "sum"),
            bytes_written=("bytes_written", "sum"), time_s=("time_s", "sum"), first_op=("index", "min"))
        return grouped.reset_index().sort_values("first_op", kind="stable").reset_index(drop=True)

    def check_matches(self, graph: Graph) -> None:
        """Raise TraceMismatch unless this profile was taken of ``graph``'s step."""
        if tuple(op.name for op in graph.ops) != self.ops:
            raise TraceMismatch(f"this profile of {self.model_name!r} ({len(self.ops)} ops) was not taken of the "
                                f"step of graph {graph.model_name!r} ({len(graph.ops)} ops): profile the same "
                                "model, input shapes, loss and optimizer")


# The device sleeps this long before each timed op, so that the op's kernels are queued behind the sleep before it
# ends and its events time the kernels alone. Otherwise an idle device waits for the host between the events: on
# an H200 the median view, which runs no kernel, took 18 to 55 us (the host's pace under this mode), and the ops
# of GPT-2's step summed to 197 ms against a step of 84. What the host adds between ops in a plain step is the
# profile's overhead_per_op_s.
_DEVICE_LEAD_S = 300e-6


class _OpTimer(TorchDispatchMode):
    """Times every op the recorder records (see records_op), in order."""

    def __init__(self, cuda: bool) -> None:
        super().__init__()
        self.cuda = cuda
        self.names: list[str] = []
        self.times: list = []
        self.scratch: list[int] = []  # CUDA: each op's scratch bytes (Profile.scratch_bytes)
        self.host: list[float] = []  # CUDA: each op's host seconds to issue it (Profile.host_time_s)
        self.lead_cycles = _lead_cycles() if cuda else 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not records_op(func):
            return func(*args, **kwargs)
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            before = torch.cuda.memory_allocated()  # the allocator's books are kept on the host: no sync
            torch.cuda.reset_peak_memory_stats()
            torch.cuda._sleep(self.lead_cycles)
            start.record()
            issued = time.perf_counter()
            out = func(*args, **kwargs)
            self.host.append(time.perf_counter() - issued)
            end.record()
            self.times.append((start, end))
            self.scratch.append(max(0, torch.cuda.max_memory_allocated() - max(before, torch.cuda.memory_allocated())))
        else:
            begin = time.perf_counter()
            out = func(*args, **kwargs)
            self.times.append(time.perf_counter() - begin)
        self.names.append(str(func))
        return out

    def seconds(self) -> list[float]:
        if not self.cuda:
            return list(self.times)
        torch.cuda.synchronize()
        return [start.elapsed_time(end) / 1e3 for start, end in self.times]


def _lead_cycles() -> int:
    """Device clock cycles for ``_DEVICE_LEAD_S`` on the current device (torch.cuda._sleep counts cycles)."""
    rate_khz = getattr(torch.cuda.get_device_properties(torch.cuda.current_device()), "clock_rate", 0) or 2_000_000
    return int(_DEVICE_LEAD_S * rate_khz * 1e3)


def profile(model: torch.nn.Module | Workload, example_input: Any = None, loss_fn: Callable | None = None,
            optimizer: torch.optim.Optimizer | None = None, *, target: Any = None, device: str | None = None,
            repeats: int = 5, warmup: int = 1, name: str | None = None) -> Profile:
    """Profile one training step op by op on ``device`` (default: where the model is).

    With a ``device`` other than the model's, a copy of the model is profiled there; the
    model itself, and its optimizer, are always left as they were.
    """
    if repeats < 1:
        raise ValueError(f"repeats must be at least 1, got {repeats}")
    work = _on_device(as_workload(model, example_input, loss_fn=loss_fn, optimizer=optimizer, target=target,
                                  name=name), device)
    check_one_process(work, "profile")
    where = model_device(work.model)
    args, kwargs = split_input(map_tensors(lambda t: t.to(where), work.example_input))
    target = map_tensors(lambda t: t.to(where), work.target)
    scaler = grad_scaler(work.step_options, where)
    step = dict(loss_fn=work.loss_fn, target=target, optimizer=work.optimizer, options=work.step_options,
                scaler=scaler)
    with preserved(work.model, work.optimizer):
        for _ in range(warmup):
            run_step(work.model, args, kwargs, **step)
        with state_made_at_first_step(work.optimizer):  # no warm-up: the state of the parameters given a gradient
            graph = record_real_step(work.model, args, kwargs, target=target, loss_fn=work.loss_fn,
                                     optimizer=work.optimizer, name=work.name, device_type=where.type,
                                     options=work.step_options, scaler=scaler, track_saved=True)  # for the probes
        timed = [_timed_step(work.model, args, kwargs, step, where, graph) for _ in range(repeats)]
        # a step right after a timed one runs slower (the timing mode's Python has taken the caches): one untimed
        _plain_step(work.model, args, kwargs, step, where)
        plain = [_plain_step(work.model, args, kwargs, step, where) for _ in range(repeats)]
        per_op = [seconds for seconds, _, _ in timed]
        cuda = where.type == "cuda"
        scratch = tuple(int(max(column)) for column in zip(*(bytes_ for _, bytes_, _ in timed))) if cuda else None
        host_time = tuple(float(v) for v in np.median([host for _, _, host in timed], axis=0)) if cuda else None
        host, moded = [], []
        for _ in range(repeats):  # in turn, so that a change in the machine's load hits both alike
            host.append(_host_step(work.model, args, kwargs, step, where, None))
            moded.append(_host_step(work.model, args, kwargs, step, where, PassThroughMode()))
        times = np.array(per_op)
        time_s = tuple(float(v) for v in np.median(times, axis=0))
        dispatch_mode_op_s = max(0.0, statistics.median(moded) - statistics.median(host)) / max(len(graph.ops), 1)
        probed = ProbedStep(forward=lambda: _forward(work.model, args, kwargs, work.step_options, where),
                            run=lambda: run_step(work.model, args, kwargs, **step, replay_views=False), graph=graph,
                            device=where, step_time_s=statistics.median(plain), model=work.model,
                            op_host_s=host_time if cuda else _priced_op_times(statistics.median(plain), time_s),
                            dispatch_mode_op_s=dispatch_mode_op_s)
        stepped = _step_figures(probed, repeats)
    return Profile(
        model_name=work.name, device=where.type, device_name=device_name(where), torch_version=torch.__version__,
        measured_at=datetime.now(timezone.utc).isoformat(timespec="seconds"), graph_fingerprint=graph.fingerprint,
        ops=tuple(op.name for op in graph.ops), phases=tuple(op.phase for op in graph.ops),
        modules=tuple(op.module for op in graph.ops), flops=tuple(op.flops for op in graph.ops),
        bytes_read=tuple(op.bytes_read for op in graph.ops), bytes_written=tuple(op.bytes_written for op in graph.ops),
        time_s=time_s, time_min_s=tuple(float(v) for v in times.min(axis=0)),
        repeats=repeats, step_time_s=statistics.median(plain), threads=torch.get_num_threads(),
        dispatch_mode_op_s=dispatch_mode_op_s,
        **{figure: stepped.get(figure) for figure in _STEP_FIGURES},
        scratch_bytes=scratch, host_time_s=host_time,
    )


# what the step probes measure on the profiled step (NOTE [host probes] 4): Profile fields, None where unmeasured
_STEP_FIGURES = ("replay_op_s", "replay_recompute_s", "recording_step_s", "rerun_call_s", "hook_call_s",
                 "offload_action_s", "runtime_step_s", "copy_bytes_per_s")


def between_ops_s(step_time_s: float, op_times_s) -> float:
    """What a plain step of ``step_time_s`` spends outside its ops (Python, autograd), per op; never negative."""
    return max(0.0, (step_time_s - float(sum(op_times_s))) / max(len(op_times_s), 1))


def _priced_op_times(step_time_s: float, op_times_s: tuple[float, ...]) -> tuple[float, ...]:
    """Each op's seconds on a CPU as the cost model prices it (CostModel.op_times_s): its own and its share of what
    the step spends between ops. A probe takes them from what it times, so that what it leaves is not counted
    twice."""
    between = between_ops_s(step_time_s, op_times_s)
    return tuple(seconds + between for seconds in op_times_s)


def _forward(model: torch.nn.Module, args: tuple, kwargs: dict, options: StepOptions, where: torch.device) -> None:
    with autocast(options, where.type):
        model(*args, **kwargs)


def _step_figures(step: ProbedStep, repeats: int) -> dict[str, float]:
    """What the registered step probes measure on this step (NOTE [host probes] 4), in the order they were registered,
    each handed the figures before it (a later probe's figure replaces an earlier one's); a probe that fails leaves
    its figures out, with a warning naming the error."""
    figures: dict[str, float] = {}
    for probe in step_probes():
        try:
            figures.update(probe(step, repeats, dict(figures)).figures)
        except Exception as err:  # noqa: BLE001 - any failure of a probe leaves only its figures unmeasured
            warnings.warn(f"a step probe could not measure this step ({type(err).__name__}: {err}): the cost model "
                          "uses the machine's figures for what it measures", UnmeasuredFigureWarning, stacklevel=3)
    return figures


def _timed_step(model, args, kwargs, step: dict, where: torch.device,
                graph: Graph) -> tuple[list[float], list[int], list[float]]:
    """Each op's seconds, and on CUDA its scratch bytes (Profile.scratch_bytes) and host seconds to issue it."""
    timer = _OpTimer(cuda=where.type == "cuda")
    with timer:
        run_step(model, args, kwargs, **step)
    if timer.names != [op.name for op in graph.ops]:
        raise TraceMismatch(f"the timed step ran {len(timer.names)} ops, the recorded one {len(graph.ops)}: the "
                            "model does not run the same ops every step (data-dependent control flow?)")
    return timer.seconds(), timer.scratch, timer.host


def _host_step(model, args, kwargs, step: dict, where: torch.device, mode: PassThroughMode | None) -> float:
    """Host seconds of one step: until its last op is issued (on a GPU the device may still be running); on a CPU,
    the process's CPU time (other processes on the machine do not count)."""
    clock = time.perf_counter if where.type == "cuda" else time.process_time
    if where.type == "cuda":
        torch.cuda.synchronize(where)
    begin = clock()
    with mode if mode is not None else nullcontext():
        run_step(model, args, kwargs, **step)
    seconds = clock() - begin
    if where.type == "cuda":
        torch.cuda.synchronize(where)
    return seconds


def _plain_step(model, args, kwargs, step: dict, where: torch.device) -> float:
    """Seconds of one step as the user's training loop runs it: without view replay (NOTE [view replay] 3)."""
    if where.type == "cuda":
        torch.cuda.synchronize(where)
    begin = time.perf_counter()
    run_step(model, args, kwargs, **step, replay_views=False)
    if where.type == "cuda":
        torch.cuda.synchronize(where)
    return time.perf_counter() - begin



def _on_device(work: Workload, device: str | None) -> Workload:
    """The workload itself, or a copy of model and optimizer on ``device``."""
    if device is None or torch.device(device).type == model_device(work.model).type:
        return work
    model = copy.deepcopy(work.model).to(device)
    optimizer = None
    if work.optimizer is not None:
        twin = dict(zip(map(id, work.model.parameters()), model.parameters()))
        groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [twin[id(p)] for p in g["params"]]}
                  for g in work.optimizer.param_groups]
        optimizer = same_optimizer(work.optimizer, groups)
    return replace(work, model=model, optimizer=optimizer)
