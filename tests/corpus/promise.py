"""Does a plan keep udnn_lab's promise on a model? ``check(entry, policy, budget_kind) -> dict``.

The promise: a plan made for a budget runs, gives eager's loss, gradients, parameters,
buffers, optimizer state and RNG state bit for bit, never goes over the budget, and its
simulation said beforehand what the measurement shows. On the CPU, with one thread:

1. trace the step (fake tensors) and plan it for the budget on ``HARDWARE``;
2. one eager step on a deep copy (a fresh optimizer of the same kind, warmed to its steady
   state as the trace assumes, seed ``SEED`` before the step);
3. two steps under ``OffloadRuntime(plan)``, given another deep copy (as ``ul.train`` gives its model), each
   counted by ``LiveBytes`` seeded with what exists before it (parameters, buffers,
   optimizer state, inputs, target); the first is compared with eager.

Every way it can go wrong is a failure kind (``KINDS``); the row's status is "ok" or the
kinds found, joined by ", ". Nothing raised inside a check escapes it.
"""

from __future__ import annotations

import copy
import functools
import gc
import time
import traceback
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch

import udnn_lab as ul
from tests.corpus.models import Entry
from udnn_lab.analysis.step import ensure_optimizer_state, input_tensors, run_step, split_input
from udnn_lab.errors import PlanInfeasible, PlanMismatch, ReplayError
from udnn_lab.planning import quick_policies
from udnn_lab.runtime.live_bytes import LiveBytes
from udnn_lab.workload import optimizer_like

HARDWARE = "cpu-amd-epyc-2cpu"
SEED = 0
BUDGET_KINDS = ("min", "min+10%", "midway")
# keep-all: once, budget None; the solver's policy has its own checks (tests/planning/test_optimal.py, the runtime's)
PLANNED_POLICIES = tuple(name for name in quick_policies() if name != "keep-all")
SIM_TOLERANCE = 0.01
KINDS = {
    "ReplayError": "the runtime could not replay a recomputation",
    "PlanMismatch": "the runtime refused the step as not the one planned",
    "PlanInfeasible": "no plan at a budget min_budget said the policy meets",
    "trace error": "ul.trace raised",
    "plan error": "min_budget, plan or simulate raised (not PlanInfeasible)",
    "runtime error": "the step under the runtime raised (not ReplayError or PlanMismatch)",
    "eager error": "the eager step raised",
    "runs what eager rejects": "eager raised, the runtime ran the same step without error",
    "loss differs": "loss not bit-equal to eager's",
    "grads differ": "a gradient not bit-equal to eager's",
    "params differ": "a parameter after the optimizer step not bit-equal to eager's",
    "buffers differ": "a buffer after the step not bit-equal to eager's",
    "optimizer state differs": "optimizer state after the step not bit-equal to eager's",
    "rng differs": "global or a model's own torch.Generator state after the step differs from eager's",
    "over budget": "measured peak above the budget",
    "measured above simulated": f"measured peak more than {SIM_TOLERANCE:.0%} above the simulated one",
    "measured below simulated": f"measured peak more than {SIM_TOLERANCE:.0%} below the simulated one",
    "unequal peaks": "the two steps under the runtime peaked differently",
}


@dataclass
class Outcome:
    """What one step left behind (tensors cloned), or the error it raised."""

    error: BaseException | None = None
    loss: torch.Tensor | None = None
    grads: list = field(default_factory=list)
    params: list = field(default_factory=list)
    buffers: list = field(default_factory=list)
    optimizer_state: list = field(default_factory=list)
    rng: list = field(default_factory=list)
    peaks: list = field(default_factory=list)


@dataclass(frozen=True)
class Subject:
    """A corpus entry's step, traced, with its eager outcome (shared by the checks of one model)."""

    work: ul.Workload
    graph: ul.Graph
    eager: Outcome


@functools.lru_cache(maxsize=1)
def subject(entry: Entry) -> Subject:
    work = entry.workload()
    graph = ul.trace(work)
    return Subject(work, graph, run(work, graded=graph.graded_parameters))


def budget_for(graph: ul.Graph, policy: str, budget_kind: str) -> int | None:
    if budget_kind == "none":
        return None
    low = ul.min_budget(graph, policy, hardware=HARDWARE)
    return {"min": low, "min+10%": int(low * 1.1), "midway": (low + graph.peak_bytes) // 2}[budget_kind]


def check(entry: Entry, policy: str, budget_kind: str) -> dict[str, Any]:
    """One (model, policy, budget kind): a flat row saying whether the promise held, and how it did not."""
    start = time.perf_counter()
    row: dict[str, Any] = {"model": entry.name, "policy": policy, "budget_kind": budget_kind, "budget_bytes": None,
                           "status": "ok", "measured_peak_bytes": None, "second_peak_bytes": None,
                           "simulated_peak_bytes": None, "over_budget_ratio": None, "sim_error": None,
                           "exact": None, "offloads": None, "recomputes": None, "followed_by": None, "error": ""}
    kinds: list[str] = []
    stage = "trace"
    with _isolated():
        try:
            found = subject(entry)
            stage = "plan"
            budget = budget_for(found.graph, policy, budget_kind)
            chosen = ul.plan(found.graph, budget, policy, hardware=HARDWARE)
            simulated = ul.simulate(found.graph, chosen, hardware=HARDWARE).peak_bytes
            row.update(budget_bytes=budget, simulated_peak_bytes=int(simulated), offloads=len(chosen.offloads),
                       recomputes=len(chosen.recomputes), keep_all_peak_bytes=found.graph.peak_bytes,
                       eager_peak_bytes=found.eager.peaks[0] if found.eager.peaks else None)
            stage = "runtime"
            runtime = ul.OffloadRuntime(chosen)
            outcome = run(found.work, runtime, graded=found.graph.graded_parameters)
            row["followed_by"] = runtime.follows
            kinds += _judge(row, found, outcome, budget, simulated)
        except Exception as err:  # every failure is a finding, not a crash
            kinds.append(error_kind(err, stage))
            row["error"] = describe(err)
    row["status"] = ", ".join(kinds) or "ok"
    row["seconds"] = round(time.perf_counter() - start, 3)
    return row


def _judge(row: dict, found: Subject, ran: Outcome, budget: int | None, simulated: int) -> list[str]:
    eager = found.eager
    if ran.error is not None:
        row["error"] = describe(ran.error)
        if eager.error is not None:
            row["refused_like_eager"] = True  # both refuse the step: eager's error came through, as promised
            return []
        return [error_kind(ran.error, "runtime")]
    if eager.error is not None:
        row["error"] = describe(eager.error)
        return ["eager error", "runs what eager rejects"]
    compared = (("loss differs", [eager.loss], [ran.loss]), ("grads differ", eager.grads, ran.grads),
                ("params differ", eager.params, ran.params), ("buffers differ", eager.buffers, ran.buffers),
                ("optimizer state differs", eager.optimizer_state, ran.optimizer_state))
    kinds = [kind for kind, a, b in compared if not same(a, b)]
    row["exact"] = not kinds
    if not same(eager.rng, ran.rng):
        kinds.append("rng differs")
    measured = max(ran.peaks)
    row.update(measured_peak_bytes=ran.peaks[0], second_peak_bytes=ran.peaks[1],
               sim_error=abs(simulated - measured) / measured)
    if budget is not None:
        row["over_budget_ratio"] = measured / budget
        if measured > budget:
            kinds.append("over budget")
    if row["sim_error"] > SIM_TOLERANCE:
        kinds.append("measured above simulated" if measured > simulated else "measured below simulated")
    if ran.peaks[0] != ran.peaks[1]:
        kinds.append("unequal peaks")
    return kinds


def run(work: ul.Workload, runtime: ul.OffloadRuntime | None = None, graded: frozenset[str] | None = None) -> Outcome:
    """One step (two under a runtime) on a deep copy of the model, with a fresh, warmed optimizer: with state for
    the parameters ``graded`` names (those that get a gradient, as earlier steps would leave it), or for all."""
    model = copy.deepcopy(work.model)
    if runtime is not None:
        runtime.for_model(model)  # the copy's modules are the ones it hooks, as ul.train's (NOTE [hook points] 8)
    optimizer = None
    if work.optimizer is not None:
        optimizer = optimizer_like(work.optimizer, model.parameters())
        ensure_optimizer_state(optimizer, graded=graded, model=model)
    outcome = Outcome()
    for step in range(1 if runtime is None else 2):
        try:
            loss, peak = _step(work, model, optimizer, runtime)
        except Exception as err:  # recorded, judged by the caller
            outcome.error = err
            return outcome
        outcome.peaks.append(peak)
        if step == 0:
            outcome.loss = loss.detach().clone()
            outcome.grads = [None if p.grad is None else p.grad.clone() for p in model.parameters()]
            outcome.params = [p.detach().clone() for p in model.parameters()]
            outcome.buffers = [b.clone() for b in model.buffers()]
            outcome.optimizer_state = _state_tensors(optimizer)
            outcome.rng = [torch.get_rng_state(), *(g.get_state() for g in generators(model))]
    return outcome


def _step(work: ul.Workload, model, optimizer, runtime) -> tuple[torch.Tensor, int]:
    args, kwargs = split_input(work.example_input)
    existing = [*model.parameters(), *model.buffers(), *_state_tensors(optimizer, clone=False),
                *input_tensors(args, kwargs), *input_tensors((work.target,), {})]
    torch.manual_seed(SEED)
    counter = LiveBytes(existing)
    if runtime is not None:
        runtime.observer = counter  # prefetched and replayed storages are made out of the counter's sight
    gc.disable()  # the trace runs without the garbage collector, and so does the step it is held to
    try:
        with counter, runtime or nullcontext():
            _, loss = run_step(model, args, kwargs, loss_fn=work.loss_fn, target=work.target, optimizer=optimizer,
                               options=work.step_options)
    finally:
        gc.enable()
    return loss, counter.peak


def _state_tensors(optimizer, clone: bool = True) -> list[torch.Tensor]:
    if optimizer is None:
        return []
    found = [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
    return [t.clone() for t in found] if clone else found


def generators(model: torch.nn.Module) -> list[torch.Generator]:
    """The torch.Generators a model's modules hold as attributes."""
    return [value for module in model.modules() for value in vars(module).values()
            if isinstance(value, torch.Generator)]


def same(a: list, b: list) -> bool:
    return len(a) == len(b) and all(x is y is None or (x is not None and y is not None and x.dtype == y.dtype
                                                       and torch.equal(x, y)) for x, y in zip(a, b))


def error_kind(err: BaseException, stage: str) -> str:
    for known in (ReplayError, PlanMismatch, PlanInfeasible):
        if isinstance(err, known):
            return known.__name__
    return f"{stage} error"


def describe(err: BaseException) -> str:
    lines = str(err).strip().splitlines()
    where = traceback.extract_tb(err.__traceback__)[-1] if err.__traceback__ else None
    at = f" (at {where.filename.rsplit('/', 1)[-1]}:{where.lineno})" if where else ""
    return f"{type(err).__name__}: {lines[0] if lines else ''}{at}"


class _isolated:
    """One thread; the caller's thread count, default dtype and RNG state as they were afterwards."""

    def __enter__(self):
        self.saved = torch.get_num_threads(), torch.get_default_dtype(), torch.get_rng_state()
        torch.set_num_threads(1)

    def __exit__(self, *exc):
        threads, dtype, rng = self.saved
        torch.set_num_threads(threads)
        torch.set_default_dtype(dtype)
        torch.set_rng_state(rng)
        return False
