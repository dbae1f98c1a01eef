"""Why a plan is what it is: each tensor saved for backward, what the plan does with it, and why.

The reasons are read off the graph, the plan and its simulation, not kept by the planners: a
copy is "hidden" when backward never waited for it, a rebuild is "cheap" by its seconds per byte
next to the plan's other rebuilds, and a tensor is "kept" for the first of these that holds:
moving it frees nothing, the plan's size floor, or the budget is met without it.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from udnn_lab.graph.plan_ir import Offload, Plan, Recompute
from udnn_lab.graph.reruns import NOT_RERUN
from udnn_lab.graph.step_graph import Graph
from udnn_lab.simulation.simulator import Simulation
from udnn_lab.units import format_bytes, format_seconds
from udnn_lab.vocabulary import PLANNED_CATEGORIES

__all__ = ["PLAN_REASON_COLUMNS", "plan_reasons"]

PLAN_REASON_COLUMNS = ["tensor", "id", "module", "category", "nbytes", "action", "reason", "copy_s", "waited_s",
                       "rebuild_s"]
MIB = 1 << 20


def plan_reasons(graph: Graph, plan: Plan, simulation: Simulation) -> pd.DataFrame:
    """One row per tensor saved for backward on the device, in the order forward makes them.

    ``action``: 'keep', 'offload' or 'recompute'. ``reason``: in words, with the figures behind
    it. ``copy_s``: an offload's device-to-host plus host-to-device copy times; ``waited_s``:
    how long backward waited for its copy to come back (0: hidden by compute); ``rebuild_s``: a
    recomputed tensor's share of the ops re-run to rebuild it (by bytes, when one replay rebuilds
    several).
    """
    plan.check_belongs(graph)
    events = simulation.timeline
    copies = _copies(events)
    waits = _waits(graph, events, copies)
    rebuilds = _rebuilds(graph, plan, simulation)
    rerun_by = _rerun_modules(graph, plan)
    per_mib = [seconds / (graph.tensors[t].nbytes / MIB) for t, seconds in rebuilds.items() if graph.tensors[t].nbytes]
    median_per_mib = float(np.median(per_mib)) if per_mib else 0.0
    rows = []
    for t in graph.tensors:
        if not t.saved or t.first_backward_use is None or not graph.on_device(t):
            continue
        action = plan.action(t.id)
        copy_s = copies.get(t.name, 0.0) if isinstance(action, Offload) else np.nan
        waited_s = waits.get(t.id, 0.0) if isinstance(action, Offload) else np.nan
        rebuild_s = rebuilds.get(t.id, np.nan) if isinstance(action, Recompute) else np.nan
        rows.append({"tensor": t.name, "id": t.id, "module": t.module, "category": t.category, "nbytes": t.nbytes,
                     "action": _action_name(action),
                     "reason": _reason(t, action, plan, simulation, copy_s, waited_s, rebuild_s, median_per_mib)
                     + (f", by calling its {rerun_by[t.id]} again" if t.id in rerun_by else ""),
                     "copy_s": copy_s, "waited_s": waited_s, "rebuild_s": rebuild_s})
    frame = pd.DataFrame(rows, columns=PLAN_REASON_COLUMNS)
    frame.attrs.update(model=graph.model_name, policy=plan.policy, budget_bytes=plan.budget_bytes,
                       peak_bytes=simulation.peak_bytes)
    return frame


def _action_name(action: Offload | Recompute | None) -> str:
    return "offload" if isinstance(action, Offload) else "recompute" if isinstance(action, Recompute) else "keep"


def _reason(t, action, plan: Plan, simulation: Simulation, copy_s: float, waited_s: float, rebuild_s: float,
            median_per_mib: float) -> str:
    if isinstance(action, Offload):
        if waited_s > 0:
            return (f"offloaded: its copies take {format_seconds(copy_s)}; backward waits "
                    f"{format_seconds(waited_s)} for it to come back")
        return f"offloaded: its copies ({format_seconds(copy_s)}) are hidden by compute"
    if isinstance(action, Recompute):
        per_mib = rebuild_s / (t.nbytes / MIB) if t.nbytes else 0.0
        cheap = "cheap to rebuild" if per_mib <= median_per_mib else "rebuilt"
        return (f"{cheap}: {format_seconds(rebuild_s)} of recompute for {format_bytes(t.nbytes)} "
                f"({format_seconds(per_mib)} per MiB)")
    if t.category not in PLANNED_CATEGORIES:
        return f"kept: {t.category.replace('_', ' ')} stays on the device whatever the plan, so moving it frees nothing"
    if t.held_past_forward:
        return "kept: the training loop holds it through backward (the output or the loss)"
    if t.nbytes < plan.size_floor_bytes:
        return f"kept: smaller than the plan's floor of {format_bytes(plan.size_floor_bytes)}"
    if plan.budget_bytes is None:
        return "kept: no budget was asked for"
    if simulation.peak_bytes <= plan.budget_bytes:
        return (f"kept because the budget allows: the step peaks at {format_bytes(simulation.peak_bytes)} of "
                f"{format_bytes(plan.budget_bytes)}")
    return f"kept: the plan does not fit its budget ({format_bytes(simulation.peak_bytes)} over budget)"


def _copies(events: pd.DataFrame) -> dict[str, float]:
    """Tensor name -> seconds of its device-to-host and host-to-device copies."""
    moved = events[events["kind"].isin(["offload", "prefetch"])]
    return (moved["end_s"] - moved["start_s"]).groupby(moved["tensor"]).sum().to_dict()


def _waits(graph: Graph, events: pd.DataFrame, copies: dict[str, float]) -> dict[int, float]:
    """Offloaded tensor id -> how long its first backward reader waited for its prefetch."""
    prefetched = events[events["kind"] == "prefetch"].set_index("tensor")["end_s"]
    stalls = events[events["kind"] == "stall_prefetch"]
    waits: dict[int, float] = {}
    by_name = {t.name: t for t in graph.tensors if t.name in copies}
    for _, stall in stalls.iterrows():
        op = graph.ops[int(stall["op"])]
        for tensor_id in op.inputs:
            name = graph.tensors[tensor_id].name
            if name in by_name and name in prefetched.index and prefetched[name] >= stall["end_s"] - 1e-12:
                waits[tensor_id] = waits.get(tensor_id, 0.0) + float(stall["end_s"] - stall["start_s"])
    return waits


def _rerun_modules(graph: Graph, plan: Plan) -> dict[int, str]:
    """Recomputed tensor id -> the class of the module call the runtime re-runs for it (NOTE [hook points] 7)."""
    reruns = plan.reruns_in(graph)
    return {t: graph.hook_events[enter].node for recompute, enter in zip(plan.recomputes, reruns)
            if enter != NOT_RERUN for t in recompute.tensors}


def _rebuilds(graph: Graph, plan: Plan, simulation: Simulation) -> dict[int, float]:
    """Recomputed tensor id -> its share (by bytes) of the replay that rebuilds it."""
    times = simulation.curve["end_s"].to_numpy() - simulation.curve["start_s"].to_numpy()
    shares: dict[int, float] = {}
    for recompute in plan.recomputes:
        seconds = float(sum(times[op] for op in recompute.ops))
        total = sum(graph.tensors[t].nbytes for t in recompute.tensors) or 1
        for t in recompute.tensors:
            shares[t] = seconds * graph.tensors[t].nbytes / total
    return shares
