"""Collectives of one rank of N on their own stream (NOTE [collectives] in simulation/_communication.py)."""

import dataclasses

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as functional
from torch.utils._python_dispatch import TorchDispatchMode

import udnn_lab as ul
from udnn_lab import zoo
from udnn_lab.analysis._fake_group import fake_process_group
from udnn_lab.analysis._recorder import group_layout
from udnn_lab.graph.plan_ir import Offload, Plan
from udnn_lab.hardware.profiles import Hardware
from udnn_lab.simulation._communication import ring

H100 = Hardware.load("h100-sxm")


@pytest.fixture(scope="module")
def mlp():
    return zoo.get("mlp3", batch=4, optimizer="adam")


@pytest.fixture(scope="module")
def graphs(mlp):
    return {"plain": ul.trace(mlp), "fsdp1": ul.trace(mlp, parallel=ul.FSDP(1)),
            "fsdp8": ul.trace(mlp, parallel=ul.FSDP(8)), "ddp8": ul.trace(mlp, parallel=ul.DDP(8)),
            "ddp64": ul.trace(mlp, parallel=ul.DDP(64)),
            "ddp8_buckets": ul.trace(mlp, parallel=ul.DDP(8, bucket_cap_mb=1))}


def _links(hardware=H100, **figures) -> Hardware:
    return dataclasses.replace(hardware, **figures)


def _collectives(graph):
    return [op for op in graph.ops if op.name.startswith(("c10d.", "_c10d_functional."))]


def test_each_collective_records_the_ranks_of_its_group(graphs):
    assert {op.ranks for op in _collectives(graphs["fsdp8"])} == {8}
    assert {op.ranks for op in _collectives(graphs["ddp64"])} == {64}
    assert {op.ranks for op in graphs["plain"].ops} == {1}
    assert not _collectives(graphs["fsdp1"])  # FSDP2 over one rank communicates nothing


def test_one_rank_costs_no_communication_and_eight_do(graphs):
    one, eight = ul.simulate(graphs["fsdp1"], hardware=H100), ul.simulate(graphs["fsdp8"], hardware=H100)
    assert one.communication_time_s == one.exposed_communication_s == one.communication_bytes == 0
    assert set(one.timeline.stream) == {"compute"}
    assert eight.communication_time_s > 0 and eight.communication_bytes > 0
    assert {"comm", "comm_copy_in"} <= set(eight.timeline.stream)


def test_a_graph_without_collective_ranks_runs_every_op_on_compute_as_before(graphs):
    """An older graph (ranks not recorded) is simulated as it was: every op on the compute stream, one after
    another."""
    graph = graphs["fsdp8"]
    old = dataclasses.replace(graph, ops=tuple(dataclasses.replace(op, ranks=1) for op in graph.ops))
    simulation = ul.simulate(old, hardware=H100)
    assert simulation.step_time_s == pytest.approx(simulation.compute_time_s, rel=1e-12)
    assert simulation.communication_time_s == 0 and set(simulation.timeline.stream) == {"compute"}


def test_the_ring_formulas_time_a_bucket_all_reduce(graphs):
    graph = graphs["ddp8"]
    (op,) = _collectives(graph)
    bucket = max(graph.tensors[t].nbytes for t in op.inputs)
    simulation = ul.simulate(graph, hardware=H100)
    expected = 2 * 7 * H100.intra_node_latency_s + 2 * 7 / 8 * bucket / H100.intra_node_bytes_per_s
    assert simulation.communication_time_s == pytest.approx(expected, rel=1e-12)
    assert simulation.communication_bytes == bucket
    assert ring("c10d._allgather_base_.default", 8)[1:] == (7 / 8, 7)
    assert ring("c10d._reduce_scatter_base_.default", 4)[1:] == (3 / 4, 3)


@pytest.mark.parametrize("name", ["fsdp8", "ddp8", "ddp8_buckets"])
def test_faster_links_never_make_a_slower_step(graphs, name):
    steps = [ul.simulate(graphs[name], hardware=_links(intra_node_bytes_per_s=rate)).step_time_s
             for rate in (1e8, 1e9, 1e10, 1e11, 1e12, 1e13)]
    assert steps == sorted(steps, reverse=True) and steps[0] > steps[-1]


@pytest.mark.parametrize("name", ["fsdp8", "ddp8", "ddp8_buckets"])
def test_with_free_links_everything_is_hidden_and_with_slow_ones_the_step_is_communication(graphs, name):
    graph = graphs[name]
    free = ul.simulate(graph, hardware=_links(intra_node_bytes_per_s=1e18, intra_node_latency_s=0.0))
    assert free.exposed_communication_s < 1e-9
    assert free.step_time_s == pytest.approx(free.compute_time_s, rel=1e-6)
    slow = ul.simulate(graph, hardware=_links(intra_node_bytes_per_s=1e6, intra_node_latency_s=0.0))
    moved = sum(ring(op.name, op.ranks)[1] * max(graph.tensors[t].nbytes for t in (*op.inputs, *op.outputs))
                for op in _collectives(graph))
    assert slow.communication_time_s == pytest.approx(moved / 1e6, rel=1e-9)
    assert slow.communication_time_s <= slow.step_time_s < 1.01 * slow.communication_time_s
    assert slow.exposed_communication_s > 0.95 * slow.communication_time_s


@pytest.mark.parametrize("name", ["fsdp8", "ddp8_buckets"])
def test_collectives_take_turns_on_their_stream_and_the_step_is_at_least_its_compute(graphs, name):
    simulation = ul.simulate(graphs[name], hardware=H100)
    rows = simulation.timeline[simulation.timeline.stream == "comm"].sort_values("start_s")
    assert len(rows) == len(_collectives(graphs[name]))
    assert (rows.start_s.to_numpy()[1:] >= rows.end_s.to_numpy()[:-1]).all()
    assert simulation.step_time_s >= simulation.compute_time_s
    assert simulation.step_time_s >= simulation.lower_bound_s >= simulation.communication_time_s


def test_ddp_all_reduces_overlap_the_rest_of_backward(graphs):
    graph = graphs["ddp8_buckets"]
    assert len(_collectives(graph)) > 1
    simulation = ul.simulate(graph, hardware=H100)
    timeline = simulation.timeline
    first = timeline[timeline.stream == "comm"].start_s.min()
    backward = [op.index for op in graph.ops if op.phase == "backward"]
    computing = timeline[(timeline.stream == "compute") & (timeline.kind == "op") & timeline.op.isin(backward)]
    assert first < computing.end_s.max()  # the first bucket is reduced while backward still computes
    assert simulation.exposed_communication_s < simulation.communication_time_s


def test_fsdp_gathers_at_most_two_blocks_ahead_in_forward(graphs):
    """NOTE [collectives] 4: in forward, block k+1's copy-in waits for block k-1's copy-out."""
    graph = graphs["fsdp8"]
    slow = ul.simulate(graph, hardware=_links(intra_node_bytes_per_s=1e15, intra_node_latency_s=0.0))
    timeline = slow.timeline
    forward = {op.index for op in graph.ops if op.phase == "forward"}
    copy_ins = timeline[(timeline.stream == "comm_copy_in") & timeline.op.isin(forward)].sort_values("op")
    copy_outs = timeline[(timeline.name == "fsdp.split_with_sizes_copy.default") & timeline.op.isin(forward)
                         & (timeline.kind == "op")].sort_values("op")
    assert len(copy_ins) == len(copy_outs) == 3
    assert copy_ins.start_s.iloc[2] >= copy_outs.end_s.iloc[0]
    assert copy_ins.start_s.iloc[1] < copy_outs.start_s.iloc[0]  # the second block is gathered ahead
    # its copy-out waits for its all-gather: compute reads what the all-gather wrote
    gathers = timeline[timeline.kind == "all_gather"].sort_values("op")
    assert (copy_outs.start_s.to_numpy() >= gathers.end_s.to_numpy()[:3]).all()


def test_a_group_across_nodes_is_slower_than_one_inside_a_node(graphs):
    inside = ul.simulate(graphs["fsdp8"], hardware=H100)
    across = ul.simulate(graphs["fsdp8"], hardware=H100, ranks_per_node=4)
    assert across.communication_time_s > 3 * inside.communication_time_s and across.step_time_s > inside.step_time_s
    no_latency = _links(intra_node_latency_s=0.0, inter_node_latency_s=0.0)
    ratio = ul.simulate(graphs["fsdp8"], hardware=no_latency, ranks_per_node=4).communication_time_s \
        / ul.simulate(graphs["fsdp8"], hardware=no_latency).communication_time_s
    assert ratio == pytest.approx(450 / 50)  # the NICs' 50 GB/s against NVLink's 450
    assert ul.simulate(graphs["ddp64"], hardware=H100).communication_time_s > \
        ul.simulate(graphs["ddp64"], hardware=H100, ranks_per_node=64).communication_time_s


def test_a_group_of_ranks_a_node_apart_crosses_nodes_however_few_they_are(graphs):
    """HSDP's replicate group: 2 ranks, 8 apart, one on each node."""
    graph = graphs["ddp8"]
    pair = dataclasses.replace(graph, ops=tuple(dataclasses.replace(op, ranks=2, rank_stride=8) if op.ranks > 1
                                                else op for op in graph.ops))
    neighbours = dataclasses.replace(pair, ops=tuple(dataclasses.replace(op, rank_stride=1) for op in pair.ops))
    no_latency = _links(intra_node_latency_s=0.0, inter_node_latency_s=0.0)
    ratio = ul.simulate(pair, hardware=no_latency).communication_time_s \
        / ul.simulate(neighbours, hardware=no_latency).communication_time_s
    assert ratio == pytest.approx(450 / 50)


@pytest.mark.parametrize("name", ["rtx-4090", "nvidia-h100-80gb-hbm3-measured"])
def test_a_profile_without_multi_gpu_figures_refuses_collectives_and_says_what_to_do(graphs, name):
    with pytest.raises(ValueError, match=r"multi-GPU figures.*intra_node_bytes_per_s.*h100-sxm"):
        ul.simulate(graphs["ddp8"], hardware=name)
    ul.simulate(graphs["plain"], hardware=name)  # a single rank's step needs none
    with pytest.raises(ValueError, match="ranks_per_node"):
        ul.simulate(graphs["ddp8"], hardware=H100, ranks_per_node=0)


def test_a_cpu_runs_ranks_share_its_gloo_link_and_a_cpu_profile_without_one_says_how_to_measure_it(graphs):
    cpu = ul.Hardware.load("cpu-amd-epyc-2cpu")
    timed = ul.simulate(graphs["ddp8"], hardware=cpu)  # 8 ranks, one machine: nothing crosses to another node
    assert timed.communication_time_s > 0
    unmeasured = ul.Hardware.from_dict({**cpu.to_dict(), "intra_node_bytes_per_s": None,
                                        "sources": {k: v for k, v in cpu.sources.items()
                                                    if k != "intra_node_bytes_per_s"}})
    with pytest.raises(ValueError, match=r"intra_node_bytes_per_s.*collectives=True"):
        ul.simulate(graphs["ddp8"], hardware=unmeasured)


def _one_offload(graph) -> tuple[Plan, int]:
    """A plan offloading the largest saved tensor from its last forward use to just before backward reads it."""
    saved = max((t for t in graph.tensors if t.saved and t.producer is not None and t.first_backward_use),
                key=lambda t: t.nbytes)
    plan = Plan("one offload", graph.fingerprint,
                offloads=(Offload(saved.id, saved.last_forward_use, saved.first_backward_use - 1),))
    return plan, saved.nbytes


def _offload_seconds(graph, hardware) -> float:
    timeline = ul.simulate(graph, _one_offload(graph)[0], hardware=hardware).timeline
    return float((timeline.end_s - timeline.start_s)[timeline.kind == "offload"].iloc[0])


def test_offload_copies_share_the_hosts_memory_among_the_ranks_of_a_node(graphs):
    slow_host = _links(host_memory_bytes_per_s=80e9)  # 10 GB/s a rank, below the 55 GB/s link
    link = H100.d2h_pinned_bytes_per_s
    nbytes = _one_offload(graphs["ddp8"])[1]
    assert _offload_seconds(graphs["ddp8"], slow_host) == pytest.approx(H100.d2h_pinned_latency_s + nbytes / 10e9)
    assert _offload_seconds(graphs["ddp8"], _links(host_memory_bytes_per_s=None)) == pytest.approx(
        H100.d2h_pinned_latency_s + nbytes / link)
    nbytes = _one_offload(graphs["plain"])[1]  # a single rank has the host to itself
    assert _offload_seconds(graphs["plain"], slow_host) == pytest.approx(H100.d2h_pinned_latency_s + nbytes / link)


def test_the_group_and_its_spacing_are_read_from_the_process_group_or_its_registered_name():
    """HSDP-like subgroups: c10d ops carry the group, functional collectives its name."""
    seen = []

    class Sizes(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.namespace in ("c10d", "_c10d_functional"):
                seen.append((func.__name__, group_layout(func, args, kwargs or {})))
            return func(*args, **(kwargs or {}))

    with fake_process_group(8):
        shard, replicate = dist.new_group([0, 1, 2, 3]), dist.new_group([0, 4])
        with Sizes():
            dist.all_reduce(torch.ones(4))
            dist.all_reduce(torch.ones(4), group=shard)
            functional.wait_tensor(functional.all_reduce(torch.ones(4), "sum", replicate))
    assert seen[:3] == [("allreduce_.default", (8, 1)), ("allreduce_.default", (4, 1)), ("all_reduce.default", (2, 4))]
    assert {layout for _, layout in seen[3:]} == {(1, 1)}  # wait_tensor and the like take no group


@pytest.fixture(scope="module", params=["resnet20 DDP", "gpt2 FSDP2"])
def larger(request):
    if request.param == "resnet20 DDP":
        return ul.trace(zoo.get("resnet20", batch=4), parallel=ul.DDP(8, bucket_cap_mb=0.25))
    return ul.trace(zoo.get("hf:gpt2", batch=2, small=True, seq_len=32), parallel=ul.FSDP(8))


def test_bounds_of_the_step_hold_on_a_resnet_and_a_transformer(larger):
    assert len(_collectives(larger)) > 2
    rated = ul.simulate(larger, hardware=H100)
    rows = rated.timeline[rated.timeline.stream == "comm"].sort_values("start_s")
    assert (rows.start_s.to_numpy()[1:] >= rows.end_s.to_numpy()[:-1]).all()
    assert rated.step_time_s >= max(rated.compute_time_s, rated.communication_time_s)
    free = ul.simulate(larger, hardware=_links(intra_node_bytes_per_s=1e18, intra_node_latency_s=0.0))
    assert free.step_time_s == pytest.approx(free.compute_time_s, rel=1e-6)
    slow = ul.simulate(larger, hardware=_links(intra_node_bytes_per_s=1e6, intra_node_latency_s=0.0))
    assert slow.communication_time_s <= slow.step_time_s < 1.01 * slow.communication_time_s
    assert free.step_time_s <= rated.step_time_s <= slow.step_time_s
