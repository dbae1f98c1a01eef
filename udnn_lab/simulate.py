"""Graph + Plan + costs -> Simulation: one training step on three streams, under a memory budget.

NOTE [simulated streams]
  1. Compute runs the graph's ops in order. Before op i it waits, if its allocations would
     exceed the budget (document 000: M_used + M_alloc <= M), for offload copies in flight
     to complete and free memory; waits for copies the plan synchronizes on (vDNN); runs
     the plan's recomputations for op i; and waits for the prefetches op i reads. Those
     waits are stalls. A recomputation holds the tensors it restores (its scratch outputs
     are not counted).
  2. Device-to-host copies run in order on their own stream; an offloaded tensor's copy
     starts when both the stream and its ``after_op`` are done, and its device memory is
     freed when the copy completes, not before.
  3. Host-to-device copies run in order on a third stream; a prefetch is issued when
     compute reaches ``prefetch_at``, allocates its device memory then, and starts once
     the stream is free. If the tensor's offload copy has not completed by then, its
     device memory was never released: the prefetch is cancelled and the tensor stays.
  4. A tensor is counted at op i if its device memory is held at any moment of op i, so
     with no actions the curve is the analyzer's, exactly.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
import numpy as np
import pandas as pd

from udnn_lab.categories import CATEGORIES
from udnn_lab.cost import CostModel, RateCurve
from udnn_lab.graph import Graph
from udnn_lab.hardware import Hardware
from udnn_lab.plan.ir import Offload, Plan, Recompute
from udnn_lab.profile import Profile
from udnn_lab.units import cuda_block_bytes, format_bytes, format_seconds

TIMELINE_COLUMNS = ["stream", "kind", "start_s", "end_s", "op", "name", "module", "tensor", "nbytes"]


@dataclass(frozen=True, repr=False)
class Simulation:
    """The predicted step: timeline, memory curve, time, stalls and traffic."""

    model_name: str
    policy: str
    device: str
    budget_bytes: int | None
    step_time_s: float
    compute_time_s: float  # ops and recomputations
    stall_time_s: float  # compute waiting for memory or for prefetches
    d2h_bytes: int
    h2d_bytes: int
    lower_bound_s: float  # max(compute time, D2H bytes / bandwidth, H2D bytes / bandwidth)
    peak_bytes: int  # as the budget counts them: 512-byte blocks on CUDA, exact on CPU
    timeline: pd.DataFrame  # one row per op, copy and stall (TIMELINE_COLUMNS)
    curve: pd.DataFrame  # Graph.memory_curve()'s columns, plus start_s and end_s

    def __repr__(self) -> str:
        budget = format_bytes(self.budget_bytes) if self.budget_bytes is not None else "none"
        return (f"Simulation({self.model_name!r}, {self.policy}, step={format_seconds(self.step_time_s)}, "
                f"stall={format_seconds(self.stall_time_s)}, peak={format_bytes(self.peak_bytes)}, budget={budget})")

    @property
    def fits(self) -> bool:
        return self.budget_bytes is None or self.peak_bytes <= self.budget_bytes

    def memory_curve(self) -> pd.DataFrame:
        return self.curve.copy()


def simulate(graph: Graph, plan: Plan | None = None, hardware: Hardware | str | None = None,
             profile: Profile | None = None, rates: RateCurve | bool | None = None) -> Simulation:
    """Simulate one step of ``graph`` under ``plan`` (default: keep everything) on ``hardware``.

    Op times come from ``profile`` when given (it must be of this graph's step), else from
    a roofline with ``rates``: by default the curve kept for the hardware (if one was
    fitted); ``rates=False`` uses the hardware profile's figures alone.
    """
    plan = plan if plan is not None else Plan.keep_all(graph)
    plan.validate(graph)
    return simulate_with(graph, plan, cost_model(graph, hardware, profile, rates))


def cost_model(graph: Graph, hardware: Hardware | str | None = None, profile: Profile | None = None,
               rates: RateCurve | bool | None = None) -> CostModel:
    """The CostModel ``simulate`` would use for these arguments."""
    hw = resolve_hardware(hardware, graph.device)
    if rates is None and profile is None:
        rates = RateCurve.for_hardware(hw)
    return CostModel(hw, profile, rates if isinstance(rates, RateCurve) else None)


def simulate_with(graph: Graph, plan: Plan, cost: CostModel) -> Simulation:
    """Simulate with a ready CostModel (planners call this in their loops; the plan is not re-validated)."""
    return _Run(graph, plan, cost).simulate()


def resolve_hardware(hardware: Hardware | str | None, device: str) -> Hardware:
    """A Hardware profile from a name, or the profile that matches this machine's ``device``."""
    if isinstance(hardware, Hardware):
        return hardware
    if isinstance(hardware, str):
        return Hardware.load(hardware)
    if hardware is not None:
        raise TypeError(f"hardware must be a Hardware, a profile name or None, got {type(hardware).__name__}")
    from udnn_lab.devices import device_name

    if device == "cpu" or device == "cuda" and _cuda_here():
        here = device_name(device)
        for name in Hardware.names():
            candidate = Hardware.load(name)
            if candidate.device_type == device and here in candidate.device_names:
                return candidate
    raise ValueError(f"no hardware profile matches this machine's {device}: pass hardware= one of "
                     f"{Hardware.names()}, or measure it with ul.Hardware.measure() and pass the result")


def _cuda_here() -> bool:
    import torch

    return torch.cuda.is_available()


class _Run:
    """One simulation's mutable state (NOTE [simulated streams])."""

    def __init__(self, graph: Graph, plan: Plan, cost: CostModel) -> None:
        self.graph, self.plan, self.cost = graph, plan, cost
        self.cuda = graph.device == "cuda"
        self.times = cost.op_times_s(graph)
        self.budget = plan.budget_bytes
        self.category = {c: i for i, c in enumerate(CATEGORIES)}
        self.on_device = [graph.on_device(t) for t in graph.tensors]
        self.live = np.zeros(len(CATEGORIES), dtype=np.int64)
        self.live_cuda = 0
        self.pending: list[tuple[float, int]] = []  # (copy end, tensor): device memory freed then
        self.cancelled: set[int] = set()  # offloads whose prefetch came before their copy completed
        self.timeline: list[tuple] = []
        self.d2h_free = self.h2d_free = 0.0
        self.h2d_end: dict[int, float] = {}
        self.d2h_end: dict[int, float] = {}
        self.stall = 0.0
        self.violations = 0
        self.allocated_now = 0  # exact bytes allocated for the op being run
        self.released_now = 0  # exact bytes released since the last op ran
        self._index_actions()

    def _index_actions(self) -> None:
        self.offload_after: dict[int, list[Offload]] = {}
        self.prefetch_at: dict[int, list[Offload]] = {}
        self.sync_before: dict[int, list[int]] = {}
        self.recompute_at: dict[int, list[Recompute]] = {}
        self.drop_after: dict[int, list[int]] = {}
        for offload in self.plan.offloads:
            if self.on_device[offload.tensor]:
                self.offload_after.setdefault(offload.after_op, []).append(offload)
                self.prefetch_at.setdefault(offload.prefetch_at, []).append(offload)
                if offload.wait_before is not None:
                    self.sync_before.setdefault(offload.wait_before, []).append(offload.tensor)
        for recompute in self.plan.recomputes:
            self.recompute_at.setdefault(recompute.at_op, []).append(recompute)
            for tensor in recompute.tensors:
                if self.on_device[tensor]:
                    last = self.graph.tensors[tensor].last_forward_use
                    self.drop_after.setdefault(last, []).append(tensor)

    # -- memory -----------------------------------------------------------------------------
    def _counted(self) -> int:
        return self.live_cuda if self.cuda else int(self.live.sum())

    def _add(self, tensor: int, sign: int) -> None:
        t = self.graph.tensors[tensor]
        self.live[self.category[t.category]] += sign * t.nbytes
        self.live_cuda += sign * cuda_block_bytes(t.nbytes)
        if sign > 0:
            self.allocated_now += t.nbytes
        else:
            self.released_now += t.nbytes

    def _size(self, tensor: int) -> int:
        nbytes = self.graph.tensors[tensor].nbytes
        return cuda_block_bytes(nbytes) if self.cuda else nbytes

    def _free_completed(self, until: float) -> None:
        while self.pending and self.pending[0][0] <= until:
            tensor = heapq.heappop(self.pending)[1]
            if tensor not in self.cancelled:
                self._add(tensor, -1)

    def _wait_for_memory(self, start: float, need: int) -> float:
        """Start time once ``need`` more bytes fit the budget, freeing completed copies."""
        self._free_completed(start)
        while self.budget is not None and self._counted() + need > self.budget and self.pending:
            done, tensor = heapq.heappop(self.pending)
            if tensor in self.cancelled:
                continue
            start = max(start, done)
            self._add(tensor, -1)
        if self.budget is not None and self._counted() + need > self.budget:
            self.violations += 1
        return start

    # -- the step -------------------------------------------------------------------------
    def simulate(self) -> Simulation:
        graph = self.graph
        for t in graph.tensors:
            if self.on_device[t.id] and t.alloc_step < 0:
                self._add(t.id, +1)
        for t in graph.tensors:
            if self.on_device[t.id] and t.free_step == -1:
                self._add(t.id, -1)
        rows, clock = [], 0.0
        self.allocated_now = self.released_now = 0
        for op in graph.ops:
            clock, row, released_before = self._step(op, clock)
            if rows:
                rows[-1][5] = released_before  # released between the previous op and this one
            rows.append(row)
        if rows:
            rows[-1][5] = self.released_now
        return self._result(rows, clock)

    def _step(self, op, clock: float):
        i = op.index
        prefetches = self.prefetch_at.get(i, [])
        recomputes = self.recompute_at.get(i, [])
        allocated = [t for t in op.allocated if self.on_device[t]]
        need = sum(self._size(t) for t in allocated) \
            + sum(self._size(t) for r in recomputes for t in self._restored(r)) \
            + sum(self._size(o.tensor) for o in prefetches if self.d2h_end.get(o.tensor, 0.0) <= clock)
        start = self._wait_for_memory(clock, need)
        self._stall(clock, start, i, "stall_memory")
        synced = max([start] + [self.d2h_end[t] for t in self.sync_before.get(i, []) if t in self.d2h_end])
        self._stall(start, synced, i, "stall_sync")
        start = synced
        released_before, self.released_now = self.released_now, 0  # belongs to the previous op
        for offload in prefetches:
            self._prefetch(offload, start, i)
        for recompute in recomputes:
            start = self._recompute(recompute, start, i)
        ready = max([start] + [self.h2d_end[t] for t in op.inputs if t in self.h2d_end])
        self._stall(start, ready, i, "stall_prefetch")
        end = ready + float(self.times[i])
        self.timeline.append(("compute", "op", ready, end, i, op.name, op.module, "", 0))
        for t in allocated:
            self._add(t, +1)
        row = [self.live.copy(), self.live_cuda, ready, end, self._take_allocated(), 0]
        for t in op.released:
            if self.on_device[t]:
                self._add(t, -1)
        for tensor in self.drop_after.get(i, []):
            self._add(tensor, -1)
        for offload in self.offload_after.get(i, []):
            self._offload(offload, end, i)
        return end, row, released_before

    def _restored(self, recompute: Recompute) -> list[int]:
        return [t for t in recompute.tensors if self.on_device[t]]

    def _take_allocated(self) -> int:
        taken, self.allocated_now = self.allocated_now, 0
        return taken

    def _stall(self, start: float, end: float, op: int, kind: str) -> None:
        if end > start:
            self.stall += end - start
            self.timeline.append(("compute", kind, start, end, op, kind.removeprefix("stall_"),
                                  self.graph.ops[op].module, "", 0))

    def _offload(self, offload: Offload, after: float, op: int) -> None:
        t = self.graph.tensors[offload.tensor]
        start = max(self.d2h_free, after)
        end = start + self.cost.transfer_time_s(t.nbytes, "d2h", offload.pinned)
        self.d2h_free = self.d2h_end[t.id] = end
        heapq.heappush(self.pending, (end, t.id))
        self.timeline.append(("d2h", "offload", start, end, op, t.name, t.module, t.name, t.nbytes))

    def _prefetch(self, offload: Offload, issued: float, op: int) -> None:
        t = self.graph.tensors[offload.tensor]
        if self.d2h_end.get(t.id, 0.0) > issued:  # its copy is still in flight: it never left the device
            self.cancelled.add(t.id)
            self.h2d_end[t.id] = issued
            self.timeline.append(("h2d", "prefetch_cancelled", issued, issued, op, t.name, t.module, t.name, 0))
            return
        self._add(t.id, +1)
        start = max(self.h2d_free, issued)
        end = start + self.cost.transfer_time_s(t.nbytes, "h2d", offload.pinned)
        self.h2d_free = self.h2d_end[t.id] = end
        self.timeline.append(("h2d", "prefetch", start, end, op, t.name, t.module, t.name, t.nbytes))

    def _recompute(self, recompute: Recompute, start: float, op: int) -> float:
        restored = self._restored(recompute)
        for tensor in restored:
            self._add(tensor, +1)
        end = start + float(sum(self.times[j] for j in recompute.ops))
        names = ", ".join(self.graph.tensors[t].name for t in recompute.tensors)
        nbytes = sum(self.graph.tensors[t].nbytes for t in restored)
        module = self.graph.ops[recompute.ops[-1]].module
        self.timeline.append(("compute", "recompute", start, end, op, names, module, names, nbytes))
        return end

    def _result(self, rows, clock: float) -> Simulation:
        graph = self.graph
        curve = graph.memory_curve()
        per_category = np.array([r[0] for r in rows]).reshape(len(rows), len(CATEGORIES))
        for j, category in enumerate(CATEGORIES):
            curve[category] = per_category[:, j] if len(rows) else []
        curve["live_bytes"] = per_category.sum(axis=1) if len(rows) else []
        curve["cuda_live_bytes"] = [r[1] for r in rows]
        curve["allocated_bytes"] = [r[4] for r in rows]
        curve["released_bytes"] = [r[5] for r in rows]
        curve["start_s"] = [r[2] for r in rows]
        curve["end_s"] = [r[3] for r in rows]
        timeline = pd.DataFrame(self.timeline, columns=TIMELINE_COLUMNS).sort_values(["start_s", "stream"],
                                                                                       kind="stable")
        counted = curve["cuda_live_bytes"] if self.cuda else curve["live_bytes"]
        base = graph.cuda_baseline_bytes if self.cuda else graph.baseline_bytes
        d2h = timeline[timeline.stream == "d2h"]["nbytes"].sum()
        h2d = timeline[timeline.stream == "h2d"]["nbytes"].sum()
        compute = float(timeline[(timeline.stream == "compute") & timeline.kind.isin(["op", "recompute"])]
                        .eval("end_s - start_s").sum())
        step = max(clock, self.d2h_free, self.h2d_free)
        hw = self.cost.hardware
        bound = max(compute, d2h / hw.bandwidth_bytes_per_s("d2h", True) if d2h else 0.0,
                    h2d / hw.bandwidth_bytes_per_s("h2d", True) if h2d else 0.0)
        return Simulation(
            model_name=graph.model_name, policy=self.plan.policy, device=graph.device,
            budget_bytes=self.budget, step_time_s=step, compute_time_s=compute, stall_time_s=self.stall,
            d2h_bytes=int(d2h), h2d_bytes=int(h2d), lower_bound_s=bound,
            peak_bytes=int(max(base, counted.max() if len(counted) else 0)),
            timeline=timeline.reset_index(drop=True), curve=curve,
        )

