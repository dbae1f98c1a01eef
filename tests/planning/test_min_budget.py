"""auto's least budget (in live bytes: ``least_live_budget``, what ``ul.min_budget`` is on a CPU step, and on
CUDA less the caching allocator's whole blocks) is the least of the joint problem: the exact planner fits nothing
lower.

It searches to a resolution of 1/512 of the keep-all peak; the exact planner is asked for a plan one
resolution step under auto's least budget, and must find none that fits (a plan that fits there would be a
budget auto misses), while at auto's own least budget it finds one.
"""

import pytest

import udnn_lab as ul
from udnn_lab import zoo
from udnn_lab.planning import least_live_budget
from udnn_lab.planning.optimal import exact_plan
from udnn_lab.simulation.simulator import cost_model, simulate_with

pytest.importorskip("highspy")

pytestmark = pytest.mark.slow  # the solver, once per graph

HARDWARE = "h100-sxm"
RESOLUTION = 1 / 512


@pytest.mark.parametrize(("name", "batch"), [("mlp3", 64), ("resnet20", 8), ("lstm", 16), ("transformer", 4)])
def test_auto_reaches_the_exact_planner_s_least_budget(name, batch):
    graph = ul.trace(zoo.get(name, batch=batch, device="meta"), device="cuda")
    cost = cost_model(graph, HARDWARE)
    auto_least = least_live_budget(graph, "auto", cost)
    below = auto_least - int(graph.cuda_peak_bytes * RESOLUTION) - 1
    assert graph.cuda_baseline_bytes < below < auto_least
    def fits(budget: int) -> bool:
        return simulate_with(graph, exact_plan(graph, cost, budget, time_limit_s=10.0, must_prove=False).plan,
                             cost).fits

    assert fits(auto_least)  # the exact planner finds what auto found
    assert not fits(below), f"the exact planner fits {below} bytes, under auto's least budget {auto_least}"
