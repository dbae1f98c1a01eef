"""On CUDA the host issues each op in the time ul.profile measured, and the device waits for an op not issued yet
(NOTE [simulated streams] 9): the runtime's host work is hidden only by the slack the host's own pace leaves."""

import dataclasses

import numpy as np
import pytest

import udnn_lab as ul
from tests.simulation.profiles import roofline_profile
from udnn_lab import zoo
from udnn_lab.cost.model import CostModel
from udnn_lab.cost.profiling import Profile
from udnn_lab.hardware.profiles import Hardware
from udnn_lab.simulation.simulator import simulate_with

_SHIPPED = Hardware.load("h100-sxm")
H100 = dataclasses.replace(_SHIPPED, dispatch_mode_op_s=20e-6, replay_op_s=20e-6,
                           sources={**_SHIPPED.sources, "dispatch_mode_op_s": "set by the test",
                                    "replay_op_s": "set by the test"})


@pytest.fixture(scope="module")
def graph():
    return ul.trace(zoo.get("resnet18", batch=32, image_size=64, device="meta"), device="cuda")


def _profile(graph, host_s: float | None) -> Profile:
    """A CUDA profile of ``graph``'s step with the roofline's op times, each op ``host_s`` on the host to issue."""
    return roofline_profile(graph, H100, host_time_s=None if host_s is None else (host_s,) * len(graph.ops))


def _step_s(graph, plan, host_s: float | None) -> float:
    return simulate_with(graph, plan, CostModel(H100, _profile(graph, host_s))).step_time_s


def test_a_host_far_ahead_of_the_device_costs_nothing_and_one_slower_sets_the_step(graph):
    keep_all = ul.Plan.keep_all(graph)
    device = _step_s(graph, keep_all, None)
    assert _step_s(graph, keep_all, 1e-9) == pytest.approx(device, abs=1e-8)  # the first op waits for its issue
    slow = 2 * device / len(graph.ops)  # the host takes twice the device's step to issue it
    assert _step_s(graph, keep_all, slow) >= slow * len(graph.ops)


def test_the_runtime_s_host_work_is_paid_where_the_host_has_no_slack(graph):
    """A recompute plan's replays and recording windows cost host time: hidden behind a host far ahead of the device,
    paid in full by a host that issues ops as fast as the device runs them."""
    plan = ul.plan(graph, None, "recompute", hardware=H100)
    assert plan.recomputes
    keep_all = ul.Plan.keep_all(graph)
    times = CostModel(H100).op_times_s(graph)
    paced = float(np.median(times))  # the host issues as fast as the median op runs: short ops leave it no slack
    added_ahead = _step_s(graph, plan, 1e-9) - _step_s(graph, keep_all, 1e-9)
    added_paced = _step_s(graph, plan, paced) - _step_s(graph, keep_all, paced)
    assert added_paced > added_ahead


def test_the_host_waits_for_a_value_it_reads():
    """An op whose value the host reads (a GradScaler's inf check, ``.item()``) lets the host go on from its end: the
    lead it had is gone, and the next op waits for its issue."""
    work = zoo.get("resnet18", batch=32, image_size=64, device="meta", precision="16-mixed")
    graph = ul.trace(work, device="cuda")
    read = next(op.index for op in graph.ops if op.name == "aten._local_scalar_dense.default")
    host_s = 1e-5
    timeline = simulate_with(graph, ul.Plan.keep_all(graph), CostModel(H100, _profile(graph, host_s))).timeline
    ops = timeline[timeline["kind"] == "op"].set_index("op")
    assert ops.loc[read, "start_s"] > (read + 1) * host_s  # the host was ahead of the device until then
    assert ops.loc[read + 1, "start_s"] == pytest.approx(ops.loc[read, "end_s"] + host_s)


def test_a_profile_taken_on_a_cpu_has_no_host_times():
    work = zoo.get("mlp3", batch=4)
    assert ul.profile(work, repeats=1, warmup=0).host_time_s is None
