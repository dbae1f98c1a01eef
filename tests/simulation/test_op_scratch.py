"""An op's scratch (cuDNN's workspaces), measured on CUDA by ul.profile, counts while the op runs (NOTE [simulated
streams] 8)."""

import numpy as np
import pytest

import udnn_lab as ul
from tests.simulation.profiles import roofline_profile
from udnn_lab import zoo
from udnn_lab.cost.model import CostModel
from udnn_lab.cost.profiling import Profile
from udnn_lab.hardware.profiles import Hardware
from udnn_lab.simulation.simulator import simulate_with

H100 = Hardware.load("h100-sxm")


@pytest.fixture(scope="module")
def graph():
    return ul.trace(zoo.get("resnet18", batch=64, image_size=224, device="meta"), device="cuda")


def _profile(graph, scratch: dict[int, int]) -> Profile:
    """A CUDA profile of ``graph``'s step with the roofline's op times and ``scratch`` bytes at the ops named."""
    return roofline_profile(graph, H100, scratch_bytes=tuple(scratch.get(i, 0) for i in range(len(graph.ops))))


def _first(graph, name: str, phase: str) -> int:
    return next(op.index for op in graph.ops if op.name == name and op.phase == phase)


def test_a_workspace_counts_on_top_of_what_is_live_at_its_op(graph):
    conv = _first(graph, "aten.convolution_backward.default", "backward")
    live = graph.memory_curve()["cuda_live_bytes"].to_numpy()
    workspace = 3 * 2**30
    plain = simulate_with(graph, ul.Plan.keep_all(graph), CostModel(H100, _profile(graph, {})))
    with_it = simulate_with(graph, ul.Plan.keep_all(graph), CostModel(H100, _profile(graph, {conv: workspace})))
    assert plain.peak_bytes == graph.cuda_peak_bytes
    assert with_it.peak_bytes == max(plain.peak_bytes, int(live[conv]) + workspace)
    assert with_it.peak_bytes > plain.peak_bytes  # the workspace is larger than the headroom at that op


def test_a_plan_made_without_it_goes_over_a_plan_made_with_it_fits(graph):
    """The GPU run's finding: a plan that moved the peak into early backward met a convolution's workspace there."""
    convs = [op.index for op in graph.ops if op.name == "aten.convolution_backward.default"]
    scratch = {index: 64 * 2**20 for index in convs}
    measured = CostModel(H100, _profile(graph, scratch))
    budget = int(graph.cuda_peak_bytes * 0.75)
    blind = ul.plan(graph, budget, "auto", hardware=H100, profile=_profile(graph, {}))
    assert not simulate_with(graph, blind, measured).fits
    seeing = ul.plan(graph, budget, "auto", hardware=H100, profile=_profile(graph, scratch))
    assert simulate_with(graph, seeing, measured).fits


def test_a_recomputations_workspace_counts_at_the_op_it_runs_before(graph):
    plan = ul.plan(graph, None, "recompute", hardware=H100)
    recompute = next(r for r in plan.recomputes if any(graph.ops[j].name == "aten.convolution.default"
                                                         for j in r.ops))
    conv = next(j for j in recompute.ops if graph.ops[j].name == "aten.convolution.default")
    workspace = 4 * 2**30  # larger than any headroom: the peak is where it counts
    sim = simulate_with(graph, plan, CostModel(H100, _profile(graph, {conv: workspace})))
    curve = simulate_with(graph, plan, CostModel(H100, _profile(graph, {}))).memory_curve()
    counted = curve["cuda_live_bytes"].to_numpy()
    assert sim.peak_bytes == max(int(counted[conv]), int(counted[recompute.at_op])) + workspace


def test_without_a_cuda_profile_there_is_none():
    graph = ul.trace(zoo.get("mlp3", batch=4))
    assert ul.profile(zoo.get("mlp3", batch=4), repeats=1).scratch_bytes is None
    assert simulate_with(graph, ul.Plan.keep_all(graph), CostModel(Hardware.load("cpu-amd-epyc-2cpu"))).peak_bytes \
        == graph.peak_bytes


@pytest.mark.gpu
def test_cuda_profiles_measure_convolution_workspaces():
    profile = ul.profile(zoo.get("resnet18", batch=32, image_size=224), device="cuda", repeats=1)
    scratch = np.array(profile.scratch_bytes)
    convs = np.array([name.startswith("aten.convolution") for name in profile.ops])
    assert scratch.shape == (len(profile.ops),) and (scratch >= 0).all()
    assert scratch[convs].max() > 0  # cuDNN takes a workspace for some convolution at this size


def test_the_caching_allocator_model_reserves_for_an_op_s_scratch_too(graph):
    """NOTE [event order of a step] 5: a workspace is a block the allocator must find while its op runs: what it
    reserves holds the live tensors and the workspace at that op (the simulated peak with scratch), where it held
    far less without it."""
    from udnn_lab.allocator import events_from_simulation
    from udnn_lab.planning.reserved import reserved_peak_bytes

    conv = _first(graph, "aten.convolution_backward.default", "backward")
    workspace = 3 * 2**30
    keep_all = ul.Plan.keep_all(graph)
    plain = simulate_with(graph, keep_all, CostModel(H100, _profile(graph, {})))
    with_it = simulate_with(graph, keep_all, CostModel(H100, _profile(graph, {conv: workspace})))
    events = [e for e in events_from_simulation(graph, keep_all, with_it) if e.block.startswith("scratch@")]
    assert [(e.action, e.block, e.nbytes, e.op) for e in events] == [("alloc", f"scratch@{conv}", workspace, conv),
                                                                      ("free", f"scratch@{conv}", workspace, conv)]
    assert reserved_peak_bytes(graph, keep_all, with_it) >= with_it.peak_bytes > reserved_peak_bytes(graph, keep_all,
                                                                                                      plain)
