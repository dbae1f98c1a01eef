"""NOTE [hook points]: offloads moved onto the boundaries a hooks-only runtime sees."""

import torch
from torch import nn

import udnn_lab as ul
from udnn_lab import zoo
from udnn_lab.graph import Plan
from udnn_lab.graph.hook_points import first_packs, hook_points, recording_windows
from udnn_lab.planning import plan
from udnn_lab.planning._rebuild import rebuilds
from udnn_lab.simulation.simulator import cost_model
from udnn_lab.vocabulary import LOSS_SCOPE

CPU = ul.Hardware.load("cpu-amd-epyc-2cpu")


def _graph():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                          nn.Conv2d(16, 16, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                          nn.Linear(16, 4))
    x, y = torch.randn(4, 3, 32, 32), torch.tensor([0, 3, 1, 2])
    return ul.trace(model, x, loss_fn=nn.functional.cross_entropy, target=y, optimizer=None)


def test_the_trace_logs_module_calls_and_saved_tensors_in_order():
    graph = _graph()
    kinds = [event.kind for event in graph.hook_events]
    assert kinds[0] == "enter" and graph.hook_events[0].node == "Sequential"
    assert kinds.count("enter") == kinds.count("exit") == 9  # the Sequential and its eight layers
    assert kinds.count("pack") == kinds.count("unpack") > 0
    assert max(i for i, k in enumerate(kinds) if k != "unpack") < kinds.index("unpack")  # forward, then backward
    boundaries = [event.boundary for event in graph.hook_events]
    assert boundaries == sorted(boundaries)
    saved = {t.id for t in graph.tensors if t.saved}
    assert {e.tensor for e in graph.hook_events if e.kind == "pack"} == saved


def test_each_unpack_names_its_pack_and_each_module_call_its_mode():
    graph = _graph()
    events = graph.hook_events
    for event in events:
        if event.kind == "unpack":
            assert events[event.packed_at].kind == "pack" and events[event.packed_at].tensor == event.tensor
    assert all(e.training and e.own_hooks for e in events if e.kind in ("enter", "exit"))


class _CheckpointedMiddle(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first, self.middle, self.last = nn.Linear(8, 8), nn.Sequential(nn.Linear(8, 8), nn.Tanh()), \
            nn.Linear(8, 2)

    def forward(self, x):
        x = torch.utils.checkpoint.checkpoint(self.middle, self.first(x), use_reentrant=False)
        return self.last(x)


def test_module_calls_under_hooks_pushed_inside_the_step_are_marked():
    graph = ul.trace(_CheckpointedMiddle(), torch.randn(4, 8), optimizer=None)
    own = {(e.kind, e.node, e.boundary): e.own_hooks for e in graph.hook_events if e.kind in ("enter", "exit")}
    inside = {key for key, free in own.items() if not free}  # checkpoint's own hooks were on top
    assert inside and {node for _, node, _ in inside} <= {"Sequential", "Linear", "Tanh"}
    assert own[("enter", "_CheckpointedMiddle", 0)]


def test_moved_offloads_lie_on_hook_points_and_keep_their_order():
    graph = _graph()
    points = set(hook_points(graph.hook_events))
    met = first_packs(graph.hook_events)
    for policy in ("vdnn-all", "vdnn-conv", "vdnn++", "pin-greedy"):
        chosen = plan(graph, None, policy, hardware=CPU)
        assert chosen.hook_events, policy
        for offload in chosen.offloads:
            tensor = graph.tensors[offload.tensor]
            assert {offload.after_op + 1, offload.release_op, offload.prefetch_at} <= points
            assert offload.after_op + 1 >= met[offload.tensor]  # the runtime has met the tensor
            assert offload.after_op >= tensor.last_forward_use
            assert offload.after_op < offload.release_op and offload.prefetch_at < tensor.first_backward_use
        chosen.validate(graph)


def test_a_moved_plan_simulates_within_the_budget_it_was_made_for():
    graph = ul.trace(zoo.get("resnet18", batch=2, image_size=32))
    low = ul.min_budget(graph, "vdnn++", hardware=CPU)
    for budget in (low, (low + graph.peak_bytes) // 2):
        chosen = plan(graph, budget, "vdnn++", hardware=CPU)
        assert ul.simulate(graph, chosen, hardware=CPU).peak_bytes <= budget


def test_a_plan_is_left_as_made_when_asked():
    graph = _graph()
    chosen = plan(graph, None, "vdnn-all", hardware=CPU)
    as_made = chosen.located(graph, on_hooks=False)
    assert not as_made.hook_events and as_made.followed_op_by_op(graph)
    assert as_made.dispatched_ops(graph) == (range(len(graph.ops)),)
    recomputing = plan(graph, None, "recompute", hardware=CPU).located(graph, on_hooks=False)
    assert recomputing.recomputes and not recomputing.hook_events and not recomputing.recording


def test_a_recomputing_plan_carries_windows_that_hold_its_recorded_ops():
    """NOTE [hook points] 6: the recording mode is on around each recomputation's forward ops, from a module call
    at or before the first to one after the last, and sees no other op."""
    graph = _graph()
    budget = (ul.min_budget(graph, "recompute", hardware=CPU) + graph.peak_bytes) // 2
    recomputing = plan(graph, budget, "recompute", hardware=CPU)
    assert recomputing.recomputes and recomputing.hook_events and recomputing.recording
    assert not recomputing.followed_op_by_op(graph)
    events = graph.hook_events
    seen = set().union(*recomputing.dispatched_ops(graph))
    for opening, closing in recomputing.recording:
        assert events[opening].kind in ("enter", "exit") and (closing == len(events) or
                                                              events[closing].kind in ("enter", "exit"))
    for recompute in recomputing.recomputes:
        assert set(recompute.ops) <= seen
    assert len(seen) < len(graph.ops) // 2  # backward, and most of forward, go without the mode
    # the loss's own tensors too: their ops come after the last module call
    loss = next(r for r in rebuilds(graph, cost_model(graph, CPU))
                if graph.ops[r.candidate.producer].module == LOSS_SCOPE)
    everything = Plan("recompute", graph.fingerprint, recomputes=(loss.action(),)).located(graph)
    assert everything.recording[-1][1] == len(events) and everything.dispatched_ops(graph)[-1].stop == len(graph.ops)


def test_recording_windows_merge_where_they_overlap_and_close_at_the_end_without_a_call_after():
    graph = _graph()
    events = graph.hook_events
    calls = [i for i, e in enumerate(events) if e.kind in ("enter", "exit")]
    last_forward = max(i for i, e in enumerate(events) if e.kind != "unpack")
    first, second = events[calls[2]].boundary, events[calls[4]].boundary
    windows = recording_windows(events, [(first, first), (first, second)])
    opening = max(i for i in calls if events[i].boundary <= first)  # the last call before the op
    assert len(windows) == 1 and windows[0][0] == opening and events[windows[0][1]].boundary > second
    beyond = max(e.boundary for e in events[:last_forward + 1])  # past the last module call of forward
    assert recording_windows(events, [(beyond, beyond)])[0][1] == len(events)  # on to the step's end
    assert recording_windows(events, [(-1, 0)]) is None  # no module call at or before the op


def test_a_step_traced_with_cpu_kernels_for_cuda_has_no_hook_events():
    work = zoo.get("mlp5", batch=2)
    assert ul.trace(work).hook_events
    if not torch.cuda.is_available():
        assert ul.trace(work, device="cuda").hook_events == ()  # cuDNN's kernels save other tensors
