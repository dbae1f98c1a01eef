"""The drill-down of a memory curve: which tensors are live at one op, and for how long they live.

Before the step runs: the graph's liveness (every tensor kept), or under a plan the
Simulation's (the graph's, with the plan's changes: Simulation.device_changes).
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from udnn_lab.graph.step_graph import Graph
from udnn_lab.simulation.simulator import Simulation

__all__ = ["LIVE_TENSOR_COLUMNS", "live_tensors"]

LIVE_TENSOR_COLUMNS = ["tensor", "id", "nbytes", "cuda_nbytes", "category", "producer", "producer_op", "module",
                       "alloc_op", "free_op", "lifetime_ops", "lifetime_s", "on_device", "state"]


def live_tensors(graph: Graph, op_index: int, simulation: Simulation | None = None) -> pd.DataFrame:
    """The tensors live at op ``op_index`` (held at some moment of it, as the curves count), largest first.

    Columns LIVE_TENSOR_COLUMNS: the tensor's name and id, its bytes (exact, and in CUDA
    blocks), category, the op that produced it (index, -1 before the step; its aten name),
    its module path, the first op it is live at (-1: before the step) and the op it is
    released after (NA: alive at the end), its lifetime in ops and, with a simulation, in
    seconds (from its first op's start to its last op's end). ``on_device``: whether it
    holds device memory at the op; ``state``: 'on device', or under ``simulation``'s plan
    'offloading' / 'prefetching' while its copy runs during the op, 'offloaded' or
    'dropped' (recomputed later) when the plan took it off the device; those rows have
    ``on_device`` False. The ``on_device`` rows' bytes sum to the curve's ``live_bytes``
    at the op (their ``cuda_nbytes`` to ``cuda_live_bytes``).
    """
    n_ops = len(graph.ops)
    if not 0 <= op_index < n_ops:
        raise IndexError(f"op_index must be an op of the step, 0 to {n_ops - 1}; got {op_index}")
    tensors = graph.tensors
    alloc = np.array([t.alloc_step for t in tensors], dtype=np.int64)
    free = np.array([n_ops if t.free_step is None else t.free_step for t in tensors], dtype=np.int64)
    device = np.array([graph.on_device(t) for t in tensors], dtype=bool)
    live = device & (alloc <= op_index) & (free >= op_index)
    count = live.astype(np.int64)
    if simulation is not None:
        for first, sign, tensor in simulation.device_changes:
            if first <= op_index:
                count[tensor] += sign
    shown = np.flatnonzero(live | (count > 0))
    rows = [_row(graph, tensors[i], int(free[i]), bool(count[i] > 0)) for i in shown]
    frame = pd.DataFrame(rows, columns=[c for c in LIVE_TENSOR_COLUMNS if c not in ("lifetime_s", "state")])
    frame["free_op"] = frame["free_op"].astype("Int64")
    frame["lifetime_s"] = _lifetimes_s(frame, simulation, n_ops)
    frame["state"] = _states(frame, simulation, op_index)
    frame = frame.sort_values(["on_device", "nbytes", "id"], ascending=[False, False, True], kind="stable")
    frame.attrs.update(model=graph.model_name, op_index=op_index, op=graph.ops[op_index].name,
                       module=graph.ops[op_index].module, phase=graph.ops[op_index].phase,
                       policy=simulation.policy if simulation is not None else "keep-all")
    return frame[LIVE_TENSOR_COLUMNS].reset_index(drop=True)


def _row(graph: Graph, t, free: int, on_device: bool) -> dict:
    producer = -1 if t.producer is None else t.producer
    last = min(free, len(graph.ops) - 1)
    return {"tensor": t.name, "id": t.id, "nbytes": t.nbytes, "cuda_nbytes": t.cuda_nbytes, "category": t.category,
            "producer": producer, "producer_op": graph.ops[producer].name if producer >= 0 else "(before the step)",
            "module": t.module, "alloc_op": t.alloc_step, "free_op": t.free_step,
            "lifetime_ops": last - max(t.alloc_step, 0) + 1, "on_device": on_device}


def _lifetimes_s(frame: pd.DataFrame, simulation: Simulation | None, n_ops: int) -> pd.Series:
    if simulation is None or frame.empty:
        return pd.Series(np.nan, index=frame.index, dtype=float)
    starts, ends = simulation.curve["start_s"].to_numpy(), simulation.curve["end_s"].to_numpy()
    first = frame["alloc_op"].clip(lower=0).to_numpy()
    last = frame["free_op"].fillna(n_ops - 1).astype("int64").clip(upper=n_ops - 1).to_numpy()
    return pd.Series(ends[last] - starts[first], index=frame.index, dtype=float)


def _states(frame: pd.DataFrame, simulation: Simulation | None, op_index: int) -> pd.Series:
    state = pd.Series("on device", index=frame.index, dtype=object)
    if simulation is None or frame.empty:
        return state
    op_start = float(simulation.curve["start_s"].iloc[op_index])
    op_end = float(simulation.curve["end_s"].iloc[op_index])
    events = simulation.timeline
    offloaded = set(events.loc[events["kind"] == "offload", "tensor"])
    during = events[(events["start_s"] < op_end) & (events["end_s"] > op_start)]
    copying = {kind: set(during.loc[during["kind"] == kind, "tensor"]) for kind in ("offload", "prefetch")}
    names, on_device = frame["tensor"], frame["on_device"]
    state[on_device & names.isin(copying["offload"])] = "offloading"
    state[on_device & names.isin(copying["prefetch"])] = "prefetching"
    state[~on_device & names.isin(offloaded)] = "offloaded"
    state[~on_device & ~names.isin(offloaded)] = "dropped"
    return state
