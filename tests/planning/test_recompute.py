"""Budget-aware recompute, and auto using the budget: on a small CNN sized for CUDA, on the H100 profile."""

import pytest
import torch
from torch.distributed.fsdp import MixedPrecisionPolicy

import udnn_lab as ul
from udnn_lab import zoo
from udnn_lab.graph.hook_points import hook_points
from udnn_lab.planning import POLICIES, least_live_budget, min_budget
from udnn_lab.planning._candidates import candidates
from udnn_lab.simulation.simulator import cost_model, simulate_with

HARDWARE = "h100-sxm"
BUDGETS = 6
TOLERANCE = 1e-12  # relative: sums of the same op times in another order


@pytest.fixture(scope="module")
def graph():
    return ul.trace(zoo.get("resnet18", batch=32, image_size=128, device="meta"), device="cuda")


@pytest.fixture(scope="module")
def cost(graph):
    return cost_model(graph, HARDWARE)


@pytest.fixture(scope="module")
def budgets(graph, cost):
    low, high = min_budget(graph, "recompute", cost=cost), graph.cuda_peak_bytes
    return [low + (high - low) * i // (BUDGETS - 1) for i in range(BUDGETS)]


def _time(graph, cost, policy, budget):
    sim = simulate_with(graph, POLICIES[policy](graph, cost, budget), cost)
    return sim.step_time_s if sim.fits else None


@pytest.mark.parametrize("policy", ["recompute", "auto"])
def test_step_time_falls_as_the_budget_grows(graph, cost, budgets, policy):
    times = [_time(graph, cost, policy, budget) for budget in budgets]
    assert None not in times, times
    assert all(later <= earlier * (1 + TOLERANCE) for earlier, later in zip(times, times[1:])), times
    assert times[0] > times[-1]  # at the minimum it recomputes something


def test_recompute_at_the_peak_is_keep_all_and_below_it_recomputes_only_what_it_must(graph, cost, budgets):
    keep = simulate_with(graph, POLICIES["keep-all"](graph, cost, None), cost)
    assert _time(graph, cost, "recompute", budgets[-1]) == keep.step_time_s
    segments = simulate_with(graph, POLICIES["checkpoint-segments"](graph, cost, budgets[-2]), cost)
    assert segments.fits and _time(graph, cost, "recompute", budgets[-2]) < segments.step_time_s
    plans = [POLICIES["recompute"](graph, cost, budget) for budget in budgets[1:]]
    rebuilt = [{t for r in plan.recomputes for t in r.tensors} for plan in plans]
    assert all(larger <= smaller for smaller, larger in zip(rebuilt, rebuilt[1:])), "a larger budget rebuilds more"


def test_auto_is_never_slower_than_any_policy_at_any_budget(graph, cost, budgets):
    for budget in budgets:
        fastest = _time(graph, cost, "auto", budget)
        for policy in POLICIES:
            if policy == "optimal":
                continue  # the exact reference: tests/planning/test_optimal.py
            other = _time(graph, cost, policy, budget)
            assert other is None or fastest <= other * (1 + TOLERANCE), (policy, budget)


def test_without_a_budget_recompute_reaches_as_low_as_segment_checkpointing(graph, cost):
    least = simulate_with(graph, POLICIES["recompute"](graph, cost, None), cost)
    segments = simulate_with(graph, POLICIES["checkpoint-segments"](graph, cost, None), cost)
    assert least.peak_bytes <= segments.peak_bytes < graph.cuda_peak_bytes
    assert least_live_budget(graph, "recompute", cost) <= least_live_budget(graph, "checkpoint-segments", cost)


def test_on_an_fsdp2_rank_a_tensor_is_restored_where_backward_takes_it_back_after_fsdp_s_gather():
    """FSDP2's pre-backward hook runs on a node's gradient before the node: its all-gather's ops come first in the
    node's backward, and the node takes its saved tensors back only after them. A tensor's restore point is that
    unpack, a hook point, not the node's first op (where a runtime following hooks could not act)."""
    work = zoo.get("hf:gpt2", batch=2, seq_len=32, small=True, optimizer="adam")
    graph = ul.trace(work, parallel=ul.FSDP(2, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16)))
    points = set(hook_points(graph.hook_events))
    found = candidates(graph)
    assert found and all(c.first_backward in points for c in found)
    gathered_first = [c for c in found if graph.ops[c.first_backward - 1].name.startswith("fsdp.")]
    assert gathered_first  # restored right after a gather's copy-out, which the node's first op precedes
