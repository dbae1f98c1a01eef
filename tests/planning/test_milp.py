"""The exact planner's program counts memory as the simulator does, or more: a recomputation's held sources and
what it makes at its op included, so that the solver's plan fits without a repair."""

import numpy as np
import pytest

import udnn_lab as ul
from udnn_lab import zoo
from udnn_lab.graph.plan_ir import Plan
from udnn_lab.planning import POLICIES, _exact_options
from udnn_lab.planning._exact_options import choice_of, menu
from udnn_lab.planning._milp import MIB, _Builder
from udnn_lab.simulation.simulator import cost_model, held_sources, simulate_with

pytest.importorskip("highspy")


@pytest.fixture(scope="module")
def transformer():
    graph = ul.trace(zoo.get("transformer", batch=4, device="meta"), device="cuda")
    return graph, cost_model(graph, "h100-sxm")


@pytest.fixture(scope="module")
def densenet():
    """Each layer reads every feature map before it in its block: several recomputations read one source."""
    graph = ul.trace(zoo.get("densenet121", batch=4, device="meta"), device="cuda")
    return graph, cost_model(graph, "h100-sxm")


def _program_and_simulated(graph, cost, plan):
    """(the program's bytes at each op for ``plan`` as a choice of its menu, the simulator's counted bytes at each
    op)."""
    keep = simulate_with(graph, Plan.keep_all(graph), cost)
    curve = keep.curve["cuda_live_bytes"].to_numpy(dtype=np.float64)
    sim = simulate_with(graph, plan, cost)
    binding = curve > sim.peak_bytes
    options = menu(graph, cost, keep.curve["start_s"].to_numpy(), binding, [(plan, dict(sim.released_before))])
    choice = choice_of(graph, options, plan, dict(sim.released_before), binding)
    assert choice is not None and len(choice.recomputes) == len(plan.recomputes)
    built = _Builder(options, np.ones(len(graph.ops)), 1.0, curve / MIB, sim.peak_bytes / MIB, None)
    values = built.encode(choice)
    for most, terms in built.maxima.items():  # each at the least its rows allow
        values[most] = max(scale * values[var] for var, scale in terms)
    away = np.zeros(len(curve))
    for op, terms in built.events.items():
        away[op:] += sum(values.get(var, 0.0) * mib for var, mib in terms.items()) * MIB
    counted, _ = sim.counted_by_op()
    return curve - away, counted


@pytest.mark.parametrize("model, policy", [("transformer", "recompute"), ("transformer", "checkpoint-segments"),
                                           ("densenet", "checkpoint-segments")])
def test_the_program_counts_at_least_what_the_simulator_counts_at_every_op(request, model, policy):
    graph, cost = request.getfixturevalue(model)
    budget = (graph.cuda_baseline_bytes + graph.cuda_peak_bytes) // 2
    plan = POLICIES[policy](graph, cost, budget)
    assert plan.recomputes
    program, simulated = _program_and_simulated(graph, cost, plan)
    short = simulated - program
    assert short.max() <= 1.0, (short.max(), short.argmax())


def test_sources_held_for_a_recomputation_are_counted_where_the_runtime_holds_them(transformer, monkeypatch):
    """Without the held sources the program counts less than the simulator: the test sees what it checks."""
    graph, cost = transformer
    budget = (graph.cuda_baseline_bytes + graph.cuda_peak_bytes) // 2
    plan = POLICIES["recompute"](graph, cost, budget)
    assert any(held_sources(graph, (r,)) for r in plan.recomputes)
    monkeypatch.setattr(_exact_options, "held_sources", lambda *a: {})
    program, simulated = _program_and_simulated(graph, cost, plan)
    assert (simulated - program).max() > 1.0


def test_a_source_several_recomputations_read_is_counted_once_until_the_last_of_them(densenet):
    """Counted once per reader, densenet121's sources came to 55 MiB (57.7 MB) more than the simulator holds, and the
    program put the plan's peak 16 MB over the simulated one."""
    graph, cost = densenet
    budget = (graph.cuda_baseline_bytes + graph.cuda_peak_bytes) // 2
    plan = POLICIES["recompute"](graph, cost, budget)
    readers: dict[int, int] = {}
    for recompute in plan.recomputes:
        for tensor in held_sources(graph, (recompute,)):
            readers[tensor] = readers.get(tensor, 0) + 1
    assert max(readers.values()) > 1
    program, simulated = _program_and_simulated(graph, cost, plan)
    assert (simulated - program).max() <= 1.0
    assert program.max() == pytest.approx(simulated.max(), abs=1.0)
