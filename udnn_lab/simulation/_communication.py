"""Collectives of one rank of N on a stream of their own, and what compute waits for (NOTE [collectives]).

NOTE [collectives]
  1. A collective (an op of the c10d or _c10d_functional namespace over more than one rank, OpInfo.ranks)
     runs on the communication stream, in the graph's order, one at a time. Its time is the ring
     algorithm's (NCCL's performance notes, nccl-tests doc/PERFORMANCE.md, "bus bandwidth"):
     all-gather, reduce-scatter and all-to-all move (p-1)/p of the full buffer over each rank's link,
     all-reduce 2(p-1)/p, broadcast and reduce the buffer once (a send or receive too, in one step); plus
     one latency per ring step (p-1 steps, 2(p-1) for all-reduce). The full buffer is the largest storage
     the op touches (the gathered output, the reduce-scatter input, the bucket). The ring's latency grows
     with p; NCCL switches to trees or LL protocols for small buffers at large p, which this does not.
  2. The link is the slowest the group crosses: the node's GPU-to-GPU fabric when the group fits in one
     node, each GPU's NIC otherwise. Ranks fill nodes in order, ranks_per_node to a node (the profile's
     gpus_per_node unless given), and a group is taken to start at a node's first rank: it fits when the
     global ranks it spans, (ranks - 1) x OpInfo.rank_stride + 1, fit in a node (FSDP's and DDP's world of
     8 on DGX, HSDP's shard group; HSDP's replicate group, ranks a node apart, crosses nodes). FSDP2 runs
     all-gathers and reduce-scatters on two streams (and HSDP's all-reduces on a third); they share the
     same links, so here they take turns. The ranks of a CPU run (gloo) are processes of one machine: every
     group is inside it, on the link a CPU profile measures between two gloo ranks.
  3. A collective starts when the stream is free and what it sends is ready: for FSDP2's all-gather, its
     copy-in (fsdp.all_gather_copy_in); for every other, what compute issued before it (DDP's bucket
     all-reduce, FSDP2's reduce-scatter: ``reduce_scatter_stream.wait_stream(current_stream)`` in
     _fsdp_collectives.foreach_reduce).
  4. FSDP2's all-gather copy-in runs on its own copy-in stream (``all_gather_copy_in_stream``, in forward and
     in backward prefetch: FSDPCommContext.get_all_gather_streams), ahead of compute: the CPU issues it as
     soon as it reaches the block, which is taken to be at once. How far ahead is bounded by events
     (_fsdp_param_group.py, wait_for_unshard): in forward, once block k's copy-out is issued the copy-in and
     all-gather streams wait for block k-1's copy-out to have run (the all-gather state keeps one result
     alive for the next copy-out to overlap with), so at most two blocks are gathered ahead; the root's
     post-forward waits for the last forward copy-out. In backward each copy-out makes them wait for itself
     (the result is freed at once), so the explicit prefetch gathers one block ahead.
  5. Compute waits for a collective only where an op that does work (not a view) reads or writes a storage
     the collective or a copy-in wrote: FSDP2's copy-out (fsdp.split_with_sizes_copy, on the compute
     stream, ``current_stream().wait_event(all_gather_event)``), DDP's copy of the reduced buckets into the
     gradients, the optimizer reading reduce-scattered gradients (FSDP2's finalize_backward waits for
     them). FSDP2's reduce-scatter copy-in (fsdp.chunk_cat) runs on compute and first waits for the
     previous reduce-scatter: one reduce-scatter input is kept in flight (reduce_scatter_max_input_buffers,
     post_backward). Those waits are the exposed communication, with what is left of the stream after
     compute ends.
  6. Offload under many ranks: the copies of every rank on a node go through the node's host memory, so a
     rank's copies get min(its host link, host memory bandwidth / ranks on the node), the ranks on the node
     being min(the widest group's span, ranks_per_node), when the graph is one rank of several and the profile
     has the host's figure. Not modelled: the PCIe switches two GPUs may share, NUMA, the host memory the
     collectives' own staging uses, and the links' contention between collectives and offload copies.
  7. Memory is counted by op as for any op (NOTE [simulated streams] 4): buffers live from the op the trace
     allocated them at, whatever stream runs it; an op moved off compute does not wait for the budget.
  8. A rank that offloads its parameters (FSDP2's CPUOffloadPolicy; NOTE [host storages] in analysis/_host.py)
     copies each shard to the device before its all-gather and each reduced gradient shard to the host: ops
     whose input is on one side and output on the other (``host_copies``). A shard's copy runs on the
     host-to-device stream and, being issued on FSDP2's copy-in stream, as a copy-in does (NOTE 4): the copy-in
     starts once it is done, and so does compute where it reads it. A gradient's copy runs on the
     device-to-host stream once the reduce-scatter (or the op after it) has written it; the optimizer step
     starts once every gradient is on the host (finalize_backward synchronizes on each copy). Both are timed
     as offload copies are (pinned: FSDP2 pins the host's shards), the node's host memory shared as in 6. Ops
     that touch host tensors only (the optimizer step) run on the host: bytes read and written over the node's
     host memory bandwidth shared by its ranks (``host_memory_bytes_per_s``), on the compute lane, since the
     step waits for them. That is a lower bound: it leaves out the CPU's arithmetic and how many cores the
     ranks' optimizer threads get, which can make a real host step slower.
"""

from __future__ import annotations

from dataclasses import dataclass

from udnn_lab.cost.model import CostModel
from udnn_lab.graph.cached import per_graph
from udnn_lab.graph.step_graph import Graph, OpInfo
from udnn_lab.hardware.profiles import Hardware

_COLLECTIVE_PREFIXES = ("c10d.", "_c10d_functional.")
ONE_MACHINE = 1 << 30  # ranks per node of a CPU run: all of them (NOTE 2)
_COPY_IN = "fsdp.all_gather_copy_in.default"
_COPY_OUT = "fsdp.split_with_sizes_copy.default"
_REDUCE_SCATTER_COPY_IN = "fsdp.chunk_cat.default"
# name fragment -> (collective kind, bytes over the link per byte of the full buffer at p ranks, ring steps)
_RINGS = (
    (("allreduce", "all_reduce"), "all_reduce", lambda p: 2 * (p - 1) / p, lambda p: 2 * (p - 1)),
    (("allgather", "all_gather"), "all_gather", lambda p: (p - 1) / p, lambda p: p - 1),
    (("reduce_scatter",), "reduce_scatter", lambda p: (p - 1) / p, lambda p: p - 1),
    (("alltoall", "all_to_all"), "all_to_all", lambda p: (p - 1) / p, lambda p: p - 1),
    (("send", "recv"), "point_to_point", lambda p: 1.0, lambda p: 1),
    (("broadcast", "reduce", "scatter", "gather"), "collective", lambda p: 1.0, lambda p: p - 1),
)


def is_collective(op: OpInfo) -> bool:
    return op.ranks > 1 and op.name.startswith(_COLLECTIVE_PREFIXES)


def span(op: OpInfo) -> int:
    """Global ranks from a collective's first rank to its last (NOTE [collectives] 2)."""
    return (op.ranks - 1) * op.rank_stride + 1


@per_graph  # every simulation asks
def has_collectives(graph: Graph) -> bool:
    return any(op.ranks > 1 for op in graph.ops)


def host_copies(graph: Graph) -> dict[int, str]:
    """Op index -> 'h2d' or 'd2h', for each op that copies a storage from one side to the other (NOTE 8): its one
    output, new, is on the other side of its one input (a storage FSDP2 refills at the op may come with it)."""
    found = {}
    for op in graph.ops:
        if len(op.inputs) != 1 or len(op.outputs) != 1 or op.outputs[0] not in op.allocated:
            continue
        source, made = graph.tensors[op.inputs[0]], graph.tensors[op.outputs[0]]
        if graph.on_host(source) and graph.on_device(made):
            found[op.index] = "h2d"
        elif graph.on_device(source) and graph.on_host(made):
            found[op.index] = "d2h"
    return found


def host_ops(graph: Graph) -> list[int]:
    """The ops that touch host tensors only: they run on the host (NOTE 8)."""
    return [op.index for op in graph.ops if (op.inputs or op.outputs)
            and all(graph.on_host(graph.tensors[t]) for t in (*op.inputs, *op.outputs))]


def host_op_time_s(op: OpInfo, hardware: Hardware, ranks_on_node: int) -> float:
    """An op run on the host: its bytes over the node's host memory, shared by the ranks on it (NOTE 8)."""
    if hardware.host_memory_bytes_per_s is None:
        raise ValueError(f"this graph's optimizer steps on the host (FSDP2 offloading its parameters), and hardware "
                         f"profile {hardware.name!r} has no host_memory_bytes_per_s to time it with: simulate it on "
                         f"a profile with one (e.g. 'h100-sxm', 'a100'), or add it, with its source, to a copy")
    return (op.bytes_read + op.bytes_written) / (hardware.host_memory_bytes_per_s / ranks_on_node)


def ring(name: str, ranks: int) -> tuple[str, float, int]:
    """(kind, bytes over each rank's link per byte of the buffer, latency steps) of a collective (NOTE 1)."""
    for fragments, kind, share, steps in _RINGS:
        if any(fragment in name for fragment in fragments):
            return kind, share(ranks), steps(ranks)
    return "collective", 0.0, ranks - 1  # a barrier: latency only


@dataclass(frozen=True)
class Links:
    """The figures collectives and shared host copies are timed with (NOTE [collectives] 2, 6)."""

    ranks_per_node: int
    intra_bytes_per_s: float
    intra_latency_s: float
    inter_bytes_per_s: float
    inter_latency_s: float
    host_memory_bytes_per_s: float | None

    @classmethod
    def of(cls, hardware: Hardware, ranks_per_node: int | None = None) -> Links:
        if hardware.device_type == "cpu":  # ranks of a CPU run share one machine, over its gloo link (NOTE 2)
            names: tuple[str, ...] = ("intra_node_bytes_per_s", "intra_node_latency_s")
            ranks_per_node = ranks_per_node or ONE_MACHINE
        else:
            names = ("gpus_per_node", "intra_node_bytes_per_s", "intra_node_latency_s", "inter_node_bytes_per_s",
                     "inter_node_latency_s")
        missing = [name for name in names
                   if getattr(hardware, name) is None and not (name == "gpus_per_node" and ranks_per_node)]
        if missing:
            raise ValueError(
                f"this graph is one rank of several and its collectives need multi-GPU figures, but hardware "
                f"profile {hardware.name!r} ({hardware.title}) has none for {missing}: simulate it on a profile "
                f"with them (e.g. 'h100-sxm', 'a100', 'mi300x'), or add them, with their sources, to a copy of "
                f"this profile" + (" (for this machine's CPU: ul.Hardware.measure('cpu', collectives=True))"
                                   if hardware.device_type == "cpu" else ""))
        per_node = ranks_per_node if ranks_per_node is not None else hardware.gpus_per_node
        if isinstance(per_node, bool) or not isinstance(per_node, int) or per_node < 1:
            raise ValueError(f"ranks_per_node is how many ranks share a node: a positive int, got {per_node!r}")
        return cls(per_node, hardware.intra_node_bytes_per_s or 0.0, hardware.intra_node_latency_s or 0.0,
                   hardware.inter_node_bytes_per_s or 0.0, hardware.inter_node_latency_s or 0.0,
                   hardware.host_memory_bytes_per_s)

    def time_s(self, op: OpInfo, nbytes: int) -> float:
        share, steps = ring(op.name, op.ranks)[1:]
        inside = span(op) <= self.ranks_per_node
        bandwidth = self.intra_bytes_per_s if inside else self.inter_bytes_per_s
        latency = self.intra_latency_s if inside else self.inter_latency_s
        if not bandwidth:  # a CPU profile's ranks share one machine: it has no figures across machines
            raise ValueError(f"a collective of {op.ranks} ranks ({op.name}) crosses nodes of {self.ranks_per_node} "
                             "ranks, and this hardware profile has no inter-node figures: give ranks_per_node of at "
                             f"least {span(op)} (ranks on one machine), or use a GPU profile with them")
        return steps * latency + share * nbytes / bandwidth


class Communication:
    """The communication and copy-in streams of one simulation, and the waits they impose on compute."""

    def __init__(self, graph: Graph, cost: CostModel, times: list[float]) -> None:
        self.graph, self.times = graph, times
        self.links = Links.of(cost.hardware, cost.ranks_per_node)
        self.collectives = {op.index for op in graph.ops if is_collective(op)}
        self.copy_ins = {op.index for op in graph.ops if op.name == _COPY_IN}
        self.off_compute = self.collectives | self.copy_ins
        ranks = max(span(graph.ops[i]) for i in self.collectives) if self.collectives else 1
        self.ranks_on_node = min(ranks, self.links.ranks_per_node)
        self.comm_free = self.copy_in_free = self.gate = 0.0
        self.forward_copy_out: float | None = None  # the copy-out the all-gather state still holds (NOTE 4)
        self.last_reduce_scatter = 0.0
        self.written: dict[int, float] = {}  # storage -> when the stream op that wrote it last ends
        self.ready: dict[int, float] = {}  # copy-in output -> its end
        self.busy_s = 0.0
        self.bytes = 0
        self.waited_s = 0.0

    def transfer_time_s(self, cost: CostModel, nbytes: int, direction: str, pinned: bool) -> float:
        """A host copy with the host's memory shared by the ranks on the node (NOTE [collectives] 6)."""
        if nbytes <= 0:
            return 0.0
        bandwidth = cost.hardware.bandwidth_bytes_per_s(direction, pinned)
        return cost.hardware.latency_s(direction, pinned) + nbytes / self.shared(bandwidth)

    def shared(self, bandwidth: float) -> float:
        host = self.links.host_memory_bytes_per_s
        return bandwidth if host is None else min(bandwidth, host / self.ranks_on_node)

    def copy_in_ready(self, op: OpInfo) -> float:
        """When the copy-in stream may start ``op`` (NOTE [collectives] 4, 8)."""
        if op.phase != "forward" and self.forward_copy_out is not None:  # the root's post-forward
            self.gate, self.forward_copy_out = max(self.gate, self.forward_copy_out), None
        return max(self.copy_in_free, self.gate)

    def run_off_compute(self, op: OpInfo, clock: float, fed_s: float = 0.0) -> tuple:
        """Schedule a collective or a copy-in on its stream, not before ``fed_s`` (its inputs' copies to the
        device); the timeline row it makes."""
        i = op.index
        if i in self.copy_ins:
            start = max(self.copy_in_ready(op), fed_s)
            end = self.copy_in_free = start + self.times[i]
            for tensor in op.outputs:
                self.written[tensor] = self.ready[tensor] = end
            return ("comm_copy_in", "op", start, end, i, op.name, op.module, "", 0)
        fed = [self.ready[t] for t in op.inputs if t in self.ready]
        issued = max(fed) if fed else clock
        nbytes = max((self.graph.tensors[t].nbytes for t in (*op.inputs, *op.outputs)), default=0)
        kind = ring(op.name, op.ranks)[0]
        start = max(self.comm_free, issued)
        end = self.comm_free = start + self.links.time_s(op, nbytes)
        self.busy_s += end - start
        self.bytes += nbytes
        for tensor in op.outputs:
            self.written[tensor] = end
        if kind == "reduce_scatter":
            self.last_reduce_scatter = end
        return ("comm", kind, start, end, i, op.name, op.module, "", nbytes)

    def ready_for(self, op: OpInfo, start: float) -> float:
        """When compute may run ``op``: after the stream ops that wrote what it touches (NOTE 5)."""
        if op.flops == 0 and op.bytes_read + op.bytes_written == 0:
            return start  # a view: metadata only
        ready = max([start] + [self.written[t] for t in (*op.inputs, *op.outputs) if t in self.written])
        if op.name == _REDUCE_SCATTER_COPY_IN:
            ready = max(ready, self.last_reduce_scatter)
        self.waited_s += ready - start
        return ready

    def ran(self, op: OpInfo, end: float) -> None:
        """A compute op ended: a copy-out moves the all-gather streams' gate (NOTE [collectives] 4)."""
        if op.name != _COPY_OUT:
            return
        if op.phase == "forward":
            if self.forward_copy_out is not None:
                self.gate = max(self.gate, self.forward_copy_out)
            self.forward_copy_out = end
        else:
            self.gate = max(self.gate, end)

    def end_s(self) -> float:
        return max(self.comm_free, self.copy_in_free)
