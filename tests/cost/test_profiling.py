import pytest
import torch

import udnn_lab as ul
from udnn_lab import zoo


@pytest.fixture(scope="module")
def work():
    return zoo.get("resnet18", batch=4, image_size=32)


@pytest.fixture(scope="module")
def prof(work):
    return ul.profile(work, repeats=2)


def test_profile_is_aligned_to_the_traced_graph(work, prof):
    graph = ul.trace(work)
    prof.check_matches(graph)
    assert prof.ops == tuple(op.name for op in graph.ops)
    assert prof.flops == tuple(op.flops for op in graph.ops)
    assert prof.graph_fingerprint == graph.fingerprint  # its optimizer had state; the trace's makes it


def test_profile_times_are_measured_per_op(prof):
    assert len(prof.time_s) == len(prof.ops) and all(t > 0 for t in prof.time_s)
    assert all(m <= t for m, t in zip(prof.time_min_s, prof.time_s))
    assert prof.step_time_s > 0 and prof.op_time_s > 0 and prof.overhead_per_op_s >= 0
    assert prof.device == "cpu" and prof.repeats == 2 and prof.threads == torch.get_num_threads()
    assert prof.dispatch_mode_op_s is not None and 0 <= prof.dispatch_mode_op_s < 1e-3  # a Python call per op
    frame = prof.frame()
    convs = frame[frame.op == "aten.convolution.default"]
    assert (convs.flops > 0).all() and (convs.flops_per_s > 0).all()


def test_profile_layers_add_up(prof):
    layers = prof.layers()
    assert layers["time_s"].sum() == pytest.approx(prof.op_time_s)
    assert layers["flops"].sum() == sum(prof.flops)
    assert layers.iloc[0]["module"] == "conv1"


def test_profile_leaves_the_model_as_it_was(work):
    before = {k: v.clone() for k, v in work.model.state_dict().items()}
    ul.profile(work, repeats=1)
    assert all(torch.equal(v, before[k]) for k, v in work.model.state_dict().items())
    assert all(p.grad is None for p in work.model.parameters()) and len(work.optimizer.state) == 0


def test_profile_refuses_bad_input():
    with pytest.raises(ValueError, match="repeats"):
        ul.profile(zoo.get("mlp2", batch=2), repeats=0)
    with pytest.raises(ValueError, match="meta"):
        ul.profile(zoo.get("mlp2", batch=2, device="meta"))


@pytest.mark.gpu
def test_profile_on_cuda_uses_events():
    prof = ul.profile(zoo.get("resnet18", batch=8, image_size=64), device="cuda", repeats=2)
    assert prof.device == "cuda" and all(t >= 0 for t in prof.time_s) and prof.op_time_s > 0


@pytest.mark.gpu
def test_on_cuda_the_ops_time_their_kernels_not_the_host_s_pace():
    # many small ops: timed with the device idle between events, they summed to 2.4 times GPT-2's step on an H200
    prof = ul.profile(zoo.get("hf:gpt2", batch=2, small=True, seq_len=128), device="cuda", repeats=3)
    views = [t for t, r, w in zip(prof.time_s, prof.bytes_read, prof.bytes_written) if r + w == 0]
    assert prof.op_time_s <= prof.step_time_s, prof
    assert views and sorted(views)[len(views) // 2] < 10e-6  # a view runs no kernel
    # the host's time to issue each op (NOTE [simulated streams] 9): every op takes some, and a plain step, which
    # issues them all and waits for the device, takes no less than they do together
    assert prof.host_time_s is not None and len(prof.host_time_s) == len(prof.ops) and min(prof.host_time_s) > 0
    assert sum(prof.host_time_s) <= prof.step_time_s * 1.1, (sum(prof.host_time_s), prof.step_time_s)


def test_the_step_s_own_time_is_taken_as_a_training_loop_runs_it():
    """NOTE [view replay] 3: the ops are timed as traced, with view replay; the plain steps behind step_time_s, and
    the step the runtime's probes time plans against, as the user's loop runs them, without it."""
    work = zoo.get("mlp3", batch=4)
    seen: list[bool] = []
    handle = work.model.register_forward_pre_hook(
        lambda module, args: seen.append(torch.autograd.is_view_replay_enabled()))
    try:
        ul.profile(work, repeats=3)
    finally:
        handle.remove()
    assert True in seen and False in seen
    with_replay, without = seen.count(True), seen.count(False)
    assert without >= 3 and with_replay >= 3 + 1  # the plain steps; the timed ones, and the recorded step


def test_run_step_can_run_without_view_replay():
    from udnn_lab.analysis.step import run_step, split_input
    work = zoo.get("mlp3", batch=4)
    args, kwargs = split_input(work.example_input)
    seen: list[bool] = []
    handle = work.model.register_forward_pre_hook(
        lambda module, args: seen.append(torch.autograd.is_view_replay_enabled()))
    try:
        run_step(work.model, args, kwargs, loss_fn=work.loss_fn, target=work.target)
        run_step(work.model, args, kwargs, loss_fn=work.loss_fn, target=work.target, replay_views=False)
    finally:
        handle.remove()
    assert seen == [True, False] and not torch.autograd.is_view_replay_enabled()


def test_the_step_probes_take_each_op_as_the_cost_model_prices_it(work, monkeypatch):
    """A probe takes the ops a recomputation re-runs out of what it times (NOTE [host probes] 4); on a CPU the cost
    model prices each op with its share of the step's time between ops, and so must the probe, or a replay's figure
    leaves that share in and the simulator counts it twice."""
    from udnn_lab.cost import profiling
    from udnn_lab.cost.model import CostModel

    seen = []
    monkeypatch.setattr(profiling, "_step_figures", lambda step, repeats: seen.append(step) or {})
    # plain steps a little longer than their ops: a busy machine can time the ops at the whole step, and a share of
    # 0 would not tell a probe that forgot it from one that did not
    plain_step = profiling._plain_step
    monkeypatch.setattr(profiling, "_plain_step", lambda *args: plain_step(*args) + 0.05)
    prof = ul.profile(work, repeats=2)
    graph = ul.trace(work)
    priced = CostModel(ul.Hardware.load("cpu-amd-epyc-2cpu"), profile=prof).op_times_s(graph)
    assert prof.overhead_per_op_s > 0
    assert seen[0].op_host_s == pytest.approx(tuple(priced), rel=1e-9, abs=1e-12)
