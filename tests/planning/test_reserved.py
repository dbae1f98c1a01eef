"""A budget counted in reserved bytes (planning/reserved.py): the caching allocator model's reserved peak of the
plan's step, plus what the process holds outside the allocator, within the budget."""

import re

import pytest

import udnn_lab as ul
from udnn_lab.planning import least_live_budget
from udnn_lab.planning.budget import _plan_live
from udnn_lab.planning.reserved import _Search, allocated_peak_bytes, reserved_peak_bytes
from udnn_lab.simulation.simulator import cost_model, simulate_with

H100 = "h100-sxm"


@pytest.fixture(scope="module")
def graph() -> ul.Graph:
    return ul.trace(ul.zoo.get("resnet50", batch=64, device="meta"), device="cuda")


@pytest.mark.parametrize("policy", ["auto", "vdnn++", "recompute"])
def test_the_reserved_peak_and_what_is_outside_the_allocator_fit_the_budget(graph, policy):
    budget, outside = int(graph.cuda_peak_bytes * 0.8), 300 * 2**20
    chosen = ul.plan(graph, budget, policy, hardware=H100, counts="reserved", outside_bytes=outside)
    reserved = reserved_peak_bytes(graph, chosen, ul.simulate(graph, chosen, hardware=H100))
    assert reserved + outside <= budget
    plain = ul.plan(graph, budget - outside, policy, hardware=H100)  # the same room, counted as allocated
    over = reserved_peak_bytes(graph, plain, ul.simulate(graph, plain, hardware=H100))
    assert over + outside > budget  # what counting allocated bytes alone would have run into
    assert chosen.budget_bytes < plain.budget_bytes and "predicted to reserve" in chosen.notes[-1]


def test_a_budget_no_plan_meets_in_reserved_bytes_says_so_in_one_line(graph):
    with pytest.raises(ul.PlanInfeasible) as raised:
        ul.plan(graph, int(graph.cuda_peak_bytes * 0.25), "vdnn++", hardware=H100, counts="reserved",
                outside_bytes="300 MiB")
    said = str(raised.value)
    assert "counted as reserved bytes" in said and "300.00 MiB outside the allocator" in said and "\n" not in said
    with pytest.raises(ul.PlanInfeasible, match="leaves nothing"):
        ul.plan(graph, "100 MiB", "auto", hardware=H100, counts="reserved", outside_bytes="200 MiB")


def test_reserved_bytes_need_a_cuda_step_and_a_known_count():
    cpu = ul.trace(ul.zoo.get("mlp5", batch=4))
    with pytest.raises(ValueError, match="needs a CUDA step"):
        ul.plan(cpu, "1 GiB", counts="reserved")
    with pytest.raises(ValueError, match="counts 'allocated' bytes"):
        ul.plan(cpu, "1 GiB", counts="live")


def test_the_error_names_the_last_plan_made_with_its_own_reserved_peak(graph):
    budget, outside = int(graph.cuda_peak_bytes * 0.33), 300 * 2**20  # planned at least once, never fitting
    with pytest.raises(ul.PlanInfeasible) as raised:
        ul.plan(graph, budget, "vdnn++", hardware=H100, counts="reserved", outside_bytes=outside)
    said = re.search(r"planned for ([\d.]+ \w+) allocated, it reserves ([\d.]+ \w+)", str(raised.value))
    assert said, str(raised.value)
    allocated = ul.parse_bytes(said.group(1).replace(" ", ""))
    # that plan again, in live bytes as the search plans (the figure is rounded)
    chosen = _plan_live(graph, cost_model(graph, H100, None, None, None), "vdnn++", allocated + 2**20, None,
                        whole_blocks=False)
    reserved = reserved_peak_bytes(graph, chosen, ul.simulate(graph, chosen, hardware=H100))
    assert reserved + outside > budget and abs(reserved - ul.parse_bytes(said.group(2).replace(" ", ""))) < 2**24


def test_a_reserved_peak_that_does_not_come_down_ends_the_search_above_zero():
    # on an H200 VGG-16's reserved peak stayed over as the allocated budget fell, and the doubling steps planned
    # for a negative budget (ValueError) instead of saying no plan fits
    search = _Search(room=1000, resolution=4)
    tried = []
    while search.next is not None and len(tried) < 20:
        tried.append(search.next)
        search.made(search.next, None, reserved=1500)
    assert tried and min(tried) >= 4 and search.best is None and search.plans == len(tried)


def test_on_cuda_a_plan_fits_its_budget_as_the_allocator_counts_allocated_bytes(graph):
    # NOTE [whole blocks]: on an H200 ConvNeXt-T's plans peaked 4 to 17 MiB above their simulated live bytes, the
    # blocks the caching allocator hands out whole, and went over budgets they met in live bytes
    cost = cost_model(graph, H100, None, None, None)
    live = _plan_live(graph, cost, "vdnn++", int(graph.cuda_peak_bytes * 0.7), None, whole_blocks=False)
    tight = ul.simulate(graph, live, hardware=H100).peak_bytes  # a budget the live bytes meet exactly
    assert allocated_peak_bytes(graph, live, ul.simulate(graph, live, hardware=H100)) > tight
    chosen = ul.plan(graph, tight, "vdnn++", hardware=H100, host_budget=None)
    assert allocated_peak_bytes(graph, chosen, ul.simulate(graph, chosen, hardware=H100)) <= tight
    assert "whole blocks" in chosen.notes[-1]
    smallest = ul.min_budget(graph, "vdnn++", hardware=H100)
    at_least = ul.plan(graph, smallest, "vdnn++", hardware=H100, host_budget=None)
    assert allocated_peak_bytes(graph, at_least, ul.simulate(graph, at_least, hardware=H100)) <= smallest


def test_auto_s_least_budget_on_cuda_is_its_plan_counted_lowest_and_plan_meets_it():
    # at auto's least budget of live bytes its fastest plan is counted higher, in whole blocks, than another of
    # its plans there; the least budget is the lower count, and plan() meets it with that plan
    graph = ul.trace(ul.zoo.get("resnet18", batch=8, device="meta"), device="cuda")
    cost = cost_model(graph, "h200", None, None, None)
    least = least_live_budget(graph, "auto", cost)
    fastest = _plan_live(graph, cost, "auto", least, None, whole_blocks=False)
    fastest_counted = allocated_peak_bytes(graph, fastest, simulate_with(graph, fastest, cost))
    smallest = ul.min_budget(graph, "auto", hardware="h200")
    assert least <= smallest < fastest_counted
    chosen = ul.plan(graph, smallest, hardware="h200", host_budget=None)
    assert simulate_with(graph, chosen, cost).fits
    assert allocated_peak_bytes(graph, chosen, simulate_with(graph, chosen, cost)) <= smallest
    assert "within" in chosen.notes[-1]
    least_said = re.escape(ul.format_bytes(smallest))
    with pytest.raises(ul.PlanInfeasible, match=f"the least budget that fits is {least_said}"):
        ul.plan(graph, smallest - 1, hardware="h200", host_budget=None)
