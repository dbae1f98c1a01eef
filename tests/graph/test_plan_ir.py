import dataclasses

import pytest
import torch

import udnn_lab as ul
from udnn_lab import zoo
from udnn_lab.graph.plan_ir import replay_reads
from udnn_lab.planning import Offload, Plan, PlanError, Recompute


@pytest.fixture(scope="module")
def graph():
    return ul.trace(zoo.get("resnet18", batch=2, image_size=32, device="meta"))


def _feature_map(graph, skip=0):
    maps = [t for t in graph.tensors if t.category == "feature_map" and t.producer is not None]
    return maps[skip]


def test_keep_all_is_valid_and_keeps_everything(graph):
    plan = Plan.keep_all(graph)
    plan.validate(graph)
    assert plan.action(_feature_map(graph).id) is None


def test_a_good_offload_validates(graph):
    t = _feature_map(graph)
    plan = Plan("p", graph.fingerprint, offloads=(Offload(t.id, t.last_forward_use, t.first_backward_use - 1),))
    plan.validate(graph)
    assert plan.action(t.id).after_op == t.last_forward_use


def test_offloading_before_the_last_forward_use_is_refused(graph):
    t = next(t for t in graph.tensors if t.category == "feature_map" and t.last_forward_use > t.producer)
    plan = Plan("p", graph.fingerprint, offloads=(Offload(t.id, t.producer, t.first_backward_use - 1),))
    with pytest.raises(PlanError, match="before its last forward use"):
        plan.validate(graph)


def test_prefetching_too_late_is_refused(graph):
    t = _feature_map(graph)
    plan = Plan("p", graph.fingerprint, offloads=(Offload(t.id, t.last_forward_use, t.first_backward_use),))
    with pytest.raises(PlanError, match="not before its first backward use"):
        plan.validate(graph)


def test_parameters_and_unsaved_tensors_are_refused(graph):
    weight = graph.tensor("conv1.weight")
    with pytest.raises(PlanError, match="never offloaded"):
        Plan("p", graph.fingerprint, offloads=(Offload(weight.id, 5, 300),)).validate(graph)
    temporary = next(t for t in graph.tensors if t.category == "temporary" and t.producer is not None)
    with pytest.raises(PlanError, match="not saved"):
        Plan("p", graph.fingerprint, offloads=(Offload(temporary.id, 5, 300),)).validate(graph)


def test_two_actions_for_one_tensor_are_refused(graph):
    t = _feature_map(graph)
    offload = Offload(t.id, t.last_forward_use, t.first_backward_use - 1)
    recompute = Recompute((t.id,), (t.producer,), t.first_backward_use)
    with pytest.raises(PlanError, match="more than one action"):
        Plan("p", graph.fingerprint, offloads=(offload,), recomputes=(recompute,)).validate(graph)


def test_recompute_rules(graph):
    from tests.simulation.test_simulator import recomputable

    t = recomputable(graph, min_bytes=0)
    Plan("p", graph.fingerprint, recomputes=(Recompute((t.id,), (t.producer,), t.first_backward_use),)).validate(graph)
    with pytest.raises(PlanError, match="must re-run its producer"):
        Plan("p", graph.fingerprint, recomputes=(Recompute((t.id,), (t.producer - 1,), t.first_backward_use),)
             ).validate(graph)
    with pytest.raises(PlanError, match="after its first backward use"):
        Plan("p", graph.fingerprint, recomputes=(Recompute((t.id,), (t.producer,), t.first_backward_use + 1),)
             ).validate(graph)
    source = graph.tensors[graph.ops[t.producer].inputs[0]]
    if source.category == "feature_map":
        offload = Offload(source.id, source.last_forward_use, source.first_backward_use - 1)
        with pytest.raises(PlanError, match="also drops"):
            Plan("p", graph.fingerprint, offloads=(offload,),
                 recomputes=(Recompute((t.id,), (t.producer,), t.first_backward_use),)).validate(graph)


def test_a_plan_knows_its_graph(graph):
    other = ul.trace(zoo.get("mlp3", batch=2))
    with pytest.raises(PlanError, match="another graph"):
        Plan.keep_all(other).validate(graph)
    with pytest.raises(PlanError, match="not in this graph"):
        Plan("p", graph.fingerprint, offloads=(Offload(10**6, 1, 2),)).validate(graph)


def test_a_plan_reads_as_a_summary(graph):
    t = _feature_map(graph)
    plan = Plan("p", graph.fingerprint, budget_bytes=3 * 2**20,
                offloads=(Offload(t.id, t.last_forward_use, t.first_backward_use - 1),)).located(graph)
    assert repr(plan) == (f"Plan('p', budget 3.00 MiB: 1 tensor offloaded ({ul.format_bytes(t.nbytes)}), "
                          "0 recomputed by re-running 0 ops, pinned pool 0 B)")


def test_a_replays_sources_include_what_it_reads_before_a_later_op_returns_it_as_a_view():
    """A replayed op that returns its input's storage (a view) does not make that storage: the replay reads it
    (a Llama-3-8B segment plan completed by auto once offloaded such a source, and the validator refused it)."""
    graph = ul.trace(zoo.get("hf:gpt2", small=True, batch=2, seq_len=16, device="meta"), device="cuda")
    forward = [op for op in graph.ops if op.phase == "forward"]
    pairs = [(a.index, b.index, t) for a in forward for t in a.inputs for b in forward[a.index + 1:a.index + 4]
             if t in b.outputs and t not in b.allocated and graph.tensors[t].producer is not None
             and graph.tensors[t].producer < a.index]
    assert pairs, "no op of the step reads a tensor that a later op returns as a view"
    for first, then, tensor in pairs:
        ops = tuple(range(first, then + 1))
        assert tensor in replay_reads(graph, ops)
        made_before = {t for i in range(first, then + 1) for t in graph.ops[i].outputs}
        assert tensor in made_before  # counting every output as made, as the planners once did, loses it


def test_a_step_is_the_same_whichever_fused_attention_kernel_or_batch_norm_backend_the_device_picks():
    from udnn_lab.graph.step_graph import op_family

    kernels = ("flash", "efficient", "cudnn")
    assert {op_family(f"aten._scaled_dot_product_{k}_attention.default") for k in kernels} == {"fused_attention"}
    assert {op_family(f"aten._scaled_dot_product_{k}_attention_backward.default") for k in kernels} == {
        "fused_attention_backward"}
    assert op_family("aten.cudnn_batch_norm.default") == op_family("aten.native_batch_norm.default")
    assert op_family("aten._scaled_dot_product_flash_attention_for_cpu.default") != "fused_attention"  # the CPU's


def test_a_saved_tensor_in_host_memory_is_refused(graph):
    # a fused attention kernel's dropout seed: saved for backward, but on the host, where its backward reads it
    t = _feature_map(graph)
    seed = dataclasses.replace(t, device="cpu")
    on_cuda = dataclasses.replace(graph, device="cuda", tensors=tuple(
        seed if other.id == t.id else dataclasses.replace(other, device="cuda") for other in graph.tensors))
    plan = Plan("p", on_cuda.fingerprint, offloads=(Offload(t.id, t.last_forward_use, t.first_backward_use - 1),))
    with pytest.raises(PlanError, match=f"{t.name} lives on cpu, not on this step's cuda"):
        plan.validate(on_cuda)
    with pytest.raises(PlanError, match="lives on cpu"):
        Plan("p", on_cuda.fingerprint, recomputes=(Recompute((t.id,), (t.producer,), t.first_backward_use),)
             ).validate(on_cuda)


def _fsdp_linears():
    """A rank of an MLP whose Linear layers FSDP2 shards one by one, resharding each after its forward; GELU saves
    its input, the Linear's output, which a replay would rebuild from the Linear's weight."""
    torch.manual_seed(0)
    layers = [m for _ in range(4) for m in (torch.nn.Linear(64, 64), torch.nn.GELU())]
    model = torch.nn.Sequential(*layers, torch.nn.Linear(64, 10))
    work = ul.Workload(model=model, example_input=torch.randn(256, 64), target=torch.randint(0, 10, (256,)),
                       loss_fn=torch.nn.functional.cross_entropy, optimizer=torch.optim.AdamW(model.parameters()),
                       name="mlp")

    def each_linear(model, shard):
        for module in model.modules():
            if isinstance(module, torch.nn.Linear):
                shard(module)

    return ul.trace(work, parallel=ul.FSDP(2, wrap=each_linear))


def test_a_replay_may_not_read_a_parameter_fsdp_lets_go_after_forward_and_no_planner_makes_one():
    graph = _fsdp_linears()
    freed_early = {t.id for t in graph.tensors if t.category == "parameter" and t.free_step is not None
                   and t.first_backward_use is None}
    # a Linear's output, which GELU saves, rebuilt from its input: the weight's transpose and the matmul again
    matmul = next(op for op in graph.ops if op.name == "aten.addmm.default" and op.phase == "forward"
                  and graph.tensors[op.outputs[0]].first_backward_use is not None)
    chain = (matmul.index - 1, matmul.index)
    assert set(replay_reads(graph, chain)) & freed_early
    saved = matmul.outputs[0]
    rebuild = Recompute((saved,), chain, graph.tensors[saved].first_backward_use)
    with pytest.raises(PlanError, match="FSDP2 lets go after its module's forward"):
        Plan("p", graph.fingerprint, recomputes=(rebuild,)).validate(graph)
    recomputed = 0
    for policy in ("recompute", "auto"):
        low = ul.min_budget(graph, policy, hardware="h100-sxm")
        for budget in (low, (low + graph.peak_bytes) // 2):
            for recompute in ul.plan(graph, budget, policy, hardware="h100-sxm").recomputes:
                read = replay_reads(graph, recompute.ops)
                assert not any(graph.tensors[t].free_step < recompute.at_op for t in read & freed_early), policy
                recomputed += 1
    assert recomputed
