"""An FSDP2 rank that offloads its parameters: its copies across and its optimizer step on the host, simulated
(NOTE [collectives] 8 in simulation/_communication.py)."""

import dataclasses
import math

import pytest
import torch
from torch.distributed.fsdp import MixedPrecisionPolicy

import udnn_lab as ul
from udnn_lab import zoo
from udnn_lab.hardware.profiles import Hardware

H100 = Hardware.load("h100-sxm")


@pytest.fixture(scope="module")
def mlp():
    return zoo.get("mlp3", batch=4, optimizer="adam")


def _shards(work, world_size: int) -> dict[str, int]:
    return {name: math.ceil(p.shape[0] / world_size) * p[0].numel() * 4 for name, p in work.model.named_parameters()}


def _offloaded(work, world_size: int, reshard: bool = True) -> ul.Graph:
    spec = ul.FSDP(world_size, reshard_after_forward=reshard, offload_params=True)
    return ul.trace(work, device="cuda", parallel=spec)


@pytest.mark.parametrize("reshard", [True, False])
@pytest.mark.parametrize("world_size", [2, 4])
def test_a_step_copies_each_shard_per_gather_and_each_gradient_shard_once(mlp, world_size, reshard):
    simulation = ul.simulate(_offloaded(mlp, world_size, reshard), hardware=H100)
    shards = _shards(mlp, world_size)
    gathers = 2 if reshard else 1  # forward, and backward again when resharded after forward
    assert simulation.h2d_bytes == gathers * sum(shards.values())
    assert simulation.d2h_bytes == sum(shards.values())  # rank 0's gradient shards are as long as its shards
    rows = simulation.timeline
    to_device, to_host = rows[rows.kind == "shard_to_device"], rows[rows.kind == "gradient_to_host"]
    assert set(to_device.stream) == {"h2d"} and set(to_host.stream) == {"d2h"}
    assert sorted(to_host.nbytes) == sorted(shards.values())
    assert sorted(to_device.nbytes) == sorted(list(shards.values()) * gathers)


def test_the_copies_are_timed_on_the_host_link_shared_by_the_ranks_on_the_node(mlp):
    simulation = ul.simulate(_offloaded(mlp, 4), hardware=H100)
    shared = min(H100.h2d_pinned_bytes_per_s, H100.host_memory_bytes_per_s / 4)  # four ranks on the node
    rows = simulation.timeline[simulation.timeline.kind == "shard_to_device"]
    expected = H100.h2d_pinned_latency_s + rows.nbytes / shared
    assert (rows.end_s - rows.start_s).to_numpy() == pytest.approx(expected.to_numpy(), rel=1e-12)


def test_a_copy_in_starts_once_its_shards_are_on_the_device(mlp):
    graph = _offloaded(mlp, 2)
    rows = ul.simulate(graph, hardware=H100).timeline.set_index("op")
    copy_ins = [op for op in graph.ops if op.name == "fsdp.all_gather_copy_in.default"]
    for op in copy_ins:
        fed = [graph.tensors[t].producer for t in op.inputs if graph.tensors[t].name.endswith("(device copy)")]
        assert fed and rows.loc[op.index, "start_s"] >= max(rows.loc[fed, "end_s"]) - 1e-15


def test_the_optimizer_steps_at_the_hosts_memory_bandwidth_after_the_last_gradient_is_home(mlp):
    graph = _offloaded(mlp, 2)
    simulation = ul.simulate(graph, hardware=H100)
    ran = simulation.timeline[simulation.timeline.kind == "op"].set_index("op")
    steps = [op for op in graph.ops if op.phase == "optimizer" and op.bytes_read + op.bytes_written > 0]
    for op in steps:
        row = ran.loc[op.index]
        bandwidth = H100.host_memory_bytes_per_s / 2  # the node's host memory, shared by the two ranks
        assert row.end_s - row.start_s == pytest.approx((op.bytes_read + op.bytes_written) / bandwidth, rel=1e-12)
    last_copy = simulation.timeline[simulation.timeline.kind == "gradient_to_host"].end_s.max()
    first_step = simulation.timeline[(simulation.timeline.stream == "compute")
                                     & simulation.timeline.op.isin([op.index for op in steps])].start_s.min()
    assert first_step >= last_copy - 1e-15


def test_a_profile_without_the_hosts_memory_bandwidth_is_refused_with_what_to_do(mlp):
    graph = _offloaded(mlp, 2)
    with pytest.raises(ValueError, match="host_memory_bytes_per_s"):
        ul.simulate(graph, hardware=dataclasses.replace(H100, host_memory_bytes_per_s=None))


def test_offloading_trades_device_memory_for_copies(mlp):
    kept = ul.simulate(ul.trace(mlp, device="cuda", parallel=ul.FSDP(2)), hardware=H100)
    offloaded = ul.simulate(_offloaded(mlp, 2), hardware=H100)
    assert offloaded.peak_bytes < kept.peak_bytes
    assert kept.h2d_bytes == kept.d2h_bytes == 0 and offloaded.h2d_bytes > 0


def test_gathering_in_bfloat16_casts_each_copy_on_the_copy_in_stream(mlp):
    spec = ul.FSDP(2, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16), offload_params=True)
    graph = ul.trace(mlp, device="cuda", parallel=spec)
    rows = ul.simulate(graph, hardware=H100).timeline
    casts = {t.producer for t in graph.tensors if t.name.endswith("(device copy), bfloat16")}
    on_copy_in = rows[rows.op.isin(casts)]
    assert len(on_copy_in) == len(casts) and set(on_copy_in.stream) == {"comm_copy_in"}
    copies = rows[rows.kind == "shard_to_device"].set_index("op")
    for cast in on_copy_in.itertuples():  # each cast after its copy
        (source,) = graph.ops[cast.op].inputs
        assert cast.start_s >= copies.loc[graph.tensors[source].producer, "end_s"] - 1e-15
