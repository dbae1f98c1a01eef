"""Where a plan acts in its step, worked out once per plan (runtime/_step_layout.py)."""

import udnn_lab as ul
from udnn_lab import zoo
from udnn_lab.runtime import OffloadRuntime
from udnn_lab.runtime._step_layout import StepLayout

CPU = ul.Hardware.load("cpu-amd-epyc-2cpu")


def _graph() -> ul.Graph:
    return ul.trace(zoo.get("resnet18", batch=32, image_size=32, optimizer="none"))


def test_every_action_of_the_plan_is_at_its_op():
    graph = _graph()
    offloads = ul.plan(graph, None, "vdnn-all", hardware=CPU).located(graph)
    smallest = ul.min_budget(graph, "recompute", hardware=CPU)
    recomputes = ul.plan(graph, smallest, "recompute", hardware=CPU).located(graph)
    assert offloads.offloads and recomputes.recomputes
    for chosen in (offloads, recomputes):
        layout = StepLayout.of(chosen)
        for offload in chosen.offloads:
            assert offload.tensor in layout.offload_after[offload.after_op]
            assert offload.tensor in layout.prefetch_at[offload.prefetch_at]
            assert offload.tensor in layout.release_at[offload.release_op]
        for index, recompute in enumerate(chosen.recomputes):
            assert index in layout.replay_at[recompute.at_op - 1]
            assert all(index in layout.recording[op] for op in recompute.ops)
        sited = {site.tensor for sites in layout.sites.values() for site in sites}
        assert sited == {o.tensor for o in chosen.offloads} | {t for r in chosen.recomputes for t in r.tensors}
        assert all(layout.site_of[t].producer in layout.sites for t in sited)
        assert layout.acted_at == {op for table in (layout.sites, layout.let_go, layout.offload_after,
                                                    layout.prefetch_at, layout.release_at, layout.wait_at,
                                                    layout.replay_at, layout.recording) for op in table}
    recorded = StepLayout.of(recomputes)
    re_run = StepLayout.of(recomputes, reruns={0})  # the first recomputation re-runs a call: it records nothing
    for op, indices in recorded.recording.items():
        assert re_run.recording.get(op, ()) == tuple(index for index in indices if index != 0)
    assert re_run.replay_at == recorded.replay_at

def test_a_runtime_works_out_the_layout_once_for_all_its_steps():
    graph = _graph()
    runtime = OffloadRuntime(ul.plan(graph, None, "vdnn-all", hardware=CPU).located(graph))
    assert runtime.step_layout(()) is runtime.step_layout(())
    assert runtime.step_layout({0}) is not runtime.step_layout(())
