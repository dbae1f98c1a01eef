"""pin-dp (document 001's knapsack) never pins fewer bytes than pin-greedy (GeePS), and both fit.

Budgets are drawn at random, on random small DAGs and on two zoo graphs where the knapsack's
rounding to memory units once cost it bytes: VGG-16 at batch 64 on the Titan X (Maxwell) and
ResNet-1001 at a small batch on the H100.
"""

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

import udnn_lab as ul
from tests.planning.random_dag import RandomDAG
from udnn_lab import zoo
from udnn_lab.planning.pinning import pin_dp, pin_greedy, pinned_bytes
from udnn_lab.simulation.simulator import cost_model, simulate_with


def _check(graph, cost, budget):
    dp, greedy = pin_dp(graph, cost, budget), pin_greedy(graph, cost, budget)
    dp_fits, greedy_fits = (simulate_with(graph, p, cost).fits for p in (dp, greedy))
    if greedy_fits:
        assert dp_fits, "pin-dp does not fit where pin-greedy does"
        assert pinned_bytes(graph, dp) >= pinned_bytes(graph, greedy), (pinned_bytes(graph, dp),
                                                                         pinned_bytes(graph, greedy))


@settings(max_examples=15, deadline=None)
@given(edges=st.lists(st.lists(st.integers(0, 20), min_size=1, max_size=3), min_size=3, max_size=9),
       width=st.sampled_from([256, 384]), batch=st.sampled_from([64, 96, 160]), fraction=st.floats(0.3, 1.0))
def test_on_random_graphs(edges, width, batch, fraction):
    graph = ul.trace(RandomDAG(width, edges), torch.randn(batch, width), device="cuda")
    _check(graph, cost_model(graph, "h100-sxm"), int(graph.cuda_peak_bytes * fraction))


ZOO = {"vgg16": (dict(batch=64), "titan-x-maxwell"), "resnet1001": (dict(batch=8), "h100-sxm")}


@pytest.fixture(scope="module", params=list(ZOO))
def zoo_case(request):
    sizes, hardware = ZOO[request.param]
    graph = ul.trace(zoo.get(request.param, device="meta", **sizes), device="cuda")
    return graph, cost_model(graph, hardware)


@settings(max_examples=6, deadline=None)
@given(fraction=st.floats(0.3, 1.0))
@example(fraction=0.84)  # both graphs: the rounded knapsack alone pinned less than greedy here
def test_on_zoo_graphs(zoo_case, fraction):
    graph, cost = zoo_case
    _check(graph, cost, int(graph.cuda_peak_bytes * fraction))
