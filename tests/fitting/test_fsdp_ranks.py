"""An FSDP2 rank at one world size made from the same rank traced at others (NOTE [FSDP ranks across world
sizes]): equal, field by field, to its own trace."""

import dataclasses

import pytest
import torch
from torch.distributed.fsdp import MixedPrecisionPolicy

import udnn_lab as ul
from tests.corpus.models import CORPUS
from udnn_lab.fitting._fsdp_ranks import TracedSizes, plan_traces, sharded_rows
from udnn_lab.fitting._rank_jobs import same_replica_rank
from udnn_lab.graph import Graph

LLAMA_3_8B_ROWS = (1024, 4096, 14336, 128256)  # k/v projections, hidden, MLP, vocabulary


H100 = "h100-sxm"  # ranks of a GPU cluster, whatever this machine has

def _ops(graph: Graph) -> tuple:
    """The ops, the storages each releases in one order (their last references may go in another each trace: the
    autocast cache's, under 16-mixed)."""
    return tuple(dataclasses.replace(op, released=tuple(sorted(op.released))) for op in graph.ops)


def _same(made: Graph, own: Graph) -> None:
    for name in ("ops", "tensors", "module_calls", "hook_events", "notes", "device", "fake", "model_name"):
        mine, theirs = (_ops(made), _ops(own)) if name == "ops" else (getattr(made, name), getattr(own, name))
        if isinstance(mine, tuple) and mine != theirs:
            first = next(i for i, (a, b) in enumerate(zip(mine, theirs)) if a != b) if len(mine) == len(theirs) \
                else min(len(mine), len(theirs))
            pytest.fail(f"{name} differ from the {first}th on:\n{mine[first:first + 1]}\n{theirs[first:first + 1]}")
        assert mine == theirs, name


def _made_and_traced(work: ul.Workload, traced: list[int], made: list[int], device: str = "cpu",
                     **settings) -> None:
    rows = sharded_rows(work.model)
    assert plan_traces([*traced, *made], rows)[1] == made
    sizes = TracedSizes(rows)
    for size in traced:
        sizes.add(ul.FSDP(size, **settings), ul.trace(work, device=device, parallel=ul.FSDP(size, **settings)))
    for size in made:
        graph = sizes.derive(ul.FSDP(size, **settings))
        assert graph is not None, f"rank 0 of {size} was not made from {traced}"
        _same(graph, ul.trace(work, device=device, parallel=ul.FSDP(size, **settings)))


def test_ranks_are_made_where_the_traced_sizes_span_the_shard_rows_of_every_dim():
    # Llama-3-8B: every dim but the vocabulary's splits evenly up to 1024 ranks; 128256 rows do not over 512
    assert plan_traces([1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024], LLAMA_3_8B_ROWS) == \
        ([1, 2, 4, 512, 1024], [8, 16, 32, 64, 128, 256])
    # each size that splits a dim unevenly in a new way is traced
    assert plan_traces([2, 4, 8, 16], (10, 1024)) == ([2, 4, 8, 16], [])
    assert plan_traces([2, 4, 8, 16, 32, 64], (10, 1024)) == ([2, 4, 8, 16], [32, 64])
    assert plan_traces([2, 4, 8], None) == ([2, 4, 8], [])  # a parameter without dim 0


@pytest.mark.parametrize("settings", [
    {}, {"reshard_after_forward": False}, {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16)},
], ids=["reshard", "no-reshard", "bf16-gather"])
def test_a_made_rank_is_its_own_trace_with_dims_split_evenly_unevenly_and_over_more_ranks_than_rows(settings):
    work = ul.zoo.get("mlp3", batch=2, optimizer="adam")  # Linear layers of 1024 and 10 rows
    _made_and_traced(work, [2, 4, 8, 16], [32, 1024], **settings)


def test_a_made_rank_is_its_own_trace_with_clipping_and_parameters_offloaded_to_the_host():
    work = dataclasses.replace(ul.zoo.get("mlp3", batch=2, optimizer="adam"), clip_grad_norm=1.0)
    _made_and_traced(work, [2, 4, 8, 16], [64], device="cuda", offload_params=True)


def test_a_made_transformer_rank_is_its_own_trace():
    work = ul.zoo.get("hf:llama-3-8b", small=True, batch=1, seq_len=16, device="meta", precision="bf16-mixed")
    _made_and_traced(work, [2, 4], [8], device="cuda")


def test_a_rank_whose_traced_sizes_run_other_ops_is_not_made():
    """fp16 gradients are divided before and after their reduce-scatter, and over 2 ranks the second division is
    by 1, so FSDP2 leaves it out: 2's step is not 4's, and 8 is not made from them."""
    work = ul.zoo.get("mlp3", batch=2, optimizer="adam")
    fp16 = MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float16)
    sizes = TracedSizes(sharded_rows(work.model))
    for size in (2, 4):
        sizes.add(ul.FSDP(size, mp_policy=fp16), ul.trace(work, parallel=ul.FSDP(size, mp_policy=fp16)))
    assert sizes.derive(ul.FSDP(8, mp_policy=fp16)) is None
    table = ul.sweep(work, "1GiB", world_sizes=[2, 4, 1024], setups=["FSDP2"], fsdp_options={"mp_policy": fp16},
                     progress=False, hardware=H100).set_index("world_size")
    assert table.trace_s[1024] > 0  # traced after all
    own = ul.trace(work, device="cuda", parallel=ul.FSDP(1024, mp_policy=fp16))
    assert table.peak_bytes[1024] == own.cuda_peak_bytes


def test_ddp_over_one_rank_is_made_from_ddp_over_two():
    work = ul.zoo.get("mlp3", batch=2, optimizer="adam")
    made = same_replica_rank(ul.DDP(1), ul.DDP(2), ul.trace(work, parallel=ul.DDP(2)))
    _same(made, ul.trace(work, parallel=ul.DDP(1)))


@pytest.mark.parametrize("precision", ["32-true", "16-mixed"])
def test_an_hsdp_rank_is_made_from_one_with_other_replicas_of_the_same_shard_group(precision):
    work = ul.zoo.get("mlp3", batch=2, optimizer="adam", precision=precision)
    fp16 = MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float16)  # divides by the world
    for settings in ({}, {"mp_policy": fp16}):
        made = same_replica_rank(ul.FSDP(32, replicate=8, **settings), ul.FSDP(8, replicate=2, **settings),
                                 ul.trace(work, device="cuda", parallel=ul.FSDP(8, replicate=2, **settings)))
        _same(made, ul.trace(work, device="cuda", parallel=ul.FSDP(32, replicate=8, **settings)))
    table = ul.sweep(work, "1GiB", world_sizes=[8, 16, 64], setups=["HSDP"], ranks_per_node=4, progress=False,
                     hardware=H100)
    assert list(table.trace_s > 0) == [True, False, False]  # 16 and 64: 4 and 16 replicas of 8's shard group


def test_a_sweeps_made_ranks_give_the_rows_their_own_traces_give():
    work = ul.zoo.get("mlp3", batch=2, optimizer="adam")
    table = ul.sweep(work, ["12MiB", "40MiB"], world_sizes=[2, 4, 8, 16, 64], setups=["FSDP2", "FSDP2+offload"],
                     progress=False, hardware=H100)
    made = table[table.trace_s == 0]
    assert set(made.world_size) == {64}
    for size in (2, 64):
        own = ul.sweep(work, ["12MiB", "40MiB"], world_sizes=[size], setups=["FSDP2", "FSDP2+offload"],
                       progress=False, hardware=H100)
        mine = table[table.world_size == size].reset_index(drop=True)
        columns = [c for c in table.columns if c not in ("trace_s", "plan_s")]
        assert mine[columns].equals(own[columns])


CORPUS_SIZES = [2, 4, 8, 16, 32, 64, 1024]


@pytest.mark.slow
@pytest.mark.parametrize("name", [name for name, entry in CORPUS.items() if entry.available
                                  and name not in ("modifies_saved_output", "tied_weights")])
def test_a_made_rank_of_every_corpus_model_is_its_own_trace(name):
    """On architectures nobody designed this for: the first size a sweep would make, against its own trace (where
    a model's dims split unevenly at every size, none is made, and that is what this checks)."""
    work = CORPUS[name].workload()
    traced, made = plan_traces(CORPUS_SIZES, sharded_rows(work.model))
    if made:
        _made_and_traced(work, [size for size in traced if size < made[0]], made[:1])
    else:
        assert traced == CORPUS_SIZES
