"""ul.min_budget(graph, "auto") is the least budget of the joint problem: the exact planner fits nothing lower.

The exact planner's least budget is found by bisection on whether its plan fits, to the same
resolution as min_budget's own search (1/512 of the keep-all peak); auto's may not be above it
by more than that.
"""

import pytest

import udnn_lab as ul
from udnn_lab import zoo
from udnn_lab.planning import min_budget
from udnn_lab.planning.optimal import exact_plan
from udnn_lab.simulation.simulator import cost_model, simulate_with

pytest.importorskip("highspy")

pytestmark = pytest.mark.slow  # the solver is asked a dozen times per graph

HARDWARE = "h100-sxm"
RESOLUTION = 1 / 512


def _exact_minimum(graph, cost, above: int) -> int:
    """The least budget (to RESOLUTION of the peak) the exact planner fits, searched below ``above``."""
    def fits(budget: int) -> bool:
        plan = exact_plan(graph, cost, budget, time_limit_s=30.0, must_prove=False).plan
        return simulate_with(graph, plan, cost).fits

    step = max(1, int(graph.cuda_peak_bytes * RESOLUTION))
    low, high = graph.cuda_baseline_bytes, above
    while high - low > step:
        middle = (low + high) // 2
        low, high = (low, middle) if fits(middle) else (middle, high)
    return high


@pytest.mark.parametrize(("name", "batch"), [("mlp3", 64), ("resnet20", 8), ("lstm", 16), ("transformer", 4)])
def test_auto_reaches_the_exact_planner_s_least_budget(name, batch):
    graph = ul.trace(zoo.get(name, batch=batch, device="meta"), device="cuda")
    cost = cost_model(graph, HARDWARE)
    auto_least = min_budget(graph, "auto", cost=cost)
    exact_least = _exact_minimum(graph, cost, above=graph.cuda_peak_bytes)
    assert auto_least <= exact_least + graph.cuda_peak_bytes * RESOLUTION, (auto_least, exact_least)
