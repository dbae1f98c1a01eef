"""The plans the step probes time a step under (NOTE [host probes] 4): offloads followed by hooks, recordings and
re-runs, each carried out one way."""

import pytest
import torch

import udnn_lab as ul
from udnn_lab.graph.reruns import NOT_RERUN, repeated_block
from udnn_lab.runtime._probe_plans import _probe_plan, offload_plans, recorded_chain, recorded_chains, rerun_blocks
from udnn_lab.zoo import get as zoo_get


@pytest.fixture(scope="module")
def graph():
    torch.set_num_threads(1)
    return ul.trace(zoo_get("resnet18", batch=2, image_size=32, optimizer="none"), fake=False)


@pytest.mark.parametrize("every_module", [False, True], ids=["given-the-model", "every-module"])
def test_the_probes_two_plans_are_followed_by_hooks_and_far_apart_in_calls_per_offload(graph, every_module):
    """Given the model, the runtime hooks the modules a plan needs (NOTE [hook points] 8): the one offload with the
    most calls stands apart; probed without it, every module: any one offload makes many calls."""
    plans = offload_plans(graph, every_module)
    one, several = plans["one"], plans["several"]
    assert len(plans["fewest"].offloads) == 1
    assert len(one.offloads) == 1 and len(several.offloads) > 1
    assert not one.followed_op_by_op(graph) and not several.followed_op_by_op(graph)
    calls = [sum(plan.hook_calls(graph, every_module=every_module).values()) for plan in (one, several)]
    assert calls[0] >= 2 * calls[1] / len(several.offloads)


@pytest.mark.compat
def test_the_probe_s_recomputations_are_recorded_and_replayed_and_followed_by_hooks(graph):
    """The middle half of the forward, nearly all of it, and several short pieces spread over it, about as many
    ops as the middle half: a recomputation costs more per op where it re-runs less, and each costs a fixed time
    besides."""
    middle, most, pieces = recorded_chains(graph)
    assert middle.recomputes == recorded_chain(graph).recomputes
    forward = [op.index for op in graph.ops if op.phase == "forward"]
    for plan in (middle, most, pieces):
        assert not plan.followed_op_by_op(graph) and plan.reruns_in(graph) == ()
    assert len(middle.recomputes) == len(most.recomputes) == 1 and len(pieces.recomputes) >= 2
    assert len(forward) // 4 <= len(middle.recomputes[0].ops) < len(most.recomputes[0].ops)
    assert len(most.recomputes[0].ops) >= len(forward) * 0.7
    spans = sorted((r.ops[0], r.ops[-1]) for r in pieces.recomputes)
    assert all(earlier[1] < later[0] for earlier, later in zip(spans, spans[1:]))  # apart, over the forward
    assert spans[0][0] < forward[len(forward) // 2] < spans[-1][0]


@pytest.mark.compat
def test_the_probe_s_re_run_plan_re_runs_each_call_of_the_repeated_block(graph):
    """NOTE [hook points] 7: each of the step's repeated blocks (a ResNet's basic blocks) whose saved activations
    can be restored so is re-run whole, as checkpointing each block does; followed by hooks, recording nothing."""
    plan = rerun_blocks(graph)
    assert plan is not None and len(plan.recomputes) >= 2
    assert not plan.followed_op_by_op(graph) and NOT_RERUN not in plan.reruns_in(graph)
    assert plan.windows_on_hooks(graph) == ()
    blocks = {(call.first_op, call.last_op) for call in repeated_block(graph)}
    assert {(r.ops[0], r.ops[-1]) for r in plan.recomputes} <= blocks


@pytest.mark.compat
def test_a_probe_plan_carries_out_every_recomputation_one_way(graph):
    """A recording probe records every recomputation, a re-run probe re-runs every one: a plan mixing them, or a
    re-run probe whose recomputations would be recorded, times something else than its figure."""
    chain, blocks = recorded_chain(graph).recomputes, rerun_blocks(graph).recomputes
    assert _probe_plan(graph, chain) is not None and _probe_plan(graph, blocks, rerun=True) is not None
    assert _probe_plan(graph, chain, rerun=True) is None and _probe_plan(graph, blocks) is None
    assert _probe_plan(graph, (*blocks[:1], *chain)) is None
