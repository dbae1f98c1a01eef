"""A plan followed op by op pays its dispatch mode's host time (NOTE [simulated streams] 6)."""

import dataclasses

import pytest

import udnn_lab as ul
from udnn_lab import zoo
from udnn_lab.hardware.profiles import Hardware
from udnn_lab.planning import Offload, Plan


def _with_dispatch(hardware: Hardware, seconds: float | None) -> Hardware:
    return dataclasses.replace(hardware, dispatch_mode_op_s=seconds,
                               sources={**hardware.sources, "dispatch_mode_op_s": "set by the test"})


CPU = Hardware.load("cpu-amd-epyc-2cpu")
H100 = Hardware.load("h100-sxm")


@pytest.fixture(scope="module")
def cpu_graph():
    return ul.trace(zoo.get("resnet18", batch=4, image_size=32))


@pytest.fixture(scope="module")
def cuda_graph():
    return ul.trace(zoo.get("resnet18", batch=2, image_size=32, device="meta"), device="cuda")


def _recompute_plan(graph) -> Plan:
    plan = ul.plan(graph, None, "recompute", hardware=CPU if graph.device == "cpu" else H100)
    assert plan.recomputes
    return plan


def test_the_shipped_cpu_profile_was_measured_with_its_dispatch_figure():
    assert CPU.dispatch_mode_op_s is not None and 1e-7 < CPU.dispatch_mode_op_s < 1e-3
    assert "pass-through dispatch mode" in CPU.sources["dispatch_mode_op_s"]


def test_on_a_cpu_every_forward_and_backward_op_followed_op_by_op_takes_the_mode_longer(cpu_graph):
    plan = _recompute_plan(cpu_graph).located(cpu_graph, on_hooks=False)
    assert plan.followed_op_by_op(cpu_graph)
    unpriced = ul.simulate(cpu_graph, plan, hardware=_with_dispatch(CPU, None))
    priced = ul.simulate(cpu_graph, plan, hardware=_with_dispatch(CPU, 1e-4))
    ops = sum(op.phase != "optimizer" for op in cpu_graph.ops)
    assert priced.step_time_s - unpriced.step_time_s == pytest.approx(ops * 1e-4, rel=1e-6)
    assert priced.peak_bytes == unpriced.peak_bytes


def test_followed_by_hooks_only_the_ops_of_its_recording_windows_pay(cpu_graph):
    """NOTE [hook points] 6: the mode is on around the recorded ops only."""
    plan = _recompute_plan(cpu_graph)
    assert not plan.followed_op_by_op(cpu_graph) and plan.recording
    seen = {i for ops in plan.dispatched_ops(cpu_graph) for i in ops if cpu_graph.ops[i].phase != "optimizer"}
    assert {i for r in plan.recomputes for i in r.ops} <= seen
    unpriced = ul.simulate(cpu_graph, plan, hardware=_with_dispatch(CPU, None))
    priced = ul.simulate(cpu_graph, plan, hardware=_with_dispatch(CPU, 1e-4))
    assert priced.step_time_s - unpriced.step_time_s == pytest.approx(len(seen) * 1e-4, rel=1e-6)


def test_a_plan_followed_by_its_hooks_pays_nothing(cpu_graph):
    plan = ul.plan(cpu_graph, None, "vdnn-all", hardware=CPU)
    assert not plan.followed_op_by_op(cpu_graph) and plan.hook_events
    assert ul.simulate(cpu_graph, plan, hardware=_with_dispatch(CPU, 1e-4)).step_time_s == \
        ul.simulate(cpu_graph, plan, hardware=_with_dispatch(CPU, None)).step_time_s
    keep_all = Plan.keep_all(cpu_graph)
    assert not keep_all.followed_op_by_op(cpu_graph)


def test_the_same_offloads_without_hook_points_are_priced(cpu_graph):
    plan = ul.plan(cpu_graph, None, "vdnn-all", hardware=CPU)
    op_by_op = dataclasses.replace(plan, hook_events=())  # located, but carrying no hook events
    assert op_by_op.followed_op_by_op(cpu_graph)
    assert ul.simulate(cpu_graph, op_by_op, hardware=_with_dispatch(CPU, 1e-4)).step_time_s > \
        ul.simulate(cpu_graph, op_by_op, hardware=_with_dispatch(CPU, None)).step_time_s


def test_on_a_gpu_compute_waits_for_a_host_that_falls_behind(cuda_graph):
    plan = _recompute_plan(cuda_graph)
    assert plan.followed_op_by_op(cuda_graph)  # traced without CUDA: no hook events (cuDNN saves other tensors)
    unpriced = ul.simulate(cuda_graph, plan, hardware=_with_dispatch(H100, None))
    assert "stall_host" not in set(unpriced.timeline.kind)
    slow_host = ul.simulate(cuda_graph, plan, hardware=_with_dispatch(H100, 1e-3))  # far slower than the kernels
    ops = sum(op.phase != "optimizer" for op in cuda_graph.ops)
    assert "stall_host" in set(slow_host.timeline.kind)
    assert slow_host.step_time_s >= ops * 1e-3  # the device cannot finish before the host has issued every op
    assert slow_host.peak_bytes == unpriced.peak_bytes
    fast_host = ul.simulate(cuda_graph, plan, hardware=_with_dispatch(H100, 1e-12))  # ahead of the device
    assert fast_host.step_time_s == pytest.approx(unpriced.step_time_s, rel=1e-6)


def test_the_profiled_steps_own_figure_comes_first(cpu_graph):
    from udnn_lab.cost.model import CostModel

    measured = dataclasses.replace(ul.profile(zoo.get("mlp3", batch=4), repeats=2), dispatch_mode_op_s=3e-5)
    assert CostModel(_with_dispatch(CPU, 1e-6), measured).dispatch_mode_op_s == 3e-5
    assert CostModel(_with_dispatch(CPU, 1e-6)).dispatch_mode_op_s == 1e-6
    assert CostModel(_with_dispatch(CPU, None)).dispatch_mode_op_s == 0.0


def test_the_profiled_steps_own_replay_figure_comes_first():
    """NOTE [host probes] 4: a replay's host time per op is the profiled step's where it was measured there."""
    from udnn_lab.cost.model import CostModel

    hardware = dataclasses.replace(CPU, replay_op_s=1e-6)
    measured = ul.profile(zoo.get("mlp3", batch=4), repeats=2)
    assert measured.replay_op_s is not None and 0 <= measured.replay_op_s < 1e-3  # measured on its own forward
    assert CostModel(hardware, dataclasses.replace(measured, replay_op_s=3e-5)).replay_op_s == 3e-5
    assert CostModel(hardware, dataclasses.replace(measured, replay_op_s=None)).replay_op_s == 1e-6
    assert CostModel(dataclasses.replace(CPU, replay_op_s=None)).replay_op_s == 0.0


def test_the_profiled_steps_own_hook_call_figure_comes_first():
    """NOTE [host probes] 4: a hook call's host time is the profiled step's where it was measured there."""
    from udnn_lab.cost.model import CostModel

    hardware = dataclasses.replace(CPU, hook_call_s=5e-6)
    measured = ul.profile(zoo.get("mlp3", batch=4), repeats=2)
    assert measured.hook_call_s is None or 0 < measured.hook_call_s < 1e-3
    assert CostModel(hardware, dataclasses.replace(measured, hook_call_s=9e-6)).hook_call_s == 9e-6
    assert CostModel(hardware, dataclasses.replace(measured, hook_call_s=None)).hook_call_s == 5e-6
    assert CostModel(dataclasses.replace(CPU, hook_call_s=None)).hook_call_s == 0.0


def test_the_profiled_steps_own_offload_and_step_figures_are_priced_once_each(cpu_graph):
    """NOTE [simulated streams] 6: a followed step pays its runtime_step_s once, each offload its offload_action_s;
    keep-all pays neither. The step's own offload figure comes before the machine's."""
    from udnn_lab.cost.model import CostModel

    hardware = _with_host(CPU, 0.0, 2e-5, 0.0)
    step = ul.profile(zoo.get("resnet18", batch=4, image_size=32), repeats=1)
    free = dataclasses.replace(step, hook_call_s=0.0, replay_op_s=0.0, offload_action_s=None, runtime_step_s=None)
    priced = dataclasses.replace(free, offload_action_s=7e-4, runtime_step_s=5e-3)
    assert CostModel(hardware, priced).offload_action_s == 7e-4 and CostModel(hardware, free).offload_action_s == 2e-5
    assert CostModel(hardware, free).runtime_step_s == 0.0
    plan = ul.plan(cpu_graph, None, "vdnn-conv", hardware=CPU)
    assert plan.offloads
    extra = ul.simulate(cpu_graph, plan, hardware=hardware, profile=priced).step_time_s - \
        ul.simulate(cpu_graph, plan, hardware=hardware, profile=free).step_time_s
    # and, the step's offload figure timing its copies' calls (NOTE [simulated streams] 7), not each copy's latency
    latencies = CPU.latency_s("d2h") + CPU.latency_s("h2d")
    assert extra == pytest.approx(5e-3 + len(plan.offloads) * (7e-4 - 2e-5 - latencies), rel=1e-6)
    assert ul.simulate(cpu_graph, None, hardware=hardware, profile=priced).step_time_s == \
        ul.simulate(cpu_graph, None, hardware=hardware, profile=free).step_time_s


@pytest.mark.parametrize("on_hooks", [True, False], ids=["by-hooks", "op-by-op"])
def test_each_recomputation_recorded_pays_its_figure_and_a_step_that_records_pays_once(cpu_graph, on_hooks):
    """NOTE [simulated streams] 6: besides its ops, each recomputation the runtime records and replays costs
    replay_recompute_s, and the step that records any recording_step_s once; one re-run as a module call pays
    neither but rerun_call_s, and keep-all nothing."""
    from udnn_lab.cost.model import CostModel
    from udnn_lab.graph.reruns import NOT_RERUN

    step = ul.profile(zoo.get("resnet18", batch=4, image_size=32), repeats=1)
    free = dataclasses.replace(step, replay_recompute_s=None, recording_step_s=None, rerun_call_s=None)
    priced = dataclasses.replace(free, replay_recompute_s=3e-4, recording_step_s=4e-3, rerun_call_s=5e-4)
    assert CostModel(CPU, free).replay_recompute_s == 0.0 and CostModel(CPU, priced).recording_step_s == 4e-3
    plan = _recompute_plan(cpu_graph).located(cpu_graph, on_hooks=on_hooks)
    reruns = plan.reruns_in(cpu_graph) or (NOT_RERUN,) * len(plan.recomputes)
    recorded = sum(rerun == NOT_RERUN for rerun in reruns)
    assert recorded and (on_hooks or recorded == len(plan.recomputes)), reruns
    extra = ul.simulate(cpu_graph, plan, hardware=CPU, profile=priced).step_time_s - \
        ul.simulate(cpu_graph, plan, hardware=CPU, profile=free).step_time_s
    assert extra == pytest.approx(recorded * 3e-4 + 4e-3 + (len(plan.recomputes) - recorded) * 5e-4, rel=1e-6)
    assert ul.simulate(cpu_graph, None, hardware=CPU, profile=priced).step_time_s == \
        ul.simulate(cpu_graph, None, hardware=CPU, profile=free).step_time_s


def test_a_planner_sees_the_price_of_a_dispatch_mode():
    """Behind a slow link auto recomputes; once seeing the recorded ops through a dispatch mode costs more than
    the copies, it offloads (a plan followed by its hooks alone) instead."""
    graph = ul.trace(zoo.get("resnet18", batch=32, image_size=64, device="meta", optimizer="none"), device="cpu")
    # on a CPU a copy holds compute up (NOTE [simulated streams] 7): a link 10 times slower makes it dearer than a
    # recomputation, and still cheaper than a recomputation seen through a dispatch mode at 10 ms an op
    slow_link = dataclasses.replace(CPU, **{f"{d}_{m}_bytes_per_s": getattr(CPU, f"{d}_{m}_bytes_per_s") / 10
                                            for d in ("h2d", "d2h") for m in ("pinned", "pageable")})
    budget = (graph.peak_bytes + ul.min_budget(graph, "recompute", hardware=CPU)) // 2
    free, expensive = _with_dispatch(slow_link, None), _with_dispatch(slow_link, 1e-2)
    assert ul.plan(graph, budget, "auto", hardware=free).recomputes
    plan = ul.plan(graph, budget, "auto", hardware=expensive)
    assert plan.offloads and not plan.recomputes and plan.dispatched_ops(graph) == (), plan
    recompute = ul.plan(graph, budget, "recompute", hardware=expensive)
    assert ul.simulate(graph, plan, hardware=expensive).step_time_s < \
        ul.simulate(graph, recompute, hardware=expensive).step_time_s


def test_offloads_of_an_unlocated_plan_are_priced_by_where_they_can_move(cpu_graph):
    saved = [t for t in cpu_graph.tensors if t.category == "feature_map" and t.first_backward_use is not None][:3]
    offloads = tuple(Offload(t.id, t.last_forward_use, t.first_backward_use - 1) for t in saved)
    plan = Plan("test", cpu_graph.fingerprint, offloads=offloads)
    assert not plan.sites and cpu_graph.hook_events
    assert plan.followed_op_by_op(cpu_graph) == (plan.located(cpu_graph).hook_events == ())


def _with_host(hardware: Hardware, hook: float, action: float, replay: float) -> Hardware:
    figures = {"hook_call_s": hook, "offload_action_s": action, "replay_op_s": replay}
    return dataclasses.replace(hardware, **figures, sources={**hardware.sources, **dict.fromkeys(figures, "test")})


@pytest.mark.parametrize("policy", ["vdnn-all", "vdnn-conv", "recompute"])
def test_the_hook_calls_priced_are_those_the_runtime_counts(cpu_graph, policy):
    """Given the traced model, the runtime hooks few modules: those calls are priced; without it, every module's
    (NOTE [hook points] 8)."""
    plan = ul.plan(cpu_graph, None, policy, hardware=CPU)
    model = zoo.get("resnet18", batch=4, image_size=32).model
    hooked = ul.OffloadRuntime(plan, model=model).hook_schedule()
    every = ul.OffloadRuntime(plan).hook_schedule()
    assert hooked is not None and every is not None and (plan.offloads or plan.recomputes)
    assert hooked.modules and every.modules is None
    assert sum(plan.hook_calls(cpu_graph).values()) == len(hooked.events) < len(every.events)
    assert sum(plan.hook_calls(cpu_graph, every_module=True).values()) == len(every.events)


def test_a_plan_followed_by_its_hooks_pays_each_hook_call_and_offload(cpu_graph):
    """NOTE [simulated streams] 6: the runtime's own host work, from its probe's figures (NOTE [host probes])."""
    plan = ul.plan(cpu_graph, None, "vdnn-conv", hardware=CPU)
    calls = sum(plan.hook_calls(cpu_graph).values())
    module_calls = sum(e.kind in ("enter", "exit") for e in cpu_graph.hook_events)
    # the calls of the modules it acts at and the packs of its windows; hooking every module, more
    assert calls < module_calls < sum(plan.hook_calls(cpu_graph, every_module=True).values()) < \
        len(cpu_graph.hook_events)
    free = ul.simulate(cpu_graph, plan, hardware=_with_host(CPU, 0.0, 0.0, 0.0))
    priced = ul.simulate(cpu_graph, plan, hardware=_with_host(CPU, 1e-4, 3e-4, 0.0))
    assert priced.step_time_s - free.step_time_s == pytest.approx(calls * 1e-4 + len(plan.offloads) * 3e-4, rel=1e-6)
    assert priced.peak_bytes == free.peak_bytes


def test_a_recomputation_pays_for_each_op_it_records_and_re_runs(cpu_graph):
    plan = _recompute_plan(cpu_graph)
    free = ul.simulate(cpu_graph, plan, hardware=_with_host(CPU, 0.0, 0.0, 0.0))
    priced = ul.simulate(cpu_graph, plan, hardware=_with_host(CPU, 0.0, 0.0, 1e-4))
    rerun = sum(len(r.ops) for r in plan.recomputes)
    assert priced.step_time_s - free.step_time_s == pytest.approx(rerun * 1e-4, rel=1e-6)


def test_on_a_gpu_the_runtimes_host_work_stalls_compute_only_when_the_host_falls_behind(cuda_graph):
    plan = _recompute_plan(cuda_graph)
    quick = ul.simulate(cuda_graph, plan, hardware=_with_host(_with_dispatch(H100, None), 0.0, 0.0, 1e-12))
    free = ul.simulate(cuda_graph, plan, hardware=_with_host(_with_dispatch(H100, None), 0.0, 0.0, 0.0))
    assert quick.step_time_s == pytest.approx(free.step_time_s, rel=1e-6)
    slow = ul.simulate(cuda_graph, plan, hardware=_with_host(_with_dispatch(H100, None), 0.0, 0.0, 1.0))
    assert "stall_host" in set(slow.timeline.kind)
    assert slow.step_time_s >= sum(len(r.ops) for r in plan.recomputes) * 1.0


def test_on_a_cpu_a_copy_holds_compute_up(cpu_graph):
    """NOTE [simulated streams] 7: the host makes the copy while compute waits."""
    hardware = _with_host(CPU, 0.0, 0.0, 0.0)
    plan = ul.plan(cpu_graph, None, "vdnn-all", hardware=CPU)
    sim = ul.simulate(cpu_graph, plan, hardware=hardware)
    keep = ul.simulate(cpu_graph, None, hardware=hardware)
    copies = sim.d2h_bytes / hardware.d2h_pinned_bytes_per_s + sim.h2d_bytes / hardware.h2d_pinned_bytes_per_s
    assert sim.d2h_bytes and sim.step_time_s >= keep.step_time_s + copies
    assert {"stall_sync", "stall_prefetch"} <= set(sim.timeline.kind)


def test_a_cpu_copy_costs_its_latency_unless_the_profiled_step_timed_its_call_in_an_offload_s_actions():
    """NOTE [simulated streams] 7: on a CPU the host makes the copy; the step's probe timed its call."""
    from udnn_lab.cost.model import CostModel

    step = ul.profile(zoo.get("mlp3", batch=4), repeats=1)
    timed, untimed = dataclasses.replace(step, offload_action_s=3e-5), dataclasses.replace(step, offload_action_s=None)
    bandwidth = CPU.bandwidth_bytes_per_s("d2h")
    assert CostModel(CPU, timed).transfer_time_s(1 << 20, "d2h") == pytest.approx((1 << 20) / bandwidth)
    assert CostModel(CPU, untimed).transfer_time_s(1 << 20, "d2h") == \
        pytest.approx(CPU.latency_s("d2h") + (1 << 20) / bandwidth)
    assert CostModel(CPU).transfer_time_s(1 << 20, "d2h") == pytest.approx(CPU.transfer_time_s(1 << 20, "d2h"))
    gpu = ul.Hardware.load("h100-sxm")  # a GPU's copy engine waits its latency whatever the host measured
    assert CostModel(gpu, timed).transfer_time_s(1 << 20, "d2h") == pytest.approx(gpu.transfer_time_s(1 << 20, "d2h"))


def test_a_cpu_copy_runs_at_the_rate_the_profiled_step_measured_in_the_step(cpu_graph):
    """NOTE [simulated streams] 7: a CPU's copies of a small step's tensors run from its caches, faster than the
    machine's largest copy; the rate the profile measured in the step (NOTE [host probes] 4) is the one a plan's
    copies are priced at."""
    from udnn_lab.cost.model import CostModel

    step = ul.profile(zoo.get("mlp3", batch=4), repeats=1)
    machine = dataclasses.replace(step, copy_bytes_per_s=None, offload_action_s=3e-5)
    own = dataclasses.replace(machine, copy_bytes_per_s=4 * CPU.bandwidth_bytes_per_s("d2h"))
    for direction in ("d2h", "h2d"):
        assert CostModel(CPU, own).transfer_time_s(1 << 20, direction) == \
            pytest.approx(CostModel(CPU, machine).transfer_time_s(1 << 20, direction) / 4)
    gpu = ul.Hardware.load("h100-sxm")  # a GPU's copies run on the link, whatever a CPU step measured
    assert CostModel(gpu, own).transfer_time_s(1 << 20, "d2h") == pytest.approx(gpu.transfer_time_s(1 << 20, "d2h"))
    profile = ul.profile(zoo.get("resnet18", batch=4, image_size=32), repeats=1)
    plan = ul.plan(cpu_graph, None, "vdnn-all", hardware=CPU)
    rates = (CPU.bandwidth_bytes_per_s("d2h"), 4 * CPU.bandwidth_bytes_per_s("d2h"))
    slow, fast = (ul.simulate(cpu_graph, plan, hardware=CPU,
                              profile=dataclasses.replace(profile, copy_bytes_per_s=rate)) for rate in rates)
    copies = (slow.d2h_bytes + slow.h2d_bytes) / CPU.bandwidth_bytes_per_s("d2h")
    assert slow.step_time_s - fast.step_time_s == pytest.approx(copies * 3 / 4, rel=0.01)
