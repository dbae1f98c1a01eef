"""Graph -> memory curve, breakdown, per-layer table and document 000's schedule table."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import pandas as pd

from udnn_lab.graph.cached import per_graph
from udnn_lab.graph.step_records import ModuleCall, OpInfo, TensorInfo
from udnn_lab.units import cuda_block_bytes
from udnn_lab.vocabulary import CATEGORIES as CATEGORY_ORDER


class Graph(Protocol):
    """What this module reads of a step's Graph (step_graph.Graph, which calls these functions)."""

    @property
    def model_name(self) -> str: ...
    @property
    def ops(self) -> tuple[OpInfo, ...]: ...
    @property
    def tensors(self) -> tuple[TensorInfo, ...]: ...
    @property
    def module_calls(self) -> tuple[ModuleCall, ...]: ...
    def on_device(self, tensor: TensorInfo) -> bool: ...
    def on_host(self, tensor: TensorInfo) -> bool: ...


@dataclass(frozen=True)
class LiveCurve:
    """Live bytes per op and category (rows: ops, columns: CATEGORY_ORDER)."""

    per_category: np.ndarray  # int64 [n_ops, n_categories], exact bytes
    cuda_total: np.ndarray  # int64 [n_ops], 512-byte rounded total
    allocated: np.ndarray  # int64 [n_ops], bytes allocated by each op
    released: np.ndarray  # int64 [n_ops], bytes released right after each op
    baseline_per_category: np.ndarray  # int64 [n_categories], before the first op
    baseline_cuda: int

    @property
    def total(self) -> np.ndarray:
        return self.per_category.sum(axis=1)

    @property
    def baseline_bytes(self) -> int:
        return int(self.baseline_per_category.sum())

    @property
    def peak_bytes(self) -> int:
        return int(max(self.baseline_bytes, self.total.max(initial=0)))

    @property
    def cuda_peak_bytes(self) -> int:
        return int(max(self.baseline_cuda, self.cuda_total.max(initial=0)))

    @property
    def peak_step(self) -> int:
        total = self.total
        if len(total) == 0 or total.max() < self.baseline_bytes:
            return -1
        return int(total.argmax())


@dataclass(frozen=True)
class OpTable:
    """Per op, the device bytes it allocates and releases: the one table the analyzer's curve and the
    simulator share. Exact bytes per category, and 512-byte CUDA blocks in total."""

    on_device: tuple[bool, ...]  # per tensor: counts toward the graph's device memory
    exact: tuple[int, ...]  # per tensor: bytes
    block: tuple[int, ...]  # per tensor: bytes in CUDA blocks
    category: tuple[int, ...]  # per tensor: index into CATEGORY_ORDER
    alloc: np.ndarray  # int64 [ops, categories]: bytes each op allocates
    release: np.ndarray  # int64 [ops, categories]: bytes released right after each op
    alloc_block: np.ndarray  # int64 [ops]
    release_block: np.ndarray  # int64 [ops]
    baseline: np.ndarray  # int64 [categories]: live before the first op
    baseline_block: int
    gone_at_start: np.ndarray  # int64 [categories]: of the baseline, released before the first op runs
    gone_at_start_block: int


@per_graph
def op_table(graph: Graph) -> OpTable:
    """The device's table: the tensors that count toward the graph's device memory."""
    return _table(graph, tuple(graph.on_device(t) for t in graph.tensors))


@per_graph
def host_table(graph: Graph) -> OpTable:
    """The host's table: the tensors a rank keeps in host memory (NOTE [host storages] in analysis/_host.py);
    its ``on_device`` says which tensors it counts (those on the host)."""
    return _table(graph, tuple(graph.on_host(t) for t in graph.tensors))


def _table(graph: Graph, on_device: tuple[bool, ...]) -> OpTable:
    n_ops, n_cat = len(graph.ops), len(CATEGORY_ORDER)
    column = {c: i for i, c in enumerate(CATEGORY_ORDER)}
    exact = tuple(t.nbytes for t in graph.tensors)
    block = tuple(cuda_block_bytes(n) for n in exact)
    category = tuple(column[t.category] for t in graph.tensors)
    alloc, release = np.zeros((n_ops, n_cat), np.int64), np.zeros((n_ops, n_cat), np.int64)
    alloc_block, release_block = np.zeros(n_ops, np.int64), np.zeros(n_ops, np.int64)
    baseline, gone_at_start = np.zeros(n_cat, np.int64), np.zeros(n_cat, np.int64)
    baseline_block = gone_at_start_block = 0
    for t in graph.tensors:
        if not on_device[t.id]:
            continue
        c = category[t.id]
        if t.alloc_step < 0:
            baseline[c] += t.nbytes
            baseline_block += block[t.id]
        else:
            alloc[t.alloc_step, c] += t.nbytes
            alloc_block[t.alloc_step] += block[t.id]
        if t.free_step == -1:
            gone_at_start[c] += t.nbytes
            gone_at_start_block += block[t.id]
        elif t.free_step is not None:
            release[t.free_step, c] += t.nbytes
            release_block[t.free_step] += block[t.id]
    return OpTable(on_device, exact, block, category, alloc, release, alloc_block, release_block, baseline,
                   baseline_block, gone_at_start, gone_at_start_block)


def live_bytes(graph: Graph, table: OpTable | None = None) -> LiveCurve:
    """Live bytes per op of ``table``'s tensors (by default the device's)."""
    table = op_table(graph) if table is None else table
    delta = table.alloc.copy()
    cuda_delta = table.alloc_block.copy()
    if len(delta):
        delta[0] -= table.gone_at_start
        delta[1:] -= table.release[:-1]
        cuda_delta[0] -= table.gone_at_start_block
        cuda_delta[1:] -= table.release_block[:-1]
    per_category = table.baseline + np.cumsum(delta, axis=0)
    cuda_total = table.baseline_block + np.cumsum(cuda_delta)
    return LiveCurve(per_category, cuda_total, table.alloc.sum(axis=1), table.release.sum(axis=1), table.baseline,
                     table.baseline_block)


def memory_curve(graph: Graph, live: LiveCurve) -> pd.DataFrame:
    frame = pd.DataFrame(
        {
            "index": np.arange(len(graph.ops)),
            "phase": [op.phase for op in graph.ops],
            "module": [op.module for op in graph.ops],
            "op": [op.name for op in graph.ops],
            "live_bytes": live.total,
            "cuda_live_bytes": live.cuda_total,
            "allocated_bytes": live.allocated,
            "released_bytes": live.released,
        }
    )
    for i, category in enumerate(CATEGORY_ORDER):
        frame[category] = live.per_category[:, i]
    frame.attrs["baseline_bytes"] = live.baseline_bytes
    frame.attrs["cuda_baseline_bytes"] = live.baseline_cuda
    frame.attrs["model"] = graph.model_name
    return frame


def breakdown(graph: Graph, live: LiveCurve, host: LiveCurve) -> pd.DataFrame:
    """The device's bytes per category at its peak and each category's own most; ``host_bytes``: each category's
    most in host memory (0 unless the graph has tensors there)."""
    step = live.peak_step
    at_peak = live.baseline_per_category if step < 0 else live.per_category[step]
    most = np.maximum(live.per_category.max(axis=0, initial=0), live.baseline_per_category)
    counts: defaultdict[str, int] = defaultdict(int)
    for t in graph.tensors:
        if graph.on_device(t):
            counts[t.category] += 1
    peak = max(live.peak_bytes, 1)
    frame = pd.DataFrame(
        {
            "category": list(CATEGORY_ORDER),
            "bytes_at_peak": at_peak,
            "share_at_peak": at_peak / peak,
            "max_bytes": most,
            "tensors": [counts[c] for c in CATEGORY_ORDER],
            "host_bytes": np.maximum(host.per_category.max(axis=0, initial=0), host.baseline_per_category),
        }
    )
    total = pd.DataFrame(
        [{"category": "total", "bytes_at_peak": live.peak_bytes, "share_at_peak": 1.0,
          "max_bytes": live.peak_bytes, "tensors": sum(counts.values()), "host_bytes": host.peak_bytes}]
    )
    frame = pd.concat([frame, total], ignore_index=True).set_index("category")
    frame.attrs["peak_step"] = step
    return frame


def layers(graph: Graph) -> pd.DataFrame:
    """Per module path: order, calls, ops, output bytes, saved activation bytes, parameter bytes."""
    rows: dict[str, dict] = {}
    for call in graph.module_calls:
        row = rows.setdefault(call.path, {"module": call.path, "type": call.type, "order": call.first_op,
                                          "calls": 0, "output_bytes": 0})
        row["calls"] += 1
        row["output_bytes"] += sum(graph.tensors[i].nbytes for i in set(call.outputs))
    ops_per_module: defaultdict[str, list[int]] = defaultdict(lambda: [0, 0])
    for op in graph.ops:
        if op.phase in ("forward", "backward"):
            ops_per_module[op.module][op.phase == "backward"] += 1
    saved = defaultdict(set)
    for t in graph.tensors:
        if t.saved and t.category not in ("parameter", "buffer"):
            for op_index in t.saved_by:
                for path in _with_ancestors(graph.ops[op_index].module):
                    saved[path].add(t.id)
    param_bytes: defaultdict[str, int] = defaultdict(int)
    for t in graph.tensors:
        if t.category == "parameter":
            for path in _with_ancestors(t.name.rpartition(".")[0]):
                param_bytes[path] += t.nbytes
    out = []
    for path, row in rows.items():
        out.append({**row,
                    "depth": 0 if path == "" else path.count(".") + 1,
                    "forward_ops": ops_per_module[path][0],
                    "backward_ops": ops_per_module[path][1],
                    "saved_bytes": sum(graph.tensors[i].nbytes for i in saved[path]),
                    "parameter_bytes": param_bytes[path]})
    frame = pd.DataFrame(out, columns=["module", "type", "order", "depth", "calls", "forward_ops", "backward_ops",
                                       "output_bytes", "saved_bytes", "parameter_bytes"])
    return frame.sort_values("order", kind="stable").reset_index(drop=True)


def _with_ancestors(path: str) -> list[str]:
    if path.startswith("<"):
        return [path]
    parts = path.split(".") if path else []
    return [""] + [".".join(parts[: i + 1]) for i in range(len(parts))]


def schedule(graph: Graph, level: str = "layer", include_parameters: bool = False) -> pd.DataFrame:
    if level not in ("layer", "op"):
        raise ValueError(f"schedule level must be 'layer' or 'op', got {level!r}")
    resident = () if include_parameters else ("parameter", "buffer")
    visible = [t.category not in resident for t in graph.tensors]
    groups: list[list[int]] = []
    for op in graph.ops:
        if op.phase == "optimizer":
            continue
        same = (level == "layer" and groups and graph.ops[groups[-1][-1]].phase == op.phase
                and graph.ops[groups[-1][-1]].module == op.module)
        if same:
            groups[-1].append(op.index)
        else:
            groups.append([op.index])
    rows = []
    for step, members in enumerate(groups, start=1):
        made: set[int] = set()
        reads, allocates, releases = [], [], []
        for i in members:
            op = graph.ops[i]
            reads += [t for t in op.inputs if t not in made and visible[t]]
            allocates += [t for t in op.allocated if visible[t]]
            made.update(op.allocated)
            releases += [t for t in op.released if visible[t]]
        first = graph.ops[members[0]]
        rows.append({
            "step": step,
            "phase": first.phase,
            "module": first.module,
            "first_op": members[0],
            "ops": len(members),
            "reads": _names(graph, reads),
            "allocates": _names(graph, allocates),
            "releases": _names(graph, releases),
        })
    return pd.DataFrame(rows, columns=["step", "phase", "module", "first_op", "ops", "reads", "allocates", "releases"])


def _names(graph: Graph, ids: list[int]) -> tuple[str, ...]:
    return tuple(graph.tensors[i].name for i in dict.fromkeys(ids))


def tensors_frame(graph: Graph) -> pd.DataFrame:
    rows = [{
        "id": t.id, "name": t.name, "category": t.category, "nbytes": t.nbytes, "cuda_nbytes": t.cuda_nbytes,
        "dtype": t.dtype, "shape": t.shape, "device": t.device, "module": t.module, "producer": t.producer,
        "saved": t.saved, "consumers": len(t.consumers), "first_use": t.first_use, "last_use": t.last_use,
        "last_forward_use": t.last_forward_use, "first_backward_use": t.first_backward_use,
        "alloc_step": t.alloc_step, "free_step": t.free_step,
    } for t in graph.tensors]
    return pd.DataFrame(rows)
