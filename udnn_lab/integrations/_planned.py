"""What both trainer callbacks share: plan the step once, follow every later step with the runtime, measure each.

NOTE [trainer steps]
  1. A trainer's step is traced from what the trainer is about to run: its first micro-batch, its model as the
     trainer prepared it, its optimizer, precision, accumulation and clipping, with the loss computed by the
     trainer's own code (a StepLoss). The trace runs under fake tensors, so the model, its optimizer and the
     RNG are left as they were, and a step that would not fit is planned before it runs. Under DDP or FSDP2 each
     process traces its own rank, beside the job's process group (NOTE [one rank of N] 5), and its plan is
     followed on the trainer's DDP wrapper, whose module paths the rank's trace has, or on the model the strategy
     sharded in place (its plain copy is what the trace shards again: NOTE [unsharded copies]).
  2. The runtime is on from the first micro-batch of a step to the end of its optimizer step. It follows a
     plan by module and saved-tensor hooks only (NOTE [hook points]): what the trainer does outside the model
     between micro-batches (adding up the loss, logging) saves nothing for backward, so it is not the step's
     business. A plan that only a per-op dispatch mode can follow would count the trainer's own ops as the
     step's: it is refused when it is made.
  3. A plan is for one step's shapes and micro-batch count. A step whose batch has other shapes (the last,
     short batch of an epoch; padding to the longest sequence) or fewer micro-batches runs without the plan,
     as the trainer would run it, and is reported as unplanned. The check is made before each micro-batch;
     between micro-batches the runtime holds nothing (every saved tensor went with its backward), so it can
     be let go there.
  4. What the step does outside every module call in forward (the loss, and with it the trainer's own
     logging) is the trainer's code, which the trace sees only in part (a logger's copies of the loss are not
     traced). Recomputing there would need a dispatch mode counting those ops, so the tensors made there are
     planned as temporaries: kept, never moved or rebuilt (``module_bound``). Offloads act at hook calls, which
     the trainer's code does not make. Under DDP the step's code runs inside DDP's call, and under Lightning inside
     a call of the module itself (its forward redirected to training_step): those calls are the trainer's.
  5. An error inside a step lets the runtime go (hooks removed, host slices returned) before it reaches the
     trainer, which then handles it as it would without the callback.
  6. On a CPU one steady step's bytes are counted as it runs. A traced step holds all its micro-batches from
     its start; a trainer loads them as it goes (Lightning one batch ahead, Hugging Face's Trainer a step's
     worth before it), reading its data set, which is not the step's. The count pauses between micro-batches
     and takes each later one as held since the step began.
  7. FSDP2 makes each module's all-gather buffers in the first step that gathers it (its lazy state), so a
     sharded model's first step runs ops its later steps do not, which a plan's recorded recomputations would
     take for another step. Each sharded module is gathered and resharded once when the plan is made, on every
     rank at the same point, so that the first step is already the traced one and runs under the plan.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import pandas as pd
import torch
from torch.utils._pytree import tree_flatten

from udnn_lab.analysis import trace
from udnn_lab.errors import PlanError, PlanInfeasible
from udnn_lab.graph import Graph, ModuleCall, Plan
from udnn_lab.hardware import Hardware
from udnn_lab.parallel import FSDP
from udnn_lab.planning import op_by_op, quick_policies
from udnn_lab.planning import plan as make_plan
from udnn_lab.runtime import OffloadRuntime
from udnn_lab.runtime.live_bytes import LiveBytes, resident
from udnn_lab.sharded_model import gather_once
from udnn_lab.simulation import simulate
from udnn_lab.vocabulary import PLANNED_CATEGORIES
from udnn_lab.workload import Workload

LOG_PREFIX = "udnn/"


@dataclass(frozen=True)
class StepReport:
    """One trainer step under a callback: what was predicted for it and what it measured."""

    step: int  # the trainer's count of optimizer steps before this one
    planned: bool  # False: the step ran as the trainer runs it (NOTE [trainer steps] 3)
    predicted_peak_bytes: int
    measured_peak_bytes: int | None  # None: not measured (on the CPU one steady planned step is counted, op by op)
    predicted_step_s: float
    measured_step_s: float
    why_unplanned: str = ""

    def logs(self) -> dict[str, float]:
        """The figures a trainer's loggers take: numbers only, under ``udnn/``."""
        values: dict[str, float] = {"planned": float(self.planned), "predicted_peak_bytes": self.predicted_peak_bytes,
                                    "predicted_step_s": self.predicted_step_s,
                                    "measured_step_s": self.measured_step_s}
        if self.measured_peak_bytes is not None:
            values["measured_peak_bytes"] = self.measured_peak_bytes
        return {LOG_PREFIX + key: float(value) for key, value in values.items()}


def shapes_of(value: Any) -> tuple:
    """The shape and dtype of every tensor in a batch, in order: what a plan is for (NOTE [trainer steps] 3)."""
    leaves, _ = tree_flatten(value)
    return tuple((tuple(leaf.shape), leaf.dtype) for leaf in leaves if isinstance(leaf, torch.Tensor))


class PlannedSteps:
    """A budget (or a saved plan) made into a plan for a trainer's step, and the runtime carrying it out."""

    def __init__(self, budget: int | str | None, *, policy: str = "auto", plan: Plan | str | Path | None = None,
                 hardware: Hardware | str | None = None) -> None:
        if budget is None and plan is None:
            raise ValueError("give a budget (bytes or '6 GiB': what the step may use on the device) or a plan "
                             "saved with plan.save(path)")
        self.budget = budget
        self.policy = policy
        self.given_plan = plan
        self.hardware = hardware
        self.graph: Graph | None = None
        self.plan: Plan | None = None
        self.runtime: OffloadRuntime | None = None
        self.predicted_peak_bytes = 0
        self.predicted_step_s = 0.0
        self.reports: list[StepReport] = []
        self._batch_shapes: tuple = ()
        self._in_step = False
        self._why_unplanned = ""
        self._counter: LiveBytes | None = None
        self._counting_paused = False
        self._started = 0.0
        self._device = torch.device("cpu")
        self._model: torch.nn.Module | None = None  # not the Workload: its example batch would stay on the device
        self._optimizer: torch.optim.Optimizer | None = None
        self._step_number = 0

    @property
    def ready(self) -> bool:
        return self.runtime is not None

    def prepare(self, work: Workload, batch: Any, hooked: torch.nn.Module | None = None) -> None:
        """Trace ``work`` (the trainer's step), plan it or check the saved plan against it, simulate the plan.
        ``hooked``: the model whose module paths are the trace's, when not ``work.model`` (one DDP rank's)."""
        self.graph = module_bound(trace(work))
        self._device = torch.device(self.graph.device)
        self.plan = self._plan(self.graph)
        runtime_model = work.model if hooked is None else hooked
        runtime = OffloadRuntime(self.plan, model=runtime_model)
        if runtime.enabled and runtime.hook_schedule() is None:
            raise PlanError(f"the {self.plan.policy!r} plan for this step can only be followed op by op, which would "
                            "count the trainer's own ops as the step's (NOTE [trainer steps] 2): "
                            f"{self._followed_by_hooks(self.graph, runtime_model)}")
        simulation = simulate(self.graph, self.plan, self.hardware)
        self.predicted_peak_bytes = int(simulation.peak_bytes)
        self.predicted_step_s = float(simulation.step_time_s)
        self._batch_shapes = shapes_of(batch)
        self._model, self._optimizer = work.model, work.optimizer
        if isinstance(work.parallel, FSDP):
            gather_once(runtime_model)
        self.runtime = runtime

    def _plan(self, graph: Graph) -> Plan:
        given = self.given_plan
        if isinstance(given, Plan):
            given.check_belongs(graph)
            return given
        if given is not None:
            return Plan.load(given, graph)
        return make_plan(graph, self.budget, self.policy, self.hardware)

    def _followed_by_hooks(self, graph: Graph, model: torch.nn.Module) -> str:
        """What to ask for instead: the quick policies whose plan for the budget the runtime follows by hooks."""
        found = []
        for name in quick_policies():
            if self.plan is None or name == self.plan.policy or self.budget is None:
                continue
            try:
                other = make_plan(graph, self.budget, name, self.hardware)
            except (PlanError, PlanInfeasible):
                continue
            runtime = OffloadRuntime(other, model=model)
            if not runtime.enabled or runtime.hook_schedule() is not None:
                found.append(f"{name!r} ({simulate(graph, other, self.hardware).step_time_s * 1e3:.1f} ms)")
            runtime.release()
        why = op_by_op(self.plan) if self.plan is not None else ""
        larger = f"; this plan is {why}" if why else ""
        if not found:
            return "no other policy's plan for this budget is followed by hooks" + (larger or ": give a larger budget")
        return (f"policies whose plan for this budget is followed by hooks, with their step times: {', '.join(found)}"
                f"{larger}")

    def why_not(self, batch: Any, micro_batches: int, planned_micro_batches: int) -> str:
        """Why a step (or its next micro-batch) cannot run under the plan; '' when it can."""
        if micro_batches != planned_micro_batches:
            return (f"this step has {micro_batches} micro-batches where the plan's has {planned_micro_batches} "
                    "(the last, short step of an epoch)")
        shapes = shapes_of(batch)
        if shapes != self._batch_shapes:
            return (f"its batch is {_shapes_text(shapes)}, the planned step's {_shapes_text(self._batch_shapes)}: pad "
                    "batches to one length, or drop the last short batch (drop_last), to run every step planned")
        return ""

    @property
    def in_step(self) -> bool:
        return self._in_step

    def begin(self, step: int, batch: Any, micro_batches: int, planned_micro_batches: int) -> None:
        """Before a step's first micro-batch: start the clock, and the runtime when the step is the planned one."""
        assert self.runtime is not None
        self._step_number = step
        self._why_unplanned = self.why_not(batch, micro_batches, planned_micro_batches)
        if self._device.type == "cuda":
            torch.cuda.synchronize(self._device)
            torch.cuda.reset_peak_memory_stats(self._device)
        self._counter = None
        if not self._why_unplanned and self._device.type == "cpu" and self._steady() \
                and not any(r.measured_peak_bytes is not None for r in self.reports):
            assert self._model is not None  # prepared
            existing = resident(self._model, self._optimizer, None, [(batch, {}, None)])
            self._counter = LiveBytes(existing=existing)  # one steady planned step is counted
            self._counter.__enter__()
            self.runtime.observer = self._counter
        self._started = time.perf_counter()
        if not self._why_unplanned:
            self.runtime.__enter__()
        self._in_step = True

    def check_micro_batch(self, batch: Any) -> None:
        """Before a later micro-batch: let the plan go for the rest of the step when the batch is not the planned
        one (NOTE [trainer steps] 3); count its bytes again, with the batch held since the step began."""
        if self._in_step and not self._why_unplanned and shapes_of(batch) != self._batch_shapes:
            self._why_unplanned = self.why_not(batch, 1, 1)
            self._leave_runtime(completed=False)
        if self._counter is not None and self._counting_paused:
            self._counter.__enter__()
            self._counting_paused = False
            for tensor in tree_flatten(batch)[0]:
                if isinstance(tensor, torch.Tensor):
                    self._counter.adopt(tensor, held_since_the_start=True)

    def after_micro_batch(self) -> None:
        """After a micro-batch before the step's last: what the trainer does until the next (loading it, and the
        batch after it) is not the step's, whose micro-batches are all there from its start (NOTE [trainer steps]
        6), so the count pauses."""
        if self._counter is not None and not self._counting_paused:
            self._counter.__exit__(None, None, None)
            self._counting_paused = True

    def end(self) -> StepReport | None:
        """After the step's optimizer step: the runtime off, the step's report."""
        if not self._in_step:
            return None
        if not self._why_unplanned:
            self._leave_runtime(completed=True)
        if self._device.type == "cuda":
            torch.cuda.synchronize(self._device)
        elapsed = time.perf_counter() - self._started
        measured = self._measured_peak()
        self._in_step = False
        report = StepReport(self._step_number, not self._why_unplanned, self.predicted_peak_bytes, measured,
                            self.predicted_step_s, elapsed, self._why_unplanned)
        self.reports.append(report)
        return report

    def abort(self) -> None:
        """An error inside the step: let the runtime go and keep nothing (NOTE [trainer steps] 5)."""
        if self._in_step:
            self._in_step = False
            if not self._why_unplanned:
                self._leave_runtime(completed=False)
            self._close_counter()

    def close(self) -> None:
        """Training is over: give the host pool back."""
        self.abort()
        if self.runtime is not None:
            self.runtime.release()

    def _leave_runtime(self, completed: bool) -> None:
        assert self.runtime is not None
        error = None if completed else RuntimeError
        self.runtime.__exit__(error, None, None)
        self.runtime.observer = None

    def _steady(self) -> bool:
        """The optimizer holds its state, as in the traced step (NOTE [optimizer state of a traced step]): the
        first step makes it only in its optimizer step, so its peak is not the step's."""
        return self._optimizer is None or bool(self._optimizer.state)

    def _measured_peak(self) -> int | None:
        if self._device.type == "cuda":
            return int(torch.cuda.max_memory_allocated(self._device))
        counter = self._counter
        self._close_counter()
        return counter.peak if counter is not None else None

    def _close_counter(self) -> None:
        if self._counter is not None:
            counter, self._counter = self._counter, None
            if not self._counting_paused:
                counter.__exit__(None, None, None)
            self._counting_paused = False

    def frame(self) -> pd.DataFrame:
        """Every step's report as a DataFrame, a row each."""
        return pd.DataFrame([asdict(report) for report in self.reports])


def module_bound(graph: Graph) -> Graph:
    """``graph`` with the saved tensors made outside every forward module call planned as temporaries, which no
    plan moves or rebuilds (NOTE [trainer steps] 4); the same ops and sizes, so the same fingerprint."""
    by_path: dict[str, list[ModuleCall]] = {}
    for call in graph.module_calls:
        by_path.setdefault(call.path, []).append(call)
    inside: set[int] = set()
    for call in graph.module_calls:
        if not _the_trainer_s(call, by_path[call.path]):
            inside.update(range(call.first_op, call.last_op + 1))
    outside = {t.id for t in graph.tensors if t.category in PLANNED_CATEGORIES and t.producer is not None
               and graph.ops[t.producer].phase == "forward" and t.producer not in inside}
    if not outside:
        return graph
    return replace(graph, tensors=tuple(replace(t, category="temporary") if t.id in outside else t
                                        for t in graph.tensors))


def _the_trainer_s(call: ModuleCall, same_path: list[ModuleCall]) -> bool:
    """A call the trainer makes around the step's code rather than one the step makes: DDP's, and a module's call
    whose forward the trainer redirected to a step method (Lightning's training_step under DDP), which calls the
    module again inside itself (NOTE [trainer steps] 4). ``same_path``: every call of the module at its path."""
    return call.type == "DistributedDataParallel" or any(
        other is not call and call.first_op <= other.first_op and other.last_op <= call.last_op for other in same_path)


def _shapes_text(shapes: tuple) -> str:
    return ", ".join(f"{str(dtype).removeprefix('torch.')}[{', '.join(map(str, shape))}]" for shape, dtype in shapes)


class StepsShown:
    """What both callbacks show of the steps they planned (each is also its framework's callback class)."""

    steps: PlannedSteps

    @property
    def plan(self) -> Plan | None:
        """The plan every planned step runs under (None until the first batch is traced)."""
        return self.steps.plan

    @property
    def reports(self) -> list[StepReport]:
        return self.steps.reports

    def frame(self) -> pd.DataFrame:
        """Every step's predicted and measured figures, a row each."""
        return self.steps.frame()

