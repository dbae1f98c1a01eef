"""One job's process in the co-training study: it analyzes the job, then trains or profiles it on order.

The parent talks to each worker over its own pipe (NOTE [worker protocol]). Everything
here runs in the child, started with multiprocessing's 'spawn' context, so one job is one
process with its own CUDA context, as in document 004's study.

NOTE [worker protocol]
  1. Start. The worker sets its torch threads, builds the job on its device, traces it,
     and sends ("ready", pid, JobAnalysis), or ("error", None, traceback) and exits.
  2. Orders. ("run", RunOrder) trains: a fresh model each run, ``warmup`` + ``iterations``
     steps (``iterations`` None: until stopped), under a plan when the cap is below the
     job's keep-all need; each step is sent as ("iteration", run_id, step, end, time_s,
     interval_s): ``end`` on time.monotonic (one clock for every process of the machine),
     ``time_s`` the step itself, ``interval_s`` since the previous step's end. The run ends
     with ("run_done", run_id, facts). ("profile", run_id, repeats) sends ("profile",
     run_id, {op type: seconds}). ("stop", run_id) ends the current run after its step.
     ("quit",) ends the worker.
  3. Errors. An order that raises sends ("error", run_id, traceback) and the worker waits
     for the next order; the parent decides whether the job is out of the study. Running
     out of memory under a cap is not an error: the run ends with facts["oom"] set.
  4. Exit. A closed pipe (the parent is gone) or KeyboardInterrupt ends the worker quietly.
"""

from __future__ import annotations

import itertools
import os
import time
import traceback
from dataclasses import asdict, dataclass
from typing import Any

import torch

from udnn_lab import allocator
from udnn_lab.analysis.step import map_tensors
from udnn_lab.analysis.tracing import trace
from udnn_lab.cost.profiling import profile
from udnn_lab.devices import device_name
from udnn_lab.planning import min_budget
from udnn_lab.planning import plan as make_plan
from udnn_lab.runtime.training import train
from udnn_lab.sharing.jobs import JobSpec


@dataclass(frozen=True)
class JobAnalysis:
    """What the analyzer predicts for one job's training step, and the memory caps that follow (bytes)."""

    job: str
    model: str
    batch: int
    device: str
    device_name: str
    params_bytes: int
    ops: int
    peak_bytes: int  # predicted keep-all peak of the step (CUDA: rounded to the allocator's blocks)
    overhead_bytes: int  # the caching allocator's reserve above that peak (0 on a CPU: no caching allocator)
    need_bytes: int  # peak + overhead: what the job needs to run at full speed (principle 1)
    min_cap_bytes: int  # the smallest cap it can run under: the planner's minimum budget + overhead
    device_bytes: int  # the device's memory (a CPU's: physical RAM)
    analysis_s: float

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class RunOrder:
    """Train the job: ``warmup`` steps, then ``iterations`` (None: until stopped), under ``cap_bytes``."""

    run_id: int
    warmup: int
    iterations: int | None
    cap_bytes: int | None = None  # None: uncapped
    measure_peak: bool = False  # CPU: one more step with live bytes counted, for the measured peak
    min_seconds: float = 0.0  # and go on past ``iterations`` until the measured steps span this long
    max_iterations: int = 1_000_000


def analyze_job(spec: JobSpec, device: str = "cpu", work=None) -> tuple[JobAnalysis, Any]:
    """The job's predicted need and minimum on ``device``, and its Graph (for planning under caps)."""

    start = time.perf_counter()
    work = work if work is not None else spec.build(device)
    graph = trace(work, device=device)
    cuda = torch.device(device).type == "cuda"
    peak = graph.cuda_peak_bytes if cuda else graph.peak_bytes
    overhead = _allocator_overhead(graph, peak) if cuda else 0
    minimum = min_budget(graph, "auto")
    params = sum(p.numel() * p.element_size() for p in work.model.parameters())
    analysis = JobAnalysis(spec.name, spec.model, spec.batch, str(device), device_name(device), int(params),
                           len(graph.ops), int(peak), int(overhead), int(peak + overhead), int(minimum + overhead),
                           _device_bytes(device), time.perf_counter() - start)
    return analysis, graph


def _device_bytes(device: str) -> int:
    if torch.device(device).type == "cuda":
        return int(torch.cuda.get_device_properties(torch.device(device)).total_memory)
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def _allocator_overhead(graph, peak: int) -> int:
    reserved = allocator.replay(allocator.events_from_graph(graph)).reserved_peak_bytes
    return max(0, int(reserved) - int(peak))


def worker_main(spec: JobSpec, device: str, threads: int, conn, cores: tuple[int, ...] | None = None) -> None:
    """The child's entry point (a module-level function, so 'spawn' can find it); ``cores``: CPU affinity."""
    try:
        torch.set_num_threads(threads)
        try:
            torch.set_num_interop_threads(1)
        except RuntimeError:
            pass
        state = _start(spec, device, conn)
        if state is not None:
            if cores:  # after the analysis, so the jobs analyze in parallel on every core
                os.sched_setaffinity(0, cores)
            _serve(state, conn)
    except (KeyboardInterrupt, EOFError, BrokenPipeError):
        pass
    finally:
        conn.close()


@dataclass
class _State:
    spec: JobSpec
    device: str
    analysis: JobAnalysis
    graph: Any


def _start(spec: JobSpec, device: str, conn) -> _State | None:
    try:
        if torch.device(device).type == "cuda":  # an index from here on: set_device and the memory calls refuse "cuda"
            device = str(torch.device("cuda", torch.device(device).index or 0))
            torch.cuda.set_device(torch.device(device))
        analysis, graph = analyze_job(spec, device)
    except Exception:  # the job could not even be built: report it, the study goes on
        conn.send(("error", None, traceback.format_exc()))
        return None
    conn.send(("ready", os.getpid(), analysis))
    return _State(spec, device, analysis, graph)


def _serve(state: _State, conn) -> None:
    while True:
        order = conn.recv()
        kind = order[0]
        if kind == "quit":
            return
        if kind == "stop":  # a stop that arrived after its run had ended
            continue
        run_id = order[1].run_id if kind == "run" else order[1]
        try:
            if kind == "run":
                if _run(state, order[1], conn):
                    return
            elif kind == "profile":
                conn.send(("profile", run_id, _profile(state, order[2])))
            else:
                raise ValueError(f"unknown order {kind!r}")
        except Exception:
            conn.send(("error", run_id, traceback.format_exc()))


def _run(state: _State, order: RunOrder, conn) -> bool:
    """Carry out one RunOrder; True when a quit arrived during it."""

    cuda = torch.device(state.device).type == "cuda"
    work = state.spec.build(state.device)
    plan = _plan(state, order.cap_bytes)
    if cuda:
        _limit_cuda(state.device, order.cap_bytes)
    batch = _host_batch(work, cuda)
    control = _Control(conn, order)
    facts: dict[str, Any] = {"policy": plan.policy if plan is not None else "none",
                             "plan_budget_bytes": plan.budget_bytes if plan is not None else None,
                             "offloads": len(plan.offloads) if plan is not None else 0,
                             "recomputes": len(plan.recomputes) if plan is not None else 0, "oom": None}
    try:
        run = train(work.model, itertools.repeat(batch), work.optimizer, loss_fn=work.loss_fn, plan=plan,
                       steps=order.max_iterations, callbacks=[control], progress=False, track_memory=False,
                       name=state.spec.name)
        facts["peak_bytes"] = _peak(state, work, batch, plan, run, order.measure_peak)
    except torch.OutOfMemoryError as err:
        facts["oom"] = str(err).splitlines()[0]
    facts.update(iterations=control.count, end=time.monotonic(),
                 reserved_peak_bytes=int(torch.cuda.max_memory_reserved(state.device)) if cuda else None)
    conn.send(("run_done", order.run_id, facts))
    return control.quit


class _Control:
    """The train() callback: sends each step; stops on a stop order, or once the order's steps are done."""

    def __init__(self, conn, order: RunOrder) -> None:
        self.conn, self.order = conn, order
        self.count, self.quit = 0, False
        self.measuring_since: float | None = None
        self.last_end = time.monotonic()

    def __call__(self, row: dict) -> bool | None:
        now = time.monotonic()
        self.conn.send(("iteration", self.order.run_id, int(row["step"]), now, float(row["time_s"]),
                        now - self.last_end))
        self.last_end = now
        self.count += 1
        if self.count == self.order.warmup:
            self.measuring_since = now
        while self.conn.poll():
            order = self.conn.recv()
            if order[0] == "quit":
                self.quit = True
                return False
            if order[0] == "stop" and order[1] == self.order.run_id:
                return False
        return False if self._finished(now) else None

    def _finished(self, now: float) -> bool:
        order = self.order
        if order.iterations is None or self.count < order.warmup + order.iterations:
            return False
        return self.measuring_since is None or now - self.measuring_since >= order.min_seconds


def _plan(state: _State, cap: int | None):
    """None when the cap leaves the job its keep-all need; else the planner's plan for cap - overhead."""

    if cap is None or cap >= state.analysis.need_bytes:
        return None
    return make_plan(state.graph, max(cap - state.analysis.overhead_bytes, 1), "auto")


def _limit_cuda(device: str, cap: int | None) -> None:
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(device).total_memory
    torch.cuda.set_per_process_memory_fraction(1.0 if cap is None else min(1.0, cap / total), device)
    torch.cuda.reset_peak_memory_stats(device)


def _host_batch(work, cuda: bool):
    """(input, target) kept in host memory on CUDA, so every step copies its batch in, like an input pipeline."""

    pair = (work.example_input, work.target)
    if not cuda:
        return pair
    return map_tensors(lambda t: t.detach().cpu().pin_memory(), pair)


def _peak(state: _State, work, batch, plan, run, measure: bool) -> int | None:

    if torch.device(state.device).type == "cuda":
        return int(run.steps["peak_bytes"].max()) if len(run.steps) else None
    if not measure:
        return None
    tracked = train(work.model, [batch], work.optimizer, loss_fn=work.loss_fn, plan=plan, steps=1,
                       progress=False, track_memory=True)
    return int(tracked.steps["peak_bytes"].iloc[0])


def _profile(state: _State, repeats: int) -> dict[str, float]:
    """Seconds per op type (namespace, overload and in-place mark dropped: aten.add_.Tensor -> add)."""

    frame = profile(state.spec.build(state.device), repeats=repeats).frame()
    kinds = frame["op"].map(op_type)
    return {str(k): float(v) for k, v in frame.groupby(kinds)["time_s"].sum().items()}


def op_type(op: str) -> str:
    """'aten.add_.Tensor' -> 'add'; 'aten.mm.default' -> 'mm'."""
    parts = op.split(".")
    name = parts[1] if len(parts) >= 3 else parts[-1]
    return name.rstrip("_") or name
