"""auto's contenders (planning/auto.py): checkpointed blocks, and where the local search starts from."""

import udnn_lab as ul
import udnn_lab.planning.auto as auto
from udnn_lab.planning import POLICIES, recompute, segments
from udnn_lab.simulation.simulator import cost_model, simulate_with

BUDGET = 497_429_577  # the zoo transformer's second budget in plan_optimality.json: 43% of its keep-all peak


def test_checkpointing_the_first_layers_completed_by_the_greedy_is_a_contender(transformer, monkeypatch):
    graph, cost = transformer
    chosen = POLICIES["auto"](graph, cost, BUDGET)
    with_blocks = simulate_with(graph, chosen, cost)
    assert with_blocks.fits and chosen.chosen_policy.startswith(auto.BLOCKS)
    monkeypatch.setattr(auto, "_checkpointed_blocks", lambda *args: [])
    every = segments.segment_plans  # and no policy's plan checkpoints blocks
    def no_blocks(*args):
        return tuple(plan for plan in every(*args) if not plan.notes[0].startswith("checkpointed "))

    monkeypatch.setattr(segments, "segment_plans", no_blocks)
    monkeypatch.setattr(recompute, "segment_plans", no_blocks)
    without = POLICIES["auto"](graph, cost_model(graph, ul.Hardware.load("h100-sxm")), BUDGET)
    # 16.5 ms against 26.7 (the exact planner's best in a minute: 15.8)
    assert with_blocks.step_time_s < simulate_with(graph, without, cost).step_time_s * 0.7


def test_the_blocks_contenders_are_the_least_prefix_that_fits_and_the_one_below_it_completed(transformer):
    graph, cost = transformer
    plans = auto._checkpointed_blocks(graph, cost, BUDGET)
    fitting_alone, *completed = plans
    assert fitting_alone.policy == auto.BLOCKS and simulate_with(graph, fitting_alone, cost).fits
    below = fitting_alone.recomputes[:-1]  # the first n - 1 calls' recomputations
    assert not simulate_with(graph, ul.Plan(auto.BLOCKS, graph.fingerprint, BUDGET, recomputes=below), cost).fits
    assert len(completed) == 2 and {p.policy for p in completed} == {f"{auto.BLOCKS} completed by auto-joint"} | {
        f"{auto.BLOCKS} completed by auto-joint (recompute only)"}
    for plan in completed:
        assert set(below) <= set(plan.recomputes)
    assert not any(p.offloads for p in completed if "recompute only" in p.policy)
