"""trace(..., parallel=...): one rank of DDP or FSDP2, traced from this process (real ranks: test_one_rank_gloo.py)."""

import math
import sys
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import DataDependentOutputException, FakeTensorMode
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

import udnn_lab as ul
from udnn_lab import zoo
from udnn_lab.analysis import _local_shards as local_shards
from udnn_lab.analysis import one_rank
from udnn_lab.analysis._fake_group import fake_process_group
from udnn_lab.errors import ModelInputError

ALL_GATHER, REDUCE_SCATTER = "c10d._allgather_base_.default", "c10d._reduce_scatter_base_.default"


@pytest.fixture
def mlp():
    return zoo.get("mlp3", batch=4, optimizer="adam")


def _bytes(graph: ul.Graph, category: str, *, before_the_step: bool = True) -> int:
    return sum(t.nbytes for t in graph.tensors if t.category == category and (t.alloc_step < 0) == before_the_step)


def test_the_users_model_and_optimizer_are_left_as_they_were_and_no_process_group_is_left(mlp):
    weights = {name: p.detach().clone() for name, p in mlp.model.named_parameters()}
    hook, resize = sys.excepthook, torch.UntypedStorage.resize_
    for spec in (ul.DDP(2), ul.FSDP(2)):
        ul.trace(mlp, parallel=spec)
        assert not dist.is_initialized()
        assert sys.excepthook is hook  # a process group prefixes "[rank0]: " to uncaught errors; it is gone
        assert torch.UntypedStorage.resize_ is resize  # noted while the step ran (NOTE [resized storages] 4)
        assert not any(isinstance(m, FSDPModule) for m in mlp.model.modules())
        assert all(type(p) is torch.nn.Parameter and torch.equal(p, weights[name])
                   for name, p in mlp.model.named_parameters())
        assert not mlp.optimizer.state and mlp.optimizer.param_groups[0]["params"][0] is mlp.model.net[0].weight
    mlp.model(mlp.example_input).sum().backward()  # still an ordinary model


def test_the_process_group_is_torn_down_when_the_step_fails(mlp):
    with pytest.raises(ModelInputError):
        ul.trace(mlp.model, torch.zeros(4, 5), parallel=ul.FSDP(2))
    assert not dist.is_initialized()


@pytest.mark.compat
def test_fsdp_shards_parameters_and_optimizer_state_the_first_ranks_holding_the_rounded_up_share(mlp):
    graph = ul.trace(mlp, parallel=ul.FSDP(4))
    shards = {name: math.ceil(p.shape[0] / 4) * p[0].numel() * 4 for name, p in mlp.model.named_parameters()}
    sharded = {t.name: t.nbytes for t in graph.tensors if t.category == "parameter" and t.alloc_step < 0}
    assert sharded == shards  # net.4.weight: 10 rows over 4 ranks, 3 on rank 0
    moments = {t.name: t.nbytes for t in graph.tensors if t.name.endswith((".exp_avg", ".exp_avg_sq"))}
    assert moments == {f"{name}.{m}": size for name, size in shards.items() for m in ("exp_avg", "exp_avg_sq")}
    last = ul.trace(mlp, parallel=ul.FSDP(4, rank=3))  # 1 row of net.4.weight: less optimizer state
    assert _bytes(last, "optimizer_state") == _bytes(graph, "optimizer_state") - 2 * 4 * (2 * 1024 + 2)
    assert ul.trace(mlp, parallel=ul.FSDP(1024)).tensor("net.2.weight").nbytes == 1024 * 4  # one row each


def test_unsharded_parameters_are_gathered_for_each_block_and_freed_after_it_or_kept_to_backward(mlp):
    resharded = ul.trace(mlp, parallel=ul.FSDP(2))
    kept = ul.trace(mlp, parallel=ul.FSDP(2, reshard_after_forward=False))
    for graph, gathers in ((resharded, 2), (kept, 1)):  # forward and backward, or forward only
        unsharded = [t for t in graph.tensors if t.name.endswith("(unsharded)")]
        assert {t.category for t in unsharded} == {"parameter"}
        assert len(unsharded) == gathers * len(list(mlp.model.parameters()))
        assert all(t.producer is not None and t.free_step is not None for t in unsharded)
    backward = [op.name for op in resharded.ops if op.phase == "backward"]
    # before the first block's backward computes, FSDP2 has gathered it and prefetched the next one
    assert backward[:backward.index("aten.mm.default")].count(ALL_GATHER) == 2
    assert ALL_GATHER not in [op.name for op in kept.ops if op.phase == "backward"]
    assert kept.peak_bytes > resharded.peak_bytes


def test_fsdp_communication_buffers_live_within_the_step_and_feed_the_collectives(mlp):
    graph = ul.trace(mlp, parallel=ul.FSDP(2))
    buffers = [t for t in graph.tensors if t.category == "communication"]
    assert buffers and all(0 <= t.alloc_step < t.free_step for t in buffers)
    fed = {graph.ops[i].name for t in buffers for i in t.consumers} & {ALL_GATHER, REDUCE_SCATTER}
    assert fed == {ALL_GATHER, REDUCE_SCATTER}
    assert graph.breakdown().loc["communication", "max_bytes"] > 0


@pytest.mark.compat
def test_ddp_buckets_hold_a_second_copy_of_the_gradients_unless_the_gradients_are_their_views(mlp):
    parameters = sum(p.numel() * 4 for p in mlp.model.parameters())
    copies = ul.trace(mlp, parallel=ul.DDP(2))
    views = ul.trace(mlp, parallel=ul.DDP(2, gradient_as_bucket_view=True))
    assert _bytes(copies, "communication") == parameters and _bytes(copies, "parameter") == parameters
    assert _bytes(views, "communication") == 0 and _bytes(views, "parameter_gradient") == parameters
    assert copies.peak_bytes - views.peak_bytes == parameters
    single = ul.trace(mlp)
    assert copies.peak_bytes == single.peak_bytes + parameters  # a replica, plus its buckets


def test_a_wrapping_function_of_ones_own_picks_the_blocks(mlp):
    def middle_only(model, shard):
        shard(model.net[2], reshard_after_forward=False)

    graph = ul.trace(mlp, parallel=ul.FSDP(2, wrap=middle_only))
    gathered = [t.name for t in graph.tensors if t.name.endswith("(unsharded)")]
    assert sorted(gathered) == sorted(f"{name} (unsharded)" for name, _ in mlp.model.named_parameters())
    assert graph.notes[0] == "rank 0 of FSDP2 over 2 ranks (reshard after forward)"


def test_a_workload_made_with_a_spec_is_traced_as_that_rank_and_a_spec_given_to_trace_wins(mlp):
    carried = zoo.get("mlp3", batch=4, optimizer="adam", parallel=ul.FSDP(2))
    fsdp, ddp = ul.trace(mlp, parallel=ul.FSDP(2)), ul.trace(mlp, parallel=ul.DDP(2))
    assert fsdp.fingerprint != ddp.fingerprint
    traced = ul.trace(carried)
    assert traced.fingerprint == fsdp.fingerprint and traced.notes == fsdp.notes
    assert ul.trace(carried, parallel=ul.DDP(2)).fingerprint == ddp.fingerprint
    assert ul.trace(replace(carried, parallel=None)).fingerprint == ul.trace(mlp).fingerprint


def test_what_a_parallel_trace_cannot_do_is_refused_with_what_to_do_instead(mlp):
    with pytest.raises(ValueError, match="leave fake=True"):
        ul.trace(mlp, parallel=ul.DDP(2), fake=False)
    with pytest.raises(TypeError, match="parallel is ul.DDP"):
        ul.trace(mlp, parallel=2)
    with fake_process_group(2):  # a job's process: its own rank over a 1-D mesh only
        with pytest.raises(RuntimeError, match="already has a process group"):
            ul.trace(mlp, parallel=ul.FSDP(2, replicate=2))
        with pytest.raises(RuntimeError, match="it is rank 0 of 2, the trace was asked for rank 1 of 2"):
            ul.trace(mlp, parallel=ul.FSDP(2, rank=1))
    assert not dist.is_initialized()


def test_a_ddp_rank_all_reduces_once_a_step_in_its_last_micro_batch(mlp):
    one = ul.trace(mlp, parallel=ul.DDP(2))
    two = ul.trace(mlp, parallel=ul.DDP(2), grad_accumulation=2)

    def all_reduces(graph):
        return [op.index for op in graph.ops if "allreduce" in op.name]

    assert len(all_reduces(two)) == len(all_reduces(one)) > 0
    second_forward = [op.index for op in two.ops if op.phase == "forward"][-1]
    assert min(all_reduces(two)) > second_forward  # none in the first micro-batch's backward (no_sync)


def test_a_ddp_rank_that_finds_unused_parameters_is_traced_with_its_outputs_passed_through(mlp):
    """NOTE [one rank of N] 6: the reducer's used-parameter marks are real and unrecorded; DDP's sink copies the
    forward's outputs, which the step then holds (Hugging Face's Trainer turns the option on by default)."""
    plain = ul.trace(mlp, parallel=ul.DDP(2))
    finding = ul.trace(mlp, parallel=ul.DDP(2, find_unused_parameters=True))
    added = [op.name for op in finding.ops[:len(finding.ops) - len(plain.ops) + 40] if op.phase == "forward"]
    assert len(finding.ops) == len(plain.ops) + 1 and "aten.clone.default" in added
    assert not any("fill_" in op.name for op in finding.ops)  # the marks' ops are the reducer's, not the step's


@pytest.mark.compat
def test_a_ddp_rank_is_traced_inside_the_job_that_runs_it(mlp):
    """NOTE [one rank of N] 5: a trainer's callback traces its own rank beside the job's process group."""
    alone = ul.trace(mlp, parallel=ul.DDP(2, rank=1))
    with fake_process_group(2, rank=1):  # the job's group
        inside = ul.trace(mlp, parallel=ul.DDP(2, rank=1))
        with pytest.raises(RuntimeError, match="rank 1 of 2, the trace was asked for rank 0 of 4"):
            ul.trace(mlp, parallel=ul.DDP(4))
        assert dist.get_world_size() == 2 and dist.get_backend() == "fake"  # the job's group as it was
    assert inside.fingerprint == alone.fingerprint and inside.peak_bytes == alone.peak_bytes
    assert not dist.is_initialized()


def test_fully_shard_under_fake_tensors_reads_a_value_only_where_it_makes_its_own_mesh():
    """NOTE [one rank of N] 2: FSDPMemTracker's recipe stops in DeviceMesh, which a mesh made first avoids."""
    with fake_process_group(2) as mesh:
        with FakeTensorMode(), pytest.raises(DataDependentOutputException, match="_local_scalar_dense"):
            fully_shard(torch.nn.Linear(4, 4))
        with FakeTensorMode():
            fully_shard(torch.nn.Linear(4, 4), mesh=mesh)


def test_hsdp_shards_within_a_group_and_all_reduces_across_groups(mlp):
    sharded, hsdp, replicated = (ul.trace(mlp, parallel=spec) for spec in
                                 (ul.FSDP(2), ul.FSDP(8, replicate=4), ul.FSDP(8, replicate=8)))
    assert _bytes(hsdp, "parameter") == _bytes(sharded, "parameter")  # shards of 2, as FSDP over 2
    assert _bytes(replicated, "parameter") == sum(p.nbytes for p in mlp.model.parameters())  # one rank per group
    collectives = {name: {op.name for op in g.ops if op.name.startswith("c10d.")}
                   for name, g in (("fsdp", sharded), ("hsdp", hsdp), ("replicated", replicated))}
    assert collectives["fsdp"] == {ALL_GATHER, REDUCE_SCATTER}
    assert collectives["hsdp"] == {ALL_GATHER, REDUCE_SCATTER, "c10d.allreduce_.default"}
    assert collectives["replicated"] == {"c10d.allreduce_.default"}
    assert "HSDP over 8 ranks (4 replicas x 2 shards" in hsdp.notes[0]


@pytest.mark.parametrize(("model", "optimizer"), [("mlp3", "adamw"), ("resnet20", "adam"), ("resnet20", "sgd"),
                                                 ("resnet20", "sgd-momentum")])
@pytest.mark.parametrize("device", ["cpu", "cuda"])  # CUDA: the foreach kernels
def test_an_fsdp_rank_steps_its_shards_as_the_dtensor_optimizer_does_with_warm_caches(monkeypatch, model, optimizer,
                                                                                      device):
    """NOTE [local shard steps]: the same ops and bytes as DTensor's own dispatch of the step, once DTensor has met
    the step's ops in warm-up (its first propagation runs ops of its own, which a trace would record as the step's)."""
    work = zoo.get(model, batch=4, optimizer="sgd" if optimizer.startswith("sgd") else optimizer)
    if optimizer.startswith("sgd"):
        momentum = 0.9 if optimizer == "sgd-momentum" else 0.0
        work = replace(work, optimizer=torch.optim.SGD(work.model.parameters(), lr=0.1, momentum=momentum))
    for rank in (0, 3):  # uneven shards on rank 3: 10 rows over 4 ranks, padded
        spec = ul.FSDP(4, rank=rank)
        with monkeypatch.context() as patch:
            made = []
            patch.setattr(one_rank, "steps_on_shards", lambda opt, *a: made.append(
                local_shards.steps_on_shards(opt, *a)) or made[-1])
            on_shards = ul.trace(work, device=device, parallel=spec)
        assert isinstance(made[0], local_shards.LocalShardSteps)
        with monkeypatch.context() as patch:
            patch.setattr(one_rank, "steps_on_shards", lambda opt, *_: opt)  # two warm-up steps ([local shard steps] 6)
            on_dtensors = ul.trace(work, device=device, parallel=spec)
        assert [op.name for op in on_shards.ops] == [op.name for op in on_dtensors.ops]
        assert [(t.name, t.nbytes) for t in on_shards.tensors] == [(t.name, t.nbytes) for t in on_dtensors.tensors]
        assert (on_shards.memory_curve()["live_bytes"] == on_dtensors.memory_curve()["live_bytes"]).all()


@pytest.mark.parametrize("options", [{"clip_grad_norm": 1.0}, {"precision": "16-mixed"}])
def test_a_rank_stepped_through_dtensor_traces_the_same_whatever_ran_before_it(options):
    """NOTE [local shard steps] 6: clipping or a GradScaler steps the DTensor optimizer, whose propagation runs ops of
    its own the first time it meets an op; the warm-up meets them all, so a cold start records none of them."""
    work = zoo.get("mlp3", batch=4, optimizer="sgd", precision=options.get("precision"))
    work = replace(work, optimizer=torch.optim.SGD(work.model.parameters(), lr=0.1, momentum=0.9),
                   clip_grad_norm=options.get("clip_grad_norm"))
    propagator = DTensor._op_dispatcher.sharding_propagator
    propagator.propagate_op_sharding.cache_clear()
    propagator._propagate_tensor_meta_cached.cache_clear()
    cold = ul.trace(work, device="cuda", parallel=ul.FSDP(2))
    warm = ul.trace(work, device="cuda", parallel=ul.FSDP(2))
    assert [op.name for op in cold.ops] == [op.name for op in warm.ops]
    assert cold.cuda_peak_bytes == warm.cuda_peak_bytes


@pytest.mark.compat
def test_dtensor_s_propagation_missing_its_cache_records_nothing_of_its_own(monkeypatch):
    """NOTE [local shard steps] 7: on a torch whose propagation cache misses every step (torch 2.11 keys Adam's
    ``addcdiv_`` by its step size), the ops it reasons with are not the step's. Here its caches miss every lookup;
    newer torch caches DTensor's dispatch above them too, so this fails without the fix on the oldest torch only."""
    work = zoo.get("mlp3", batch=4, optimizer="adamw")
    work = replace(work, clip_grad_norm=1.0)  # the DTensor optimizer steps ([local shard steps] 5)
    cached = ul.trace(work, parallel=ul.FSDP(4))
    propagator = DTensor._op_dispatcher.sharding_propagator
    monkeypatch.setattr(propagator, "propagate_op_sharding", propagator.propagate_op_sharding_non_cached)
    monkeypatch.setattr(propagator, "_propagate_tensor_meta",
                        lambda schema: propagator._propagate_tensor_meta_non_cached(schema))
    missing = ul.trace(work, parallel=ul.FSDP(4))
    assert [op.name for op in missing.ops] == [op.name for op in cached.ops]
    assert missing.peak_bytes == cached.peak_bytes
    assert "_propagate_tensor_meta_non_cached" not in vars(propagator)  # the class's own again


def test_nested_and_overlapping_recorded_steps_leave_dtensor_s_propagation_as_it_was():
    propagator = DTensor._op_dispatcher.sharding_propagator
    before = vars(propagator).get("_propagate_tensor_meta_non_cached")
    outer, inner = local_shards.propagation_unrecorded(), local_shards.propagation_unrecorded()
    outer.__enter__()
    wrapped = propagator._propagate_tensor_meta_non_cached
    inner.__enter__()
    assert propagator._propagate_tensor_meta_non_cached is wrapped  # wrapped once, however many steps record
    outer.__exit__(None, None, None)  # the first to start ends first (another thread's trace)
    assert propagator._propagate_tensor_meta_non_cached is wrapped  # the other step still records
    inner.__exit__(None, None, None)
    assert vars(propagator).get("_propagate_tensor_meta_non_cached") is before


def test_in_a_job_a_model_wrapped_in_ddp_is_traced_as_this_rank_of_it(mlp):
    """A DistributedDataParallel of the job's own, traced as it is, is this process's rank of DDP with the wrapper's
    settings, not a one-process step without its buckets."""
    with fake_process_group(2):
        wrapper = DistributedDataParallel(mlp.model, bucket_cap_mb=1)
        wrapped = ul.trace(replace(mlp, model=wrapper, optimizer=torch.optim.Adam(wrapper.parameters())))
        assert wrapper.module is mlp.model
    spec = ul.trace(replace(mlp, optimizer=torch.optim.Adam(mlp.model.parameters())),
                    parallel=ul.DDP(2, bucket_cap_mb=1))
    assert wrapped.fingerprint == spec.fingerprint and wrapped.peak_bytes == spec.peak_bytes
    assert wrapped.notes[0] == "rank 0 of DDP over 2 ranks (1 MiB buckets)"
