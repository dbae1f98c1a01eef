"""Why a plan is what it is: every saved tensor's action and its reason, read off the plan and its simulation."""

import pytest

import udnn_lab as ul
from udnn_lab.frames import PLAN_REASON_COLUMNS, plan_reasons

HARDWARE = "h100-sxm"


@pytest.fixture(scope="module")
def graph():
    return ul.trace(ul.zoo.get("resnet18", batch=64, image_size=128, device="meta"), device="cuda")


def _reasons(graph, policy, share):
    budget = int(graph.cuda_peak_bytes * share) if share is not None else None
    chosen = ul.plan(graph, budget, policy, hardware=HARDWARE)
    return chosen, plan_reasons(graph, chosen, ul.simulate(graph, chosen, hardware=HARDWARE))


@pytest.mark.parametrize("policy, share", [("vdnn-all", 0.9), ("recompute", 0.75), ("auto", 0.8), ("vdnn++", None)])
def test_every_saved_tensor_has_its_action_and_a_reason(graph, policy, share):
    chosen, frame = _reasons(graph, policy, share)
    assert list(frame.columns) == PLAN_REASON_COLUMNS and frame["reason"].str.len().gt(0).all()
    saved = {t.id for t in graph.tensors if t.saved and t.first_backward_use is not None and graph.on_device(t)}
    assert set(frame["id"]) == saved
    offloaded = {o.tensor for o in chosen.offloads}
    recomputed = {t for r in chosen.recomputes for t in r.tensors}
    assert set(frame.loc[frame.action == "offload", "id"]) == offloaded
    assert set(frame.loc[frame.action == "recompute", "id"]) == recomputed
    assert frame.loc[frame.action == "offload", "reason"].str.startswith("offloaded").all()
    assert frame.loc[frame.action == "keep", "reason"].str.startswith("kept").all()


def test_offloads_say_whether_backward_waited_for_them(graph):
    _, frame = _reasons(graph, "vdnn-all", None)
    moved = frame[frame.action == "offload"]
    assert (moved["copy_s"] > 0).all() and (moved["waited_s"] >= 0).all()
    waited = moved[moved["waited_s"] > 0]
    hidden = moved[moved["waited_s"] == 0]
    assert waited["reason"].str.contains("waits").all() and hidden["reason"].str.contains("hidden by compute").all()
    assert len(waited) and len(hidden)  # vdnn-all on an H100: some copies are hidden and some are not


def test_rebuilds_say_what_they_cost_per_byte_and_add_up_to_the_replays(graph):
    chosen, frame = _reasons(graph, "recompute", 0.75)
    rebuilt = frame[frame.action == "recompute"]
    assert len(rebuilt) and rebuilt["reason"].str.contains("per MiB").all()
    simulation = ul.simulate(graph, chosen, hardware=HARDWARE)
    replays = simulation.timeline[simulation.timeline["kind"] == "recompute"]
    assert rebuilt["rebuild_s"].sum() == pytest.approx((replays["end_s"] - replays["start_s"]).sum(), rel=1e-9)


def test_what_the_plan_leaves_says_why(graph):
    _, frame = _reasons(graph, "recompute", 0.9)
    kept = frame[frame.action == "keep"]
    assert kept.loc[kept.category == "input", "reason"].str.contains("frees nothing").all()
    assert kept.loc[kept.category == "feature_map", "reason"].str.contains("budget allows").any()
    _, unbudgeted = _reasons(graph, "vdnn++", None)
    assert unbudgeted.loc[unbudgeted.action == "keep", "reason"].str.contains(
        "no budget|frees nothing|floor|holds it").all()
