"""Offloads spaced along forward's copy stream, completed by auto's greedy (planning/_spaced_offloads.py)."""

import numpy as np
import pytest

import udnn_lab as ul
from udnn_lab.planning import POLICIES
from udnn_lab.planning._candidates import first_backward_op
from udnn_lab.planning._spaced_offloads import spaced_offloads
from udnn_lab.planning.auto import _build, joint
from udnn_lab.simulation.simulator import cost_model, simulate_with


@pytest.fixture(scope="module")
def resnet50():
    """A CNN whose peak is at the start of backward: ResNet-50 at batch 32, its CUDA step on an H200's figures."""
    graph = ul.trace(ul.zoo.get("resnet50", batch=32, device="meta"), device="cuda")
    return graph, cost_model(graph, ul.Hardware.load("h200"))


def test_the_copies_out_run_one_after_another_and_end_before_backward(resnet50):
    graph, cost = resnet50
    spaced = spaced_offloads(graph, cost)
    assert len(spaced) >= 4
    starts = np.concatenate([[0.0], np.cumsum(cost.op_times_s(graph))])
    backward = starts[first_backward_op(graph)]
    free = 0.0
    for option in spaced:  # in forward order, each copy as its tensor is done, after the one before it
        start = starts[option.candidate.last_forward + 1]
        assert start >= free and start + option.d2h_s <= backward
        free = start + option.d2h_s
    plan = _build(graph, None, spaced)
    plan.validate(graph)
    assert simulate_with(graph, plan, cost).stall_time_s == 0.0  # every copy hidden by compute


def test_auto_takes_them_where_they_beat_its_greedy_alone(resnet50):
    graph, cost = resnet50
    budget = simulate_with(graph, ul.Plan.keep_all(graph), cost).peak_bytes // 2
    chosen = POLICIES["auto"](graph, cost, budget)
    assert chosen.chosen_policy.startswith("spaced offloads completed by auto-joint")
    step = simulate_with(graph, chosen, cost)
    assert step.fits
    for alone in (joint(graph, cost, budget), joint(graph, cost, budget, offloads=False)):
        assert step.step_time_s < simulate_with(graph, alone, cost).step_time_s * 0.98
