"""auto's local search from the plan it chose (planning/_local_search.py)."""

from dataclasses import replace

import pytest

import udnn_lab as ul
from udnn_lab.planning import POLICIES, _local_search
from udnn_lab.planning._local_search import LOCAL_SEARCH, improved
from udnn_lab.planning.auto import joint
from udnn_lab.planning.host import plan_host_bytes
from udnn_lab.simulation.simulator import cost_model, simulate_with


@pytest.fixture(scope="module")
def resnet50():
    """ResNet-50 at batch 32, its CUDA step on an H200's figures: a peak at the start of backward."""
    graph = ul.trace(ul.zoo.get("resnet50", batch=32, device="meta"), device="cuda")
    cost = cost_model(graph, ul.Hardware.load("h200"))
    return graph, cost, simulate_with(graph, ul.Plan.keep_all(graph), cost).peak_bytes


def _completion(graph, cost, budget):
    return lambda base, more: joint(graph, cost, budget, base, offloads=more)


def _step(graph, cost, plan):
    sim = simulate_with(graph, plan, cost)
    assert sim.fits
    return sim.step_time_s


def test_an_action_the_plan_no_longer_needs_is_dropped(resnet50):
    graph, cost, peak = resnet50
    budget = int(peak * 0.7)
    plan = POLICIES["recompute"](graph, cost, budget)
    spare = next(r for r in POLICIES["recompute"](graph, cost, peak // 2).recomputes
                 if r not in plan.recomputes)
    padded = replace(plan, recomputes=(*plan.recomputes, spare))
    padded_s = _step(graph, cost, padded)
    assert padded_s > _step(graph, cost, plan)  # the spare recomputation only adds time
    found = improved(graph, cost, padded, padded_s, _completion(graph, cost, budget))
    found.validate(graph)
    assert spare not in found.recomputes and _step(graph, cost, found) < padded_s
    assert found.policy.endswith(LOCAL_SEARCH)


def test_a_dear_plan_is_replaced_by_a_faster_one_that_fits(resnet50):
    graph, cost, peak = resnet50
    budget = peak // 2
    start = POLICIES["checkpoint-segments"](graph, cost, budget)
    start_s = _step(graph, cost, start)
    found = improved(graph, cost, start, start_s, _completion(graph, cost, budget))
    found.validate(graph)
    assert _step(graph, cost, found) < start_s * 0.95


def test_with_a_host_budget_every_plan_it_takes_keeps_within_it(resnet50):
    graph, cost, peak = resnet50
    budget = peak // 2
    start = POLICIES["checkpoint-segments"](graph, cost, budget)
    unbounded = improved(graph, cost, start, _step(graph, cost, start), _completion(graph, cost, budget))
    assert unbounded.offloads  # without a host budget, the best it finds copies some tensors out
    host_budget = plan_host_bytes(graph, unbounded) // 4
    found = improved(graph, cost, start, _step(graph, cost, start), _completion(graph, cost, budget), host_budget)
    assert plan_host_bytes(graph, found) <= host_budget and _step(graph, cost, found) <= _step(graph, cost, start)


def test_it_stops_at_its_bound_in_work_not_seconds(resnet50, monkeypatch):
    graph, cost, peak = resnet50
    budget = peak // 2
    start = POLICIES["checkpoint-segments"](graph, cost, budget)
    monkeypatch.setattr(_local_search, "OP_SIMULATIONS", len(graph.ops))  # one simulation
    assert improved(graph, cost, start, _step(graph, cost, start), _completion(graph, cost, budget)) is start


def test_auto_says_when_its_plan_came_from_the_search(resnet50):
    graph, cost, peak = resnet50
    plan = POLICIES["auto"](graph, cost, peak // 2)
    assert plan.chosen_policy.endswith(LOCAL_SEARCH)
    segments = POLICIES["checkpoint-segments"](graph, cost, plan.budget_bytes)
    assert _step(graph, cost, plan) <= _step(graph, cost, segments)
