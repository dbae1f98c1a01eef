import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import udnn_lab as ul
from udnn_lab import zoo
from udnn_lab.errors import TraceMismatch
from udnn_lab.hardware.profiles import Hardware, HardwareMismatchWarning, UnknownHardwareError
from udnn_lab.planning import Offload, Plan, PlanError, Recompute
from udnn_lab.simulation.simulator import simulate

H100 = Hardware.load("h100-sxm")
# The same GPU behind a link 4 times slower: copies lag behind compute.
SLOW_LINK = dataclasses.replace(H100, **{f"{d}_{m}_bytes_per_s": getattr(H100, f"{d}_{m}_bytes_per_s") / 4
                                         for d in ("h2d", "d2h") for m in ("pinned", "pageable")})


@pytest.fixture(scope="module")
def graph():
    """Activations dominate: the peak is where forward turns into backward."""
    return ul.trace(zoo.get("resnet18", batch=32, image_size=128, device="meta"), device="cuda")


def _offload_feature_maps(graph, min_bytes=1 << 20, budget=None):
    saved = [t for t in graph.tensors if t.category == "feature_map" and t.nbytes >= min_bytes]
    offloads = tuple(Offload(t.id, t.last_forward_use, t.first_backward_use - 1) for t in saved)
    return Plan("test-offload", graph.fingerprint, budget_bytes=budget, offloads=offloads)


@pytest.mark.parametrize("name, options", [("resnet18", {"image_size": 32}), ("densenet121", {"image_size": 32}),
                                           ("lstm", {}), ("transformer", {"input_shape": (16,)})])
def test_keep_all_curve_is_the_analyzers_exactly(name, options):
    graph = ul.trace(zoo.get(name, batch=2, device="meta", **options))
    sim = simulate(graph, hardware=H100)
    predicted, simulated = graph.memory_curve(), sim.memory_curve()
    for column in predicted.columns:
        assert (predicted[column] == simulated[column]).all(), column
    assert sim.stall_time_s == 0 and sim.d2h_bytes == sim.h2d_bytes == 0
    assert sim.step_time_s == pytest.approx(sim.compute_time_s)
    assert sim.peak_bytes == graph.peak_bytes


def test_offloaded_tensors_leave_after_forward_and_are_back_before_backward(graph):
    plan = _offload_feature_maps(graph)
    sim = simulate(graph, plan, hardware=H100)
    ops = sim.timeline[(sim.timeline.stream == "compute") & (sim.timeline.kind == "op")].set_index("op")
    copies = sim.timeline[sim.timeline.stream != "compute"]
    for offload in plan.offloads:
        tensor = graph.tensors[offload.tensor]
        d2h = copies[(copies.stream == "d2h") & (copies.tensor == tensor.name)].iloc[0]
        h2d = copies[(copies.stream == "h2d") & (copies.tensor == tensor.name)].iloc[0]
        assert d2h.start_s >= ops.loc[offload.after_op, "end_s"]
        assert h2d.start_s >= ops.loc[offload.prefetch_at - 1, "end_s"]  # issued when compute reaches prefetch_at
        if h2d.kind == "prefetch":
            assert h2d.start_s >= d2h.end_s
        else:  # the copy had not finished: the tensor never left
            assert h2d.kind == "prefetch_cancelled" and d2h.end_s > h2d.start_s
        assert ops.loc[tensor.first_backward_use, "start_s"] >= h2d.end_s
    assert sim.d2h_bytes == sum(graph.tensors[o.tensor].nbytes for o in plan.offloads) >= sim.h2d_bytes > 0
    assert sim.lower_bound_s <= sim.step_time_s + 1e-12


def test_offloading_lowers_the_curve_between_forward_and_backward(graph):
    plan = _offload_feature_maps(graph)
    keep, off = simulate(graph, hardware=H100).memory_curve(), simulate(graph, plan, hardware=H100).memory_curve()
    assert (off["live_bytes"] <= keep["live_bytes"]).all()
    boundary = next(op.index for op in graph.ops if op.phase == "backward")
    assert off["feature_map"].iloc[boundary] < keep["feature_map"].iloc[boundary]


def test_a_tight_budget_makes_compute_wait_for_copies_and_is_kept(graph):
    plan = _offload_feature_maps(graph, min_bytes=1 << 16)
    slow = SLOW_LINK  # copies lag behind compute, so memory is held longer
    lagging, prompt = simulate(graph, plan, hardware=slow), simulate(graph, plan, hardware=H100)
    assert prompt.peak_bytes < lagging.peak_bytes <= graph.cuda_peak_bytes
    budget = (prompt.peak_bytes + lagging.peak_bytes) // 2
    tight = simulate(graph, Plan(plan.policy, plan.graph_fingerprint, budget_bytes=budget, offloads=plan.offloads),
                     hardware=slow)
    stalls = tight.timeline[tight.timeline.kind == "stall_memory"]
    assert tight.fits and tight.peak_bytes <= budget
    assert len(stalls) > 0 and tight.stall_time_s >= stalls.eval("end_s - start_s").sum() - 1e-12
    assert tight.stall_time_s > lagging.stall_time_s and tight.step_time_s >= lagging.step_time_s


def test_an_impossible_budget_is_reported_as_not_fitting(graph):
    sim = simulate(graph, Plan.keep_all(graph, budget_bytes=graph.cuda_peak_bytes // 2), hardware=H100)
    assert not sim.fits and sim.peak_bytes > sim.budget_bytes


def recomputable(graph, min_bytes=1 << 20):
    """A feature map whose producer's inputs all outlive its first backward use."""
    for t in graph.tensors:
        if t.category != "feature_map" or t.producer is None or t.nbytes < min_bytes:
            continue
        sources = [graph.tensors[s] for s in graph.ops[t.producer].inputs]
        if all(s.category in ("parameter", "buffer", "input") or s.free_step is None
               or s.free_step >= t.first_backward_use for s in sources):
            return t
    raise AssertionError("no recomputable feature map")


def test_recompute_adds_compute_and_frees_memory(graph):
    relu = recomputable(graph)
    recompute = Recompute((relu.id,), (relu.producer,), relu.first_backward_use)
    plan = Plan("test-recompute", graph.fingerprint, recomputes=(recompute,))
    base, sim = simulate(graph, hardware=H100), simulate(graph, plan, hardware=H100)
    assert sim.compute_time_s > base.compute_time_s
    assert (sim.timeline.kind == "recompute").sum() == 1
    between = (relu.last_forward_use + 1 + relu.first_backward_use) // 2
    assert sim.memory_curve()["live_bytes"].iloc[between] == base.memory_curve()["live_bytes"].iloc[between] \
        - relu.nbytes


def test_simulation_is_deterministic(graph):
    plan = _offload_feature_maps(graph)
    a, b = simulate(graph, plan, hardware=H100), simulate(graph, plan, hardware=H100)
    assert a.step_time_s == b.step_time_s and a.timeline.equals(b.timeline)


def test_slower_links_never_make_the_step_faster(graph):
    plan = _offload_feature_maps(graph)
    fast, slow = simulate(graph, plan, hardware=H100), simulate(graph, plan, hardware=SLOW_LINK)
    assert slow.step_time_s >= fast.step_time_s
    assert slow.compute_time_s == pytest.approx(fast.compute_time_s)


def test_profile_times_drive_the_simulation():
    work = zoo.get("mlp3", batch=8)
    graph = ul.trace(work)
    prof = ul.profile(work, repeats=2)
    sim = simulate(graph, hardware="cpu-amd-epyc-2cpu", profile=prof)
    expected = sum(prof.time_s) + len(prof.ops) * prof.overhead_per_op_s
    assert sim.compute_time_s == pytest.approx(expected)


def test_a_profile_of_another_step_is_refused():
    graph = ul.trace(zoo.get("mlp3", batch=8))
    other = ul.profile(zoo.get("mlp4", batch=8), repeats=1)
    with pytest.raises(TraceMismatch):
        simulate(graph, hardware="cpu-amd-epyc-2cpu", profile=other)


def test_a_profile_from_another_device_warns():
    work = zoo.get("mlp3", batch=8)
    graph = ul.trace(work)
    prof = ul.profile(work, repeats=1)
    with pytest.warns(HardwareMismatchWarning):
        simulate(graph, hardware="h100-sxm", profile=prof)


def test_a_plan_for_another_graph_is_refused(graph):
    other = ul.trace(zoo.get("mlp3", batch=4))
    with pytest.raises(PlanError, match="another graph"):
        simulate(graph, Plan.keep_all(other), hardware=H100)


def test_unknown_hardware_lists_the_known_profiles(graph):
    with pytest.raises(UnknownHardwareError, match="h100-sxm"):
        simulate(graph, hardware="tpu-v9")


def test_timeline_and_curve_have_documented_columns(graph):
    sim = simulate(graph, _offload_feature_maps(graph), hardware=H100)
    assert list(sim.timeline.columns) == ["stream", "kind", "start_s", "end_s", "op", "name", "module", "tensor",
                                          "nbytes"]
    assert set(sim.timeline.stream) == {"compute", "d2h", "h2d"}
    assert {"start_s", "end_s", "live_bytes", "feature_map"} <= set(sim.curve.columns)
    assert (np.diff(sim.curve["start_s"]) >= 0).all()
    assert "budget" in repr(sim) and repr(sim).endswith("hardware='h100-sxm')") and len(repr(sim)) < 200


class _RandomNet(nn.Module):
    def __init__(self, widths, skips):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(widths, widths[1:]))
        self.skips = skips

    def forward(self, x):
        outputs = [x]
        for i, layer in enumerate(self.layers):
            h = layer(outputs[-1]).relu()
            if i in self.skips and outputs[-1].shape == h.shape:
                h = h + outputs[-1]
            outputs.append(h)
        return outputs[-1]


@settings(max_examples=15, deadline=None)
@given(widths=st.lists(st.sampled_from([8, 16, 32]), min_size=3, max_size=7),
       skips=st.sets(st.integers(0, 6)), budget_fraction=st.floats(0.5, 1.0), batch=st.integers(1, 16))
def test_random_networks_keep_their_invariants(widths, skips, budget_fraction, batch):
    import torch

    model = _RandomNet(widths, skips)
    graph = ul.trace(model, torch.randn(batch, widths[0]))
    keep = simulate(graph, hardware=H100)
    assert (keep.memory_curve()["live_bytes"] == graph.memory_curve()["live_bytes"]).all()
    plan = _offload_feature_maps(graph, min_bytes=1, budget=int(graph.peak_bytes * budget_fraction))
    plan.validate(graph)
    sim = simulate(graph, plan, hardware=H100)
    ops = sim.timeline[(sim.timeline.stream == "compute") & (sim.timeline.kind == "op")].set_index("op")
    for offload in plan.offloads:
        name = graph.tensors[offload.tensor].name
        h2d = sim.timeline[(sim.timeline.stream == "h2d") & (sim.timeline.tensor == name)].iloc[0]
        assert ops.loc[graph.tensors[offload.tensor].first_backward_use, "start_s"] >= h2d.end_s
    assert sim.lower_bound_s <= sim.step_time_s + 1e-12
    assert (sim.memory_curve()["live_bytes"] <= keep.memory_curve()["live_bytes"]).all()
