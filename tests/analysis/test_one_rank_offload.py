"""trace(..., parallel=FSDP(..., offload_params=True)): what one rank keeps on the device and on the host, against
the model's own parameter sizes (NOTE [host storages])."""

import math

import pytest
import torch
from torch.distributed.fsdp import MixedPrecisionPolicy

import udnn_lab as ul
from udnn_lab import zoo

ALL_GATHER, COPY_IN = "c10d._allgather_base_.default", "fsdp.all_gather_copy_in.default"
REDUCE_SCATTER = "c10d._reduce_scatter_base_.default"
BF16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16)  # gathered in bfloat16, reduced in it, then cast back


@pytest.fixture(scope="module")
def mlp():
    return zoo.get("mlp3", batch=4, optimizer="adam")


def _shards(work, world_size: int) -> dict[str, int]:
    """Rank 0's float32 shard of each parameter: the first ceil(rows / world_size) rows (FSDP2 pads the others)."""
    return {name: math.ceil(p.shape[0] / world_size) * p[0].numel() * 4 for name, p in work.model.named_parameters()}


def _blocks(work, world_size: int) -> list[int]:
    """Each FSDP2 unit's shard bytes, in forward order (mlp3's units are its three Linear layers)."""
    shards = _shards(work, world_size)
    return [sum(size for name, size in shards.items() if name.startswith(f"net.{i}.")) for i in (0, 2, 4)]


def _traces(work, world_size: int, reshard: bool, mp: MixedPrecisionPolicy | None):
    spec = {"reshard_after_forward": reshard, "mp_policy": mp}
    return (ul.trace(work, device="cuda", parallel=ul.FSDP(world_size, **spec)),
            ul.trace(work, device="cuda", parallel=ul.FSDP(world_size, offload_params=True, **spec)))


def _live_at(graph: ul.Graph, name: str) -> list[int]:
    curve = graph.memory_curve()["live_bytes"]
    return [int(curve[op.index]) for op in graph.ops if op.name == name]


CASES = [(w, r, mp) for w in (2, 4) for r in (True, False) for mp in (None, BF16)]


@pytest.mark.parametrize(("world_size", "reshard", "mp"), CASES)
def test_the_host_holds_the_shards_their_gradients_and_the_optimizer_state(mlp, world_size, reshard, mp):
    kept, offloaded = _traces(mlp, world_size, reshard, mp)
    shards = sum(_shards(mlp, world_size).values())
    counters = 4 * len(list(mlp.model.parameters()))  # Adam's step counters: on the host in both
    host = offloaded.breakdown()["host_bytes"]
    assert host["parameter"] == shards
    assert host["parameter_gradient"] == shards  # rank 0's gradient shards are as long as its parameter shards
    assert host["optimizer_state"] == 2 * shards + counters  # Adam's two moments
    assert kept.breakdown()["host_bytes"]["optimizer_state"] == counters
    on_device = offloaded.breakdown()
    assert on_device.loc["parameter_gradient", "max_bytes"] == 0 and on_device.loc["optimizer_state", "max_bytes"] == 0
    assert kept.baseline_bytes - offloaded.baseline_bytes == 3 * shards  # shards and moments left the device
    assert offloaded.host_peak_bytes >= host["parameter"] + host["parameter_gradient"] + host["optimizer_state"]
    assert any("this rank's host memory holds" in note for note in offloaded.notes)


@pytest.mark.parametrize(("world_size", "reshard", "mp"), CASES)
def test_each_all_gather_finds_the_device_lighter_by_what_left_it_and_heavier_by_the_shards_copies(
        mlp, world_size, reshard, mp):
    """At every all-gather, offloaded minus kept device bytes = the block's device copies (float32; with bfloat16
    gathering both hold a bfloat16 copy of the block's shards, FSDP2's foreach copy or the copy's cast) - the shards
    and moments (3 x shards) - the gradient shards of the blocks already reduced (the kept rank holds them)."""
    kept, offloaded = _traces(mlp, world_size, reshard, mp)
    blocks, shards = _blocks(mlp, world_size), sum(_shards(mlp, world_size).values())
    gathered = ([0, 1, 2] + ([2, 1, 0] if reshard else []))  # forward, then backward's re-gathers (last block first)
    # with resharding, backward gathers block b while the blocks after it are reduced: the last block is reduced
    # before the first block is gathered (the gather of block 1 is prefetched before block 2's reduce-scatter)
    reduced_before = [0, 0, 0] + ([0, 0, blocks[2]] if reshard else [])
    copies = [0 if mp is not None else blocks[b] for b in gathered]
    expected = [copy - 3 * shards - done for copy, done in zip(copies, reduced_before, strict=True)]
    differences = [o - k for o, k in zip(_live_at(offloaded, ALL_GATHER), _live_at(kept, ALL_GATHER), strict=True)]
    assert differences == expected


@pytest.mark.parametrize(("world_size", "reshard", "mp"), CASES)
def test_the_device_peak_drops_by_the_shards_moments_and_gradients_less_the_copies(mlp, world_size, reshard, mp):
    kept, offloaded = _traces(mlp, world_size, reshard, mp)
    shards, largest_block = sum(_shards(mlp, world_size).values()), max(_blocks(mlp, world_size))
    drop = kept.peak_bytes - offloaded.peak_bytes
    assert 3 * shards - largest_block <= drop <= 4 * shards


@pytest.mark.parametrize("mp", [None, BF16])
def test_the_copies_across_are_a_shard_per_parameter_per_gather_and_a_gradient_shard_per_parameter(mlp, mp):
    _, graph = _traces(mlp, 2, True, mp)
    shards = _shards(mlp, 2)
    copies = [t for t in graph.tensors if t.name.endswith("(device copy)")]
    # forward gathers each parameter, backward again (resharded after forward)
    assert sorted((t.name, t.nbytes) for t in copies) == sorted(
        (f"{name} (device copy)", size) for name, size in shards.items() for _ in range(2))
    assert all(t.category == "communication" and t.device == "cuda" and t.free_step is not None for t in copies)
    if mp is not None:  # each copy is cast to bfloat16 at once, and the float32 copy goes
        casts = [t for t in graph.tensors if t.name.endswith("(device copy), bfloat16")]
        assert sorted(t.nbytes for t in casts) == sorted(t.nbytes // 2 for t in copies)
        assert all(t.free_step == t.alloc_step + 1 for t in copies)
    gradients = {t.name: t for t in graph.tensors if t.category == "parameter_gradient"}
    assert {name: t.nbytes for name, t in gradients.items()} == {f"grad:{name}": size for name, size in shards.items()}
    assert all(t.device == "cpu" and graph.ops[t.producer].phase == "backward" for t in gradients.values())
    outputs = [graph.tensors[op.inputs[0]] for op in graph.ops if op.name == REDUCE_SCATTER]
    # the reduce-scatter's output goes as soon as its gradients are on the host, not at the end of the step
    assert outputs and all(t.free_step is not None and graph.ops[t.free_step].phase == "backward" for t in outputs)


def test_the_optimizer_steps_on_the_host(mlp):
    _, graph = _traces(mlp, 2, True, None)
    stepped = [op for op in graph.ops if op.phase == "optimizer" and op.allocated]
    assert stepped and all(graph.tensors[t].device == "cpu" for op in stepped for t in op.allocated)
    assert graph.breakdown().loc["temporary", "host_bytes"] == sum(_shards(mlp, 2).values())  # Adam's sqrt


def test_a_trace_counted_on_the_cpu_keeps_one_memory(mlp):
    """NOTE [host storages] 5: host and device are one memory; FSDP2's copies are no-ops, the step is the same."""
    kept = ul.trace(mlp, parallel=ul.FSDP(2))
    offloaded = ul.trace(mlp, parallel=ul.FSDP(2, offload_params=True))
    assert [op.name for op in offloaded.ops] == [op.name for op in kept.ops]
    assert offloaded.peak_bytes == kept.peak_bytes and offloaded.host_peak_bytes == 0


@pytest.mark.parametrize("spec", [ul.FSDP(1, offload_params=True), ul.FSDP(2, replicate=2, offload_params=True)])
def test_a_shard_group_of_one_rank_copies_its_whole_parameters_across(mlp, spec):
    """FSDP2 then copies each shard into the unsharded parameter itself, and the reduce-scatter's input into its
    output: the whole model goes to the device for each gather and its gradients to the host."""
    graph = ul.trace(mlp, device="cuda", parallel=spec)
    whole = sum(_shards(mlp, 1).values())
    host = graph.breakdown()["host_bytes"]
    assert host["parameter"] == host["parameter_gradient"] == whole
    simulation = ul.simulate(graph, hardware="h100-sxm")
    assert simulation.d2h_bytes == whole and simulation.h2d_bytes == 2 * whole  # forward and backward


def test_gradients_of_several_micro_batches_accumulate_on_the_host(mlp):
    graph = ul.trace(mlp, device="cuda", parallel=ul.FSDP(2, offload_params=True), grad_accumulation=2)
    shards = sum(_shards(mlp, 2).values())
    accumulated = [op for op in graph.ops if op.phase == "backward" and op.name == "aten.add_.Tensor"]
    assert accumulated and all(graph.tensors[t].device == "cpu" for op in accumulated for t in op.inputs)
    assert graph.breakdown()["host_bytes"]["parameter_gradient"] == shards
    assert ul.simulate(graph, hardware="h100-sxm").d2h_bytes == 2 * shards  # each micro-batch's gradients


def test_a_small_gpt2_rank_keeps_its_shards_on_the_host_and_gathers_all_but_the_roots_twice():
    work = zoo.get("hf:gpt2", batch=2, small=True, seq_len=64, optimizer="adamw")
    kept = ul.trace(work, device="cuda", parallel=ul.FSDP(4))
    offloaded = ul.trace(work, device="cuda", parallel=ul.FSDP(4, offload_params=True))
    shards = _shards(work, 4)
    in_blocks = sum(size for name, size in shards.items() if name.startswith("transformer.h."))
    host = offloaded.breakdown()["host_bytes"]
    assert host["parameter"] == host["parameter_gradient"] == sum(shards.values())
    assert kept.baseline_bytes - offloaded.baseline_bytes == 3 * sum(shards.values())  # AdamW: two moments
    assert offloaded.peak_bytes < kept.peak_bytes
    simulation = ul.simulate(offloaded, hardware="h100-sxm")
    # the root (embeddings, final norm; the head is tied to the embedding) keeps its parameters to backward
    assert simulation.h2d_bytes == sum(shards.values()) + in_blocks
    assert simulation.d2h_bytes == sum(shards.values())
