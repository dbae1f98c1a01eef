"""Graph + Plan + costs -> Simulation: one training step on three streams (four with collectives), under a budget.

NOTE [simulated streams]
  1. Compute runs the graph's ops in order. Before op i it waits, if its allocations would
     exceed the budget (document 000: M_used + M_alloc <= M), for offload copies in flight
     to complete and free memory; waits for copies the plan synchronizes on (vDNN); runs
     the plan's recomputations for op i; and waits for the prefetches op i reads. Those
     waits are stalls. A recomputation followed op by op holds the tensors it restores from
     the op before (the runtime replays as that op ends, before autograd's node unpacks
     them); followed by hooks, from its own op (it replays at the node's first unpack, once
     the op before is done: NOTE [hook points] 6). Its scratch outputs are not counted. A
     tensor it reads that forward would let go before it runs stays on the device until the
     last recomputation reading it has run: the runtime holds it (a recording, or a module
     call's arguments: NOTE [hook points] 7), and lets go of it before that recomputation's
     op runs, so it counts at that op in the recomputations' scratch (8) alone.
  2. Device-to-host copies run in order on their own stream; an offloaded tensor's copy
     starts when both the stream and its ``after_op`` are done, and its device memory is
     freed when the copy completes, not before. An offload with a release point
     (NOTE [offload runtime] 3) is freed just before that op instead, which waits for the
     copy (a sync stall); a prefetch at or before that op is cancelled. The simulation
     reports where each offload was freed (``released_before``): ``ul.plan`` writes those
     points into the plan, so the runtime lets go of memory where the simulation did.
  3. Host-to-device copies run in order on a third stream; a prefetch is issued when
     compute reaches ``prefetch_at``, allocates its device memory then, and starts once
     the stream is free. If the tensor's offload copy has not completed by then, its
     device memory was never released: the prefetch is cancelled and the tensor stays.
  4. A tensor is counted at op i if its device memory is held at any moment of op i, so
     with no actions the curve is the analyzer's, exactly.
  5. A graph of one rank of several also has collectives: they run on a communication stream, FSDP2's
     all-gather copy-ins on a copy-in stream, and compute waits for them where it reads what they wrote
     (NOTE [collectives] in _communication.py). A graph without collectives never builds that state.
  6. The forward and backward ops the runtime sees through a dispatch mode (``Plan.dispatched_ops``:
     every one when it follows the step op by op, those of its recording windows otherwise, NOTE
     [hook points] 6) pay the mode's host time (``CostModel.dispatch_mode_op_s``, measured by
     ``ul.profile`` or ``Hardware.measure``). On a CPU the host runs the ops, so each takes that
     much longer (replays run without the mode: NOTE [offload runtime] 8). On a GPU the host
     issues ops ahead of the device: its clock advances by that time per such op, and compute
     waits for an op not issued yet (``stall_host``). The runtime's own host work is priced the
     same way, from figures its host probes measured (the profiled step's own where its step
     probes found them, the machine's otherwise: NOTE [host probes] 4): each module and
     saved-tensor hook call it handles (``Plan.hook_calls``: the calls of the modules it hooks,
     NOTE [hook points] 8, the packs and unpacks of its windows; every pack and unpack when it
     follows the step op by op) at the call's boundary, each offload's actions at the op its copy starts
     before, the runtime's own work once per step (``runtime_step_s``: setting up and tearing down, where
     the step's probe measured it) at the first op, and each op a recomputation records and re-runs, each
     recomputation recorded and, with the first, the step's recording once (``replay_op_s``,
     ``replay_recompute_s``, ``recording_step_s``) at the recomputation's op (recording happens in
     forward, but the host work is the same); a recomputation that re-runs a module call (NOTE [hook
     points] 7) pays its ops' own host work, as eager does, a hook call for each pack inside it (the
     runtime's global module hooks are off while it runs, so its module calls cost what eager's do) and
     the re-run's own work (``rerun_call_s``: its state kept in forward, its context in backward).
     That clock counts the runtime's work alone, not the host's own work per op, unless that was
     measured (9): a lower bound.
  7. On a CPU the device is the host: a copy to or from the host pool is a memcpy the runtime
     makes while compute waits, so compute's clock runs through it (a sync stall for a copy to
     the host, a prefetch stall for one back). Where the profiled step's probe measured an
     offload's actions, its copies' calls are in that figure: a copy then costs its bytes alone
     (``CostModel.transfer_time_s``), at the rate the probe measured the runtime's copies at in the
     step where it did (``Profile.copy_bytes_per_s``).
  8. An op's scratch (``Profile.scratch_bytes``: what the caching allocator held while the op ran
     beyond what it held before and after it, cuDNN's convolution workspaces above all) is held
     only while the op runs: it counts at that op on top of what is live there, in the memory the
     op waits for and in the peak, and a recomputation's ops' largest counts at the op it runs
     before. Only a profile taken on CUDA measures it: a plan simulated without one does not see it.
     What the recomputations before an op make beyond the tensors they restore (intermediates: a
     replay lets each go after its last reader among the replayed ops, or once made where none
     reads it; a module's re-run where forward let it go) counts there the same way, on every
     device (``replay_peak_bytes``).
  9. The host's own pace. Where a profile taken on CUDA measured how long the host takes to issue each
     op (``Profile.host_time_s``: its dispatch and kernel launches), each op takes that on the host clock
     of 6 as well, the runtime's work on top, and the device starts an op no earlier than the host has
     issued it; an op whose value the host reads (``.item()``) brings the host clock to the op's end. A
     step whose host barely keeps up with the device (many small ops: GPT-2 on an H200) has little slack
     for the runtime's host work and pays most of it, where a step of long kernels (ResNet-50 at batch
     256) hides it. The Python between ops is not in it: still a lower bound, a closer one.
"""

from __future__ import annotations

import heapq
from collections import Counter
from collections.abc import Callable
from dataclasses import replace

import numpy as np

from udnn_lab.cost.model import HOST_READ, CostModel, RateCurve
from udnn_lab.cost.profiling import Profile
from udnn_lab.graph.cached import per_graph
from udnn_lab.graph.hook_points import window_ops
from udnn_lab.graph.liveness import op_table
from udnn_lab.graph.plan_ir import Offload, Plan, Recompute
from udnn_lab.graph.reruns import NOT_RERUN, rerun_call, running_statistic
from udnn_lab.graph.step_graph import Graph
from udnn_lab.hardware import CHOICES, Hardware, machine_hardware
from udnn_lab.simulation._communication import Communication, has_collectives, host_copies, host_op_time_s, host_ops
from udnn_lab.simulation._result import Simulation
from udnn_lab.simulation._tables import StepRecord, compute_time_s, counted_peak_bytes
from udnn_lab.units import Bytes

_KEPT_SIMULATIONS = 48  # per cost model: enough for one plan() or one budget of a sweep


def simulate(graph: Graph, plan: Plan | None = None, hardware: Hardware | str | None = None,
             profile: Profile | None = None, rates: RateCurve | bool | None = None,
             ranks_per_node: int | None = None) -> Simulation:
    """Simulate one step of ``graph`` under ``plan`` (default: keep everything) on ``hardware``.

    Op times come from ``profile`` when given (it must be of this graph's step), else from
    a roofline with ``rates``: by default the curve kept for the hardware (if one was
    fitted); ``rates=False`` uses the hardware profile's figures alone. A graph of one rank of
    several times its collectives on the profile's links (NOTE [collectives]), ``ranks_per_node``
    ranks to a node (default: the profile's ``gpus_per_node``).
    """
    plan = plan if plan is not None else Plan.keep_all(graph)
    plan.validate(graph)
    return simulate_with(graph, plan, cost_model(graph, hardware, profile, rates, ranks_per_node))


def cost_model(graph: Graph, hardware: Hardware | str | None = None, profile: Profile | None = None,
               rates: RateCurve | bool | None = None, ranks_per_node: int | None = None) -> CostModel:
    """The CostModel ``simulate`` would use for these arguments."""
    hw = resolve_hardware(hardware, graph.device)
    if rates is None and profile is None:
        rates = RateCurve.for_hardware(hw)
    return CostModel(hw, profile, rates if isinstance(rates, RateCurve) else None, ranks_per_node)


def simulate_with(graph: Graph, plan: Plan, cost: CostModel) -> Simulation:
    """Simulate with a ready CostModel (planners call this in their loops; the plan is not re-validated).

    The result is kept in the cost model's memo: planners ask about the same plan again, often under another
    policy's name (a policy that chose another's plan), which the simulation does not depend on.
    """
    key = ("simulation", id(graph), replace(plan, policy="", notes=(), chosen_policy=""))
    if key not in cost.memo:
        kept = [k for k in cost.memo if k[0] == "simulation"]
        for old in kept[:max(0, len(kept) - _KEPT_SIMULATIONS + 1)]:
            del cost.memo[old]
        cost.memo[key] = _Run(graph, plan, cost).simulate()
    kept_run = cost.memo[key]
    return kept_run if kept_run.policy == plan.policy else replace(kept_run, policy=plan.policy)


def resolve_hardware(hardware: Hardware | str | None, device: str) -> Hardware:
    """A Hardware profile as given, by name or path, or the one for this machine's ``device``.

    None and the choices "auto", "measure" and "shipped" follow NOTE [the profile for this machine]
    (hardware/this_machine.py): one rule for Python, the CLI, MemoryLab and the report.
    """
    if isinstance(hardware, Hardware):
        return hardware
    if hardware is None or isinstance(hardware, str) and hardware.strip() in CHOICES:
        return machine_hardware(device, hardware)
    if isinstance(hardware, str):
        return Hardware.load(hardware)
    raise TypeError(f"hardware must be a Hardware, a profile name, one of {list(CHOICES)} or None, "
                    f"got {type(hardware).__name__}")


class _Run:
    """One simulation's mutable state (NOTE [simulated streams]).

    The loop keeps only running totals (in the budget's unit: 512-byte blocks on CUDA) and
    notes when an action takes a tensor off the device or brings it back; the curves are
    the analyzer's with those changes folded in afterwards.
    """

    def __init__(self, graph: Graph, plan: Plan, cost: CostModel) -> None:
        self.graph, self.plan, self.cost = graph, plan, cost
        self.static = op_table(graph)
        self.cuda = graph.device == "cuda"
        self.times = cost.op_times_s(graph).tolist()
        self.budget = plan.budget_bytes
        table = self.static
        self.own = (table.alloc_block if self.cuda else table.alloc.sum(axis=1)).tolist()
        self.gone = (table.release_block if self.cuda else table.release.sum(axis=1)).tolist()
        self.counted = table.baseline_block - table.gone_at_start_block if self.cuda \
            else int((table.baseline - table.gone_at_start).sum())
        self.op_index = 0
        self.changes: list[tuple[int, int, int]] = []  # (first op it holds for, +1 or -1, tensor)
        self.pending: list[tuple[float, int]] = []  # (copy end, tensor): device memory freed then
        self.cancelled: set[int] = set()  # offloads whose prefetch came before their copy completed
        self.timeline: list[tuple] = []
        self.d2h_free = self.h2d_free = 0.0
        self.d2h_bytes = self.h2d_bytes = 0
        self.h2d_end: dict[int, float] = {}
        self.d2h_end: dict[int, float] = {}
        self.stall = 0.0
        self.violations = 0
        self.released: dict[int, int] = {}  # offloaded tensor -> the op its device memory was freed before
        self.not_before: dict[int, int] = {}  # offloaded tensor -> the first op before which forward lets it go
        self.held: set[int] = set()  # copies done, tensors forward still holds
        self.comm = Communication(graph, cost, self.times) if has_collectives(graph) else None
        windows = plan.windows_on_hooks(graph) if plan.offloads or plan.recomputes else ()
        # NOTE [simulated streams] 1: a replay followed op by op holds what it restores from the op before
        self.restored_early = 1 if plan.recomputes and windows is None else 0
        reruns = plan.reruns_in(graph) if windows is not None else ()
        self.reruns = {plan.recomputes[i] for i, enter in enumerate(reruns) if enter != NOT_RERUN}
        self.host_work = _runtime_host_work(graph, plan, cost, windows)  # NOTE [simulated streams] 6
        # NOTE [simulated streams] 9: each op's host seconds (zeros off CUDA, where the host is the device)
        self.host_pace: list[float] = cost.host_op_times_s(graph).tolist() if self.cuda else [0.0] * len(graph.ops)
        self.scratch = _op_scratch(graph, cost)  # NOTE [simulated streams] 8
        self.replay_scratch: dict[int, int] = {}  # the op a recomputation runs before -> its ops' largest scratch
        self.host_clock = 0.0
        self._index_host_copies()
        self._index_actions()

    def _index_host_copies(self) -> None:
        """An offloading rank's copies across, what else runs on the copy-in stream, and its host ops (NOTE
        [collectives] 8)."""
        graph, memo = self.graph, self.cost.memo
        key = ("host_copies", id(graph), graph.fingerprint)
        if key not in memo:
            copies = host_copies(graph)
            made = {graph.ops[i].outputs[0] for i, way in copies.items() if way == "h2d"}
            casts = {op.index for op in graph.ops if op.index not in copies and op.inputs and op.allocated
                     and all(t in made for t in op.inputs)}  # mixed precision's cast of a shard's copy
            memo[key] = (copies, casts, host_ops(graph) if copies else [])
        self.copies, casts, on_host = memo[key]
        self.copy_in_casts = casts if self.comm is not None else set()
        self.copied: dict[int, float] = {}  # a copy's (or its cast's) output -> when it is done
        self.gradients_home = 0.0  # when the last gradient copied to the host is there
        ranks_on_node = self.comm.ranks_on_node if self.comm is not None else 1
        for i in on_host:
            self.times[i] = host_op_time_s(self.graph.ops[i], self.cost.hardware, ranks_on_node)

    def _index_actions(self) -> None:
        on_device = self.static.on_device
        self.offload_after: dict[int, list[Offload]] = {}
        self.prefetch_at: dict[int, list[Offload]] = {}
        self.sync_before: dict[int, list[int]] = {}
        self.release_at: dict[int, list[int]] = {}  # offloads with a release point
        self.release_op: dict[int, int] = {}
        self.recompute_at: dict[int, list[Recompute]] = {}
        self.drop_after: dict[int, list[int]] = {}
        moved = set()
        for offload in self.plan.offloads:
            if on_device[offload.tensor]:
                moved.add(offload.tensor)
                self.offload_after.setdefault(offload.after_op, []).append(offload)
                self.prefetch_at.setdefault(offload.prefetch_at, []).append(offload)
                if offload.wait_before is not None:
                    self.sync_before.setdefault(offload.wait_before, []).append(offload.tensor)
                release = self._release_point(offload)
                if release is not None:
                    self.release_at.setdefault(release, []).append(offload.tensor)
                    self.release_op[offload.tensor] = release
        self.hold_after: dict[int, list[int]] = {}  # NOTE [simulated streams] 1: sources held past forward
        self.unhold_after: dict[int, list[int]] = {}
        self.unheld_at: dict[int, list[int]] = {}  # op -> sources the runtime lets go once its recomputations ran
        for tensor, (freed, until) in held_sources(self.graph, self.plan.recomputes).items():
            self.hold_after.setdefault(freed, []).append(tensor)
            self.unhold_after.setdefault(until - 1, []).append(tensor)  # not counted at ``until``: its scratch holds it
            self.unheld_at.setdefault(until, []).append(tensor)
        for recompute in self.plan.recomputes:
            self.recompute_at.setdefault(recompute.at_op, []).append(recompute)
            for tensor in recompute.tensors:
                if on_device[tensor]:
                    last = self.graph.tensors[tensor].last_forward_use
                    assert last is not None  # a recomputed tensor's producer is a forward op (Plan.validate)
                    held = self.graph.tensors[tensor].forward_release  # NOTE [forward holders]
                    self.drop_after.setdefault(max(last, held if held is not None else last), []).append(tensor)
        self.action_ops = set(self.offload_after) | set(self.prefetch_at) | set(self.sync_before) \
            | set(self.release_at) | set(self.recompute_at)
        # at the other ops the plan only has an op that reads a moved tensor wait for its copy in, and lets go, or
        # holds, what forward lets go
        self.readers = {i for t in moved for i in self.graph.tensors[t].consumers}
        self.letting_go = set(self.drop_after) | set(self.hold_after) | set(self.unhold_after)

    def _release_point(self, offload: Offload) -> int | None:
        """The plan's release point, never before forward lets the tensor go (NOTE [forward holders])."""
        held = self.graph.tensors[offload.tensor].forward_release
        if held is not None:
            self.not_before[offload.tensor] = held + 1
        if offload.release_before is not None and held is not None:
            return max(offload.release_before, held + 1)
        return offload.release_before

    # -- memory -----------------------------------------------------------------------------
    def _size(self, tensor: int) -> int:
        return self.static.block[tensor] if self.cuda else self.static.exact[tensor]

    def _change(self, tensor: int, sign: int, from_op: int) -> None:
        self.counted += sign * self._size(tensor)
        self.changes.append((from_op, sign, tensor))

    def _free_completed(self, until: float) -> None:
        self._release_held()
        while self.pending and self.pending[0][0] <= until:
            tensor = heapq.heappop(self.pending)[1]
            if tensor not in self.cancelled:
                self._release(tensor)

    def _release_held(self) -> None:
        """Copies done whose tensor forward still held: freed once forward lets go (NOTE [forward holders])."""
        for tensor in [t for t in self.held if self.not_before[t] <= self.op_index]:
            self.held.discard(tensor)
            if tensor not in self.cancelled:
                self._change(tensor, -1, self.op_index)
                self.released[tensor] = self.op_index

    def _memory_for(self, i: int, clock: float) -> float:
        """When op ``i``, at which the plan does nothing, can start: once what it allocates fits."""
        need = self.own[i] + self.scratch[i]
        if self.pending or self.held:
            start = self._wait_for_memory(clock, need)
            self._stall(clock, start, i, "stall_memory")
            return start
        if self.budget is not None and self.counted + need > self.budget:  # nothing in flight to wait for
            self.violations += 1
        return clock

    def _wait_for_memory(self, start: float, need: int) -> float:
        """Start time once ``need`` more bytes fit the budget, freeing completed copies."""
        self._free_completed(start)
        while self.budget is not None and self.counted + need > self.budget and self.pending:
            done, tensor = heapq.heappop(self.pending)
            if tensor in self.cancelled:
                continue
            if self.not_before.get(tensor, 0) > self.op_index:
                self.held.add(tensor)  # its copy is done, but forward still holds it: waiting frees nothing now
                continue
            start = max(start, done)
            self._release(tensor)
        if self.budget is not None and self.counted + need > self.budget:
            self.violations += 1
        return start

    def _release(self, tensor: int) -> None:
        if self.not_before.get(tensor, 0) > self.op_index:
            self.held.add(tensor)
            return
        self._change(tensor, -1, self.op_index)
        self.released[tensor] = self.op_index

    def _release_points(self, i: int, clock: float) -> float:
        """Free the offloads released before op i, once their copies complete; the wait is a sync stall."""
        start = clock
        for tensor in self.release_at.get(i, []):
            if tensor in self.d2h_end and tensor not in self.cancelled:
                start = max(start, self.d2h_end[tensor])
                self._release(tensor)
        self._stall(clock, start, i, "stall_sync")
        return start

    # -- the step -------------------------------------------------------------------------
    def simulate(self) -> Simulation:
        clock, spans = 0.0, []
        for op in self.graph.ops:
            self.op_index = op.index
            start, clock = self._step(op, clock)
            spans.append((start, clock))
        return self._result(spans, clock)

    def _step(self, op, clock: float) -> tuple[float, float]:
        i = op.index
        if i in self.copies or i in self.copy_in_casts:  # NOTE [collectives] 8
            self._host_copy(op, clock)
            return clock, clock
        if i not in self.action_ops:
            return self._plain_step(op, clock)
        prefetches = self.prefetch_at.get(i, [])
        for offload in prefetches:  # at or before its release point the tensor never left: nothing to fetch
            if self.release_op.get(offload.tensor, -1) >= i:
                self.cancelled.add(offload.tensor)
        clock = self._release_points(i, clock)
        recomputes = self.recompute_at.get(i, [])
        need = self.own[i] + self._scratch_at(i, recomputes) \
            + sum(self._size(t) for r in recomputes for t in self._restored(r)) \
            + sum(self._size(o.tensor) for o in prefetches
                  if o.tensor not in self.cancelled and self.d2h_end.get(o.tensor, 0.0) <= clock)
        start = self._wait_for_memory(clock, need)
        self._stall(clock, start, i, "stall_memory")
        synced = max([start] + [self.d2h_end[t] for t in self.sync_before.get(i, []) if t in self.d2h_end])
        self._stall(start, synced, i, "stall_sync")
        start = synced
        for offload in prefetches:
            self._prefetch(offload, start, i)
            if not self.cuda:  # NOTE [simulated streams] 7: the host copies while compute waits
                copied = max(start, self.h2d_end.get(offload.tensor, start))
                self._stall(start, copied, i, "stall_prefetch")
                start = copied
        for recompute in recomputes:
            start = self._recompute(recompute, start, i)
        ready = self._copied_back(op, start)
        end = self._run_op(op, ready)
        self._forward_done_with(i)
        for offload in self.offload_after.get(i, []):
            self._offload(offload, end, i)
            if not self.cuda:  # NOTE [simulated streams] 7
                copied = max(end, self.d2h_end.get(offload.tensor, end))
                self._stall(end, copied, i, "stall_sync")
                end = copied
        return ready, end

    def _plain_step(self, op, clock: float) -> tuple[float, float]:
        """An op at which the plan copies and recomputes nothing: it may read a tensor copied back, and forward
        may let go of a recomputed tensor or a recomputation's source after it."""
        i = op.index
        if self.comm is not None and i in self.comm.off_compute and i not in self.readers \
                and i not in self.letting_go:  # NOTE [collectives] 7
            return clock, self._run_op(op, clock)
        start = self._memory_for(i, clock)
        if i in self.readers:
            start = self._copied_back(op, start)
        end = self._run_op(op, start)
        if i in self.letting_go:
            self._forward_done_with(i)
        return start, end

    def _copied_back(self, op, start: float) -> float:
        """When ``op``, ready at ``start``, has the tensors it reads back on the device; the wait is a stall."""
        ready = max([start] + [self.h2d_end[t] for t in op.inputs if t in self.h2d_end])
        self._stall(start, ready, op.index, "stall_prefetch")
        return ready

    def _forward_done_with(self, i: int) -> None:
        """After op ``i``: the recomputed tensors forward lets go, and the sources the runtime holds for a
        recomputation from when forward lets them go until it has run (NOTE [simulated streams] 1)."""
        for tensor in self.drop_after.get(i, []) + self.unhold_after.get(i, []):
            self._change(tensor, -1, i + 1)
        for tensor in self.hold_after.get(i, []):
            self._change(tensor, +1, i + 1)

    def _host_copy(self, op, clock: float) -> None:
        """A shard's copy to the device (or its cast, on the copy-in stream), or a gradient's to the host (NOTE
        [collectives] 8); compute goes on."""
        i = op.index
        made = self.graph.tensors[op.outputs[0]]
        way = self.copies.get(i)
        if way == "d2h":
            written = [self.comm.written.get(t, 0.0) for t in op.inputs] if self.comm is not None else []
            start = max([self.d2h_free, clock, *written])
            end = self.d2h_free = start + self._transfer_time_s(made.nbytes, "d2h", True)
            self.d2h_bytes += made.nbytes
            self.gradients_home = end
            row = ("d2h", "gradient_to_host", start, end, i, op.name, op.module, made.name, made.nbytes)
        else:
            issued = self.comm.copy_in_ready(op) if self.comm is not None else clock
            start = max(issued, self._fed(op))
            if way == "h2d":
                start = max(start, self.h2d_free)
                end = self.h2d_free = start + self._transfer_time_s(made.nbytes, "h2d", True)
                self.h2d_bytes += made.nbytes
                row = ("h2d", "shard_to_device", start, end, i, op.name, op.module, made.name, made.nbytes)
            else:
                end = start + self.times[i]
                row = ("comm_copy_in", "op", start, end, i, op.name, op.module, "", 0)
            if self.comm is not None:
                self.comm.copy_in_free = end
        for tensor in op.allocated:
            self.copied[tensor] = end
        self.counted += self.own[i] - self.gone[i]
        self.timeline.append(row)

    def _fed(self, op) -> float:
        """When the copies across that ``op`` reads are done (0 for none)."""
        return max([self.copied[t] for t in op.inputs if t in self.copied], default=0.0)

    def _run_op(self, op, start: float) -> float:
        i = op.index
        if self.comm is not None and i in self.comm.off_compute:  # on its own stream: compute goes on
            if self.cuda:
                self.host_clock += self.host_pace[i]  # NOTE [simulated streams] 9: the host issues it all the same
            self.timeline.append(self.comm.run_off_compute(op, start, self._fed(op)))
            self.counted += self.own[i] - self.gone[i]
            return start
        if self.copied:
            fed = max(start, self._fed(op), self.gradients_home if op.phase == "optimizer" else 0.0)
            self._stall(start, fed, i, "stall_sync" if op.phase == "optimizer" else "stall_prefetch")
            start = fed
        if self.comm is not None:
            ready = self.comm.ready_for(op, start)
            if ready > start:
                self.timeline.append(("compute", "stall_communication", start, ready, i, "communication", op.module,
                                      "", 0))
            start = ready
        end = start + self.times[i]
        work = self.host_work.get(i)
        if self.cuda:  # NOTE [simulated streams] 6, 9
            if work or self.host_pace[i]:
                self.host_clock += (work or 0.0) + self.host_pace[i]
                self._stall(start, self.host_clock, i, "stall_host")
                start = max(start, self.host_clock)
                end = start + self.times[i]
            if op.name == HOST_READ:  # the host waits for the value: it goes on from the op's end
                self.host_clock = end
        elif work:
            end += work
        self.timeline.append(("compute", "op", start, end, i, op.name, op.module, "", 0))
        self.counted += self.own[i] - self.gone[i]
        if self.comm is not None:
            self.comm.ran(op, end)
        return end

    def _restored(self, recompute: Recompute) -> list[int]:
        return [t for t in recompute.tensors if self.static.on_device[t]]

    def _stall(self, start: float, end: float, op: int, kind: str) -> None:
        if end > start:
            self.stall += end - start
            self.timeline.append(("compute", kind, start, end, op, kind.removeprefix("stall_"),
                                  self.graph.ops[op].module, "", 0))

    def _offload(self, offload: Offload, after: float, op: int) -> None:
        t = self.graph.tensors[offload.tensor]
        start = max(self.d2h_free, after)
        end = start + self._transfer_time_s(t.nbytes, "d2h", offload.pinned)
        self.d2h_free = self.d2h_end[t.id] = end
        self.d2h_bytes += t.nbytes
        if t.id not in self.release_op:  # else freed at its release point
            heapq.heappush(self.pending, (end, t.id))
        self.timeline.append(("d2h", "offload", start, end, op, t.name, t.module, t.name, t.nbytes))

    def _prefetch(self, offload: Offload, issued: float, op: int) -> None:
        t = self.graph.tensors[offload.tensor]
        if t.id in self.cancelled or (t.id not in self.release_op and self.d2h_end.get(t.id, 0.0) > issued):
            # its copy is still in flight (or its release point is to come): it never left the device
            self.cancelled.add(t.id)
            self.h2d_end[t.id] = issued
            self.timeline.append(("h2d", "prefetch_cancelled", issued, issued, op, t.name, t.module, t.name, 0))
            return
        self._change(t.id, +1, op)
        start = max(self.h2d_free, issued)
        end = start + self._transfer_time_s(t.nbytes, "h2d", offload.pinned)
        self.h2d_free = self.h2d_end[t.id] = end
        self.h2d_bytes += t.nbytes
        self.timeline.append(("h2d", "prefetch", start, end, op, t.name, t.module, t.name, t.nbytes))

    def _transfer_time_s(self, nbytes: int, direction: str, pinned: bool) -> float:
        if self.comm is None:
            return self.cost.transfer_time_s(nbytes, direction, pinned)
        return self.comm.transfer_time_s(self.cost, nbytes, direction, pinned)  # NOTE [collectives] 6

    def _recompute(self, recompute: Recompute, start: float, op: int) -> float:
        restored = self._restored(recompute)
        for tensor in restored:  # NOTE [simulated streams] 1
            self._change(tensor, +1, max(op - self.restored_early, 0))
        end = start + float(sum(self.times[j] for j in recompute.ops))
        names = ", ".join(self.graph.tensors[t].name for t in recompute.tensors)
        nbytes = sum(self.graph.tensors[t].nbytes for t in restored)
        module = self.graph.ops[recompute.ops[-1]].module
        self.timeline.append(("compute", "recompute", start, end, op, names, module, names, nbytes))
        return end

    def _scratch_at(self, i: int, recomputes: list[Recompute]) -> int:
        """Op ``i``'s scratch, or a recomputation's before it where that is larger: a replayed op's own, or what the
        replays make beyond what they restore and op ``i`` allocates (NOTE [simulated streams] 8)."""
        if not recomputes and i not in self.unheld_at:  # most action ops: copies only
            return self.scratch[i]
        scratch = max([self.scratch[i]] + [self.scratch[j] for r in recomputes for j in r.ops])
        scratch = max(scratch, self._replays_made(i, recomputes, sum(map(self._size, self.unheld_at.get(i, ())))))
        if scratch > self.scratch[i]:
            self.replay_scratch[i] = scratch
        return scratch

    def _replays_made(self, i: int, recomputes: list[Recompute], sources: int) -> int:
        """The most the replays before op ``i`` hold at once beyond the tensors they restore and op ``i``'s own
        allocations, which are counted at op ``i``: intermediates, each let go after its last reader among the
        replayed ops, or once made where none reads it, as the runtime's replay does (NOTE [offload runtime] 6), and
        the ``sources`` bytes the runtime held for them, let go once they ran (NOTE [simulated streams] 1)."""
        restored_before, most = 0, 0
        for recompute in recomputes:
            peak = counted_replay_peak_bytes(self.graph, recompute, recompute in self.reruns)
            most = max(most, restored_before + peak)
            restored_before += sum(self._size(t) for t in self._restored(recompute))
        return max(0, sources + most - restored_before - self.own[i])

    def _scratch_by_op(self) -> np.ndarray | None:
        """Each op's scratch, a recomputation's at the op it runs before (NOTE [simulated streams] 8)."""
        if not any(self.scratch) and not self.replay_scratch:
            return None
        scratch = np.asarray(self.scratch, dtype=np.int64)
        for op, largest in self.replay_scratch.items():
            scratch[op] = max(scratch[op], largest)
        return scratch

    def _result(self, spans: list[tuple[float, float]], clock: float) -> Simulation:
        graph, d2h, h2d = self.graph, self.d2h_bytes, self.h2d_bytes
        compute = compute_time_s(self.timeline)
        hw, comm = self.cost.hardware, self.comm
        rate = hw.bandwidth_bytes_per_s if comm is None else \
            (lambda direction, pinned: comm.shared(hw.bandwidth_bytes_per_s(direction, pinned)))
        bound = max(compute, d2h / rate("d2h", True) if d2h else 0.0, h2d / rate("h2d", True) if h2d else 0.0,
                    comm.busy_s if comm is not None else 0.0)
        step = max(clock, self.d2h_free, self.h2d_free, comm.end_s() if comm is not None else 0.0)
        changes = tuple(self.changes)
        scratch = self._scratch_by_op()
        return Simulation(
            model_name=graph.model_name, policy=self.plan.policy, device=graph.device,
            budget_bytes=self.budget, step_time_s=step, compute_time_s=compute,
            stall_time_s=self.stall, d2h_bytes=d2h, h2d_bytes=h2d, lower_bound_s=bound,
            peak_bytes=Bytes(counted_peak_bytes(graph, changes, scratch)), scratch_by_op=scratch,
            record=StepRecord(graph, tuple(self.timeline), tuple(spans), changes),
            released_before=dict(self.released), device_changes=changes,
            communication_time_s=comm.busy_s if comm is not None else 0.0,
            exposed_communication_s=comm.waited_s + max(0.0, comm.end_s() - clock) if comm is not None else 0.0,
            communication_bytes=comm.bytes if comm is not None else 0, hardware=self.cost.hardware.name,
        )


@per_graph
def counted_replay_peak_bytes(graph: Graph, recompute: Recompute, rerun: bool) -> int:
    """``replay_peak_bytes`` counted as the simulation counts (CUDA's blocks on a CUDA graph), cached: planners
    simulate the same recomputations again, and the exact planner's menu prices them too."""
    sizes = op_table(graph).block if graph.device == "cuda" else op_table(graph).exact
    return replay_peak_bytes(graph, recompute, lambda t: int(sizes[t]), rerun)


def replay_peak_bytes(graph: Graph, recompute: Recompute, size: Callable[[int], int], rerun: bool = False) -> int:
    """The most the replay of ``recompute`` holds at once of what it makes (``size``: a tensor's bytes as counted).
    A restored tensor stays. Any other goes, replayed op by op, after its last reader among the replayed ops (at once
    if none); re-running a module call (``rerun``, NOTE [hook points] 7), where forward let it go (NOTE [forward
    holders]), autograd keeping nothing, and at the call's end at the latest. The copies of the running statistics
    it writes are held while the op writing them runs, or through a re-run."""
    kept, last = set(recompute.tensors), recompute.ops[-1]
    made = {j: [t for t in graph.ops[j].allocated if graph.tensors[t].device == graph.device] for j in recompute.ops}
    copied = {j: sum(size(t) for t in set(graph.ops[j].inputs) if running_statistic(graph.tensors[t]))
              for j in recompute.ops}
    goes: dict[int, int] = {}  # tensor -> the replayed op after which it goes
    for j, tensors in made.items():
        for t in tensors:
            goes[t] = _rerun_release(graph.tensors[t], j, last) if rerun else j
    if not rerun:
        for j in recompute.ops:
            for t in graph.ops[j].inputs:
                if t in goes:
                    goes[t] = j
    gone_after: dict[int, list[int]] = {}
    for t, j in goes.items():
        if t not in kept:
            gone_after.setdefault(j, []).append(t)
    live = sum(copied.values()) if rerun else 0
    most = live
    for j in recompute.ops:
        live += sum(size(t) for t in made[j])
        most = max(most, live + (0 if rerun else copied[j]))
        live -= sum(size(t) for t in gone_after.get(j, ()))
    return most


def _rerun_release(tensor, made_at: int, last: int) -> int:
    """The op of a module's re-run after which it lets go of ``tensor`` (NOTE [forward holders])."""
    release = tensor.forward_release
    if release is None:
        release = last if tensor.held_past_forward else (tensor.last_forward_use or made_at)
    return min(max(release, made_at), last)


def held_sources(graph: Graph, recomputes: tuple[Recompute, ...]) -> dict[int, tuple[int, int]]:
    """Tensor -> (the op after which forward lets it go, the last op a recomputation reading it runs at) for the
    recomputations' sources that forward lets go first (NOTE [simulated streams] 1)."""
    held: dict[int, tuple[int, int]] = {}
    holdable = _holdable_inputs(graph)
    for recompute in recomputes:
        made: set[int] = set()
        at = recompute.at_op
        for index in recompute.ops:
            for source, freed in holdable[index]:
                if freed < at and source not in made:
                    before = held.get(source)
                    held[source] = (freed, at if before is None else max(before[1], at))
            made.update(graph.ops[index].outputs)
    return held


@per_graph  # every simulation of a plan with recomputations asks
def _holdable_inputs(graph: Graph) -> tuple[tuple[tuple[int, int], ...], ...]:
    """Per op, (input, the op after which forward lets it go) for its inputs on the device that are not parameters
    or buffers and that the step lets go."""
    on_device = op_table(graph).on_device
    found = []
    for op in graph.ops:
        inputs = (graph.tensors[t] for t in op.inputs)
        found.append(tuple((t.id, t.free_step) for t in inputs if on_device[t.id] and t.free_step is not None
                           and t.category not in ("parameter", "buffer")))
    return tuple(found)


def _runtime_host_work(graph: Graph, plan: Plan, cost: CostModel,
                       windows: tuple[tuple[int, int], ...] | None) -> dict[int, float]:
    """Op -> host seconds of the runtime's own work at it under ``plan`` (NOTE [simulated streams] 6)."""
    work: dict[int, float] = {}
    if not (plan.offloads or plan.recomputes):
        return work
    last = len(graph.ops) - 1

    def add(op: int, seconds: float) -> None:
        if seconds:
            work[min(op, last)] = work.get(min(op, last), 0.0) + seconds

    if cost.dispatch_mode_op_s and windows != ():
        for ops in window_ops(graph.hook_events, windows, len(graph.ops)):
            for i in ops:
                if graph.ops[i].phase != "optimizer":
                    add(i, cost.dispatch_mode_op_s)
    add(0, cost.runtime_step_s)  # setting the step up and tearing it down: at its first op
    if cost.hook_call_s:
        calls = plan.hook_calls(graph) if windows is not None else \
            Counter(e.boundary for e in graph.hook_events if e.kind in ("pack", "unpack"))  # op by op: every one
        for boundary, count in calls.items():
            add(boundary, count * cost.hook_call_s)
    for offload in plan.offloads:
        add(offload.after_op + 1, cost.offload_action_s)
    for at_op, seconds in _recompute_host_s(graph, plan, cost, windows is not None):
        add(at_op, seconds)
    return work


def _recompute_host_s(graph: Graph, plan: Plan, cost: CostModel, on_hooks: bool) -> list[tuple[int, float]]:
    """(op, host seconds) of each recomputation: each op it records and replays, the recomputation itself, and
    with the first the step's recording once; or, re-running a module call (NOTE [hook points] 7), the module's own
    Python, as eager's, a hook call for each pack inside and the re-run's own work."""
    reruns = plan.reruns_in(graph) if on_hooks else ()
    found = []
    once = cost.recording_step_s  # with the first recomputation recorded
    for index, recompute in enumerate(plan.recomputes):
        if reruns and reruns[index] != NOT_RERUN:
            call = rerun_call(graph.hook_events, reruns[index], recompute.tensors)
            found.append((recompute.at_op, len(call.packs) * cost.hook_call_s + cost.rerun_call_s))
        else:
            found.append((recompute.at_op, len(recompute.ops) * cost.replay_op_s + cost.replay_recompute_s + once))
            once = 0.0
    return found


def _op_scratch(graph: Graph, cost: CostModel) -> list[int]:
    """Each op's scratch bytes, 0 where not measured (NOTE [simulated streams] 8); the allocator's counts are in
    its blocks already, as the budget counts on CUDA."""
    measured = cost.profile.scratch_bytes if cost.profile is not None else None
    if measured is None or graph.device != "cuda" or len(measured) != len(graph.ops):
        return [0] * len(graph.ops)
    return [int(b) for b in measured]
