"""optimal: the fastest plan that fits, found by a mixed-integer program (a reference for the other policies).

Per saved tensor it chooses keep, offload or recompute, minimizing the step time under the
budget, as Checkmate does for recomputation (and PyTorch's ``torch/distributed/_tools/sac_ilp.py``
per module), with offload added: the copy streams, the ops where memory is let go and taken
back, and the waits they cause are rows of the program (``_milp``). It is exact over a menu
of choices (``_exact_options``): a few release and prefetch ops per tensor, recomputations
that remake their inputs up to three levels back, the segments of segment checkpointing, and
the release and prefetch ops of every other policy's plan, so that each of those plans is one
of its choices; the fastest of them that fits is where the solver starts. Choices that free
nothing where the keep-all curve is over the budget are left out (they can only cost time).
HiGHS solves it (``pip install 'udnn_lab[exact]'``, which brings highspy) to within 0.1% of
the menu's best, within a time limit; a program too large to build, or a solve that does not
finish, raises SolverLimit.

How its time differs from the simulator's (NOTE [simulated streams]), which has the last word:
the program follows the same recursions (ops in order, one FIFO stream each way, a release op
waiting for its copy out, the first reader of a prefetched tensor waiting for its copy in,
recomputations before their op) for the plans it can express, so for those it predicts the
simulated step time up to float rounding (1.6e-15 of the step at most, over the solves of
tests/planning/test_optimal.py's graphs). It does not model the simulator's waits for memory
(a plan with explicit release points that fits at every op has none), copies through pageable
memory, or vDNN's per-layer waits: its own plans use none of them. Its memory is the keep-all
curve less what is away, op by op, as the simulator counts it, with what recomputations hold
beyond it (their sources, what they make: the largest of those run at one op, an upper bound
of the simulator's count). The plan it returns is simulated: if its peak is over the
budget (by the solver's tolerance), the program is solved again for a budget lowered by the
excess; if it still does not fit, the plan is returned as it is and ``ul.plan`` reports the
budget infeasible.
"""

from __future__ import annotations

import importlib.util
import time
from dataclasses import dataclass, replace

import numpy as np

from udnn_lab.cost.model import CostModel
from udnn_lab.errors import MissingDependency, SolverLimit
from udnn_lab.graph.plan_ir import Offload, Plan
from udnn_lab.graph.step_graph import Graph
from udnn_lab.planning._exact_options import Choice, Menu, choice_of, menu
from udnn_lab.planning._milp import GAP, Outcome, solve
from udnn_lab.planning.auto import joint
from udnn_lab.planning.registry import POLICIES, policy
from udnn_lab.planning.vdnn import pinned_pool_bytes
from udnn_lab.simulation.simulator import Simulation, simulate_with
from udnn_lab.units import format_bytes

NAME = "optimal"
TIME_LIMIT_S = 60.0
MAX_BINARIES = 100_000  # a larger program is not built; ResNet-1001 at batch 2 (42k) is built and solved in ~20 s
_REPAIRS = 3
_NOT_SEEDS = ("keep-all", "auto", "vdnn-dyn", NAME)  # auto and vdnn-dyn pick among the others


@dataclass(frozen=True)
class ExactPlan:
    """The exact planner's plan and what the solver said about it."""

    plan: Plan
    proven: bool  # the solver proved no choice of its menu is faster (within GAP); False at a time limit
    predicted_step_s: float | None  # the program's step time for the plan (None: nothing was solved)
    bound_s: float | None  # no choice of the menu is faster than this
    solve_s: float  # seconds in the solver, every solve included
    binaries: int  # binary choices of the (last) program


@policy(NAME, solver=True)
def optimal(graph: Graph, cost: CostModel, budget: int | None) -> Plan:
    return exact_plan(graph, cost, budget).plan


def exact_plan(graph: Graph, cost: CostModel, budget: int | None, time_limit_s: float = TIME_LIMIT_S,
               must_prove: bool = True, seeds: tuple[Plan, ...] | None = None) -> ExactPlan:
    """The fastest plan of the menu that fits ``budget``. ``seeds``: plans whose choices join the menu, the
    fastest that fits being where the solver starts (by default every other policy's plan at this budget).
    Without a budget, or one the step fits with every tensor kept, that is keeping everything. Raises
    SolverLimit when the program is too large, or (``must_prove``) when the solver does not prove its
    answer within ``time_limit_s``; without ``must_prove`` the best plan found is returned, unproven."""
    if importlib.util.find_spec("highspy") is None:
        raise MissingDependency("policy 'optimal' solves a mixed-integer program with HiGHS: "
                                "pip install 'udnn_lab[exact]' (or pip install highspy)")
    keep = simulate_with(graph, Plan.keep_all(graph), cost)
    if budget is None or keep.peak_bytes <= budget:
        kept = Plan(NAME, graph.fingerprint, budget, notes=("the step fits with every tensor kept",))
        return ExactPlan(kept, True, keep.step_time_s, keep.step_time_s, 0.0, 0)
    baseline = graph.cuda_baseline_bytes if graph.device == "cuda" else graph.baseline_bytes
    if baseline > budget:
        return _unfitting(graph, budget, f"what exists before the step ({format_bytes(baseline)}) is over it")
    curve = keep.curve["cuda_live_bytes" if graph.device == "cuda" else "live_bytes"].to_numpy(dtype=np.float64)
    seeded = [(s, simulate_with(graph, s, cost)) for s in (seeds if seeds is not None else _seeds(graph, cost, budget))]
    times = np.asarray(cost.op_times_s(graph), dtype=np.float64)
    target, found, seconds = budget, None, 0.0
    for _ in range(_REPAIRS):
        options = menu(graph, cost, keep.curve["start_s"].to_numpy(), curve > target,
                       [(s, dict(sim.released_before)) for s, sim in seeded])
        binaries = sum(len(o.releases) + len(o.prefetches) for o in options.offloads) + len(options.recomputes)
        if binaries > MAX_BINARIES:
            raise SolverLimit(f"the exact plan of {graph.model_name} would choose among {binaries} options "
                              f"(more than {MAX_BINARIES}): use policy 'auto', or a smaller graph (batch, depth)")
        start, upper = _start(graph, options, seeded, curve > target, target)
        began = time.perf_counter()
        outcome = solve(options, times, curve, target, time_limit_s, start, upper)
        if outcome.status == "infeasible" and start is not None:  # the start's time, as a bound, cut too deep
            outcome = solve(options, times, curve, target, time_limit_s)
        seconds += time.perf_counter() - began
        if outcome.choice is None:
            if outcome.status == "infeasible":
                break
            raise SolverLimit(f"no plan of {graph.model_name} under {format_bytes(budget)} was found in "
                              f"{time_limit_s:g} s ({outcome.binaries} binary choices; solver: {outcome.status}): "
                              "give it longer (exact_plan(..., time_limit_s=...)), or use policy 'auto'")
        found = _exact(graph, budget, options, outcome, seconds)
        if must_prove and not found.proven:
            raise SolverLimit(f"the exact plan of {graph.model_name} under {format_bytes(budget)} was not proven in "
                              f"{time_limit_s:g} s ({outcome.binaries} binary choices): the best found takes "
                              f"{_ms(outcome.step_s)}, none can take less than {_ms(outcome.bound_s)}; give it "
                              "longer (exact_plan(..., time_limit_s=...)), or use policy 'auto'")
        peak = simulate_with(graph, found.plan, cost).peak_bytes
        if peak <= budget:
            return found
        target -= peak - budget  # the solver's tolerance let it over: aim that much lower
    if found is None:
        return _unfitting(graph, budget, "no choice of its menu fits")
    return _seed_instead(graph, cost, budget, seeded, found)


def _seed_instead(graph: Graph, cost: CostModel, budget: int, seeded: list[tuple[Plan, Simulation]],
                  found: ExactPlan) -> ExactPlan:
    """After its repairs the solver's plan is still over ``budget`` in simulation: the fastest seed that fits, as
    this planner's plan and unproven (the solver's bound stands), or no plan."""
    fitting = [(plan, sim) for plan, sim in seeded if sim.peak_bytes <= budget]
    if not fitting:  # not proven: another choice of the menu may fit
        unfitting = _unfitting(graph, budget, f"its best choice still peaks over it after {_REPAIRS} repairs, and "
                                              "no other policy's plan fits")
        return replace(unfitting, proven=False, bound_s=found.bound_s, solve_s=found.solve_s,
                       binaries=found.binaries)
    plan, sim = min(fitting, key=lambda pair: pair[1].step_time_s)
    note = (f"the solver's plans peaked over the budget after {_REPAIRS} repairs: {plan.policy}'s plan, the fastest "
            f"that fits; none is faster than {_ms(found.bound_s)}")
    named = replace(plan, policy=NAME, chosen_policy=plan.chosen_policy or plan.policy, notes=(note,))
    return ExactPlan(named, False, sim.step_time_s, found.bound_s, found.solve_s, found.binaries)


def _start(graph: Graph, options: Menu, seeded: list[tuple[Plan, Simulation]], binding: np.ndarray,
           budget: int) -> tuple[Choice | None, float | None]:
    """The fastest seed that fits, as a choice of the menu, and its step time (a bound on the optimum)."""
    for plan, sim in sorted(seeded, key=lambda s: s[1].step_time_s):
        if sim.peak_bytes <= budget:
            choice = choice_of(graph, options, plan, dict(sim.released_before), binding)
            if choice is not None:
                return choice, sim.step_time_s * (1 + 1e-3)
    return None, None


def _exact(graph: Graph, budget: int, options: Menu, outcome: Outcome, seconds: float) -> ExactPlan:
    choice = outcome.choice
    assert choice is not None  # the caller raised otherwise
    offloads = tuple(sorted((Offload(options.offloads[i].candidate.tensor, options.offloads[i].candidate.last_forward,
                                     prefetch, release_before=release)
                             for i, release, prefetch in choice.offloads), key=lambda o: (o.after_op, o.tensor)))
    recomputes = tuple(sorted((options.recomputes[j].action for j in choice.recomputes),
                              key=lambda r: (r.at_op, r.tensors)))
    proven = outcome.status == "optimal"
    note = (f"the fastest of {outcome.binaries} binary choices (within {GAP:.1%})" if proven else
            f"the best of {outcome.binaries} binary choices found in time; none is faster than {_ms(outcome.bound_s)}")
    plan = Plan(NAME, graph.fingerprint, budget, offloads=offloads, recomputes=recomputes,
                pinned_pool_bytes=pinned_pool_bytes(graph, offloads), notes=(note,))
    return ExactPlan(plan, proven, outcome.step_s, outcome.bound_s, seconds, outcome.binaries)


def _seeds(graph: Graph, cost: CostModel, budget: int) -> tuple[Plan, ...]:
    plans = [POLICIES[name](graph, cost, budget) for name in POLICIES if name not in _NOT_SEEDS]
    return (*plans, joint(graph, cost, budget), joint(graph, cost, budget, queued=False))


def _unfitting(graph: Graph, budget: int, why: str) -> ExactPlan:
    plan = Plan(NAME, graph.fingerprint, budget, notes=(f"no plan fits {format_bytes(budget)}: {why}",))
    return ExactPlan(plan, True, None, None, 0.0, 0)


def _ms(seconds: float | None) -> str:
    return "?" if seconds is None else f"{seconds * 1e3:.3f} ms"
