"""The work of a sweep over world sizes: which ranks to trace, and each one's rows (``sweep_processes`` runs
them here or in worker processes)."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from udnn_lab.analysis import trace
from udnn_lab.graph import Graph
from udnn_lab.hardware import Hardware
from udnn_lab.parallel import DDP, Parallel, describe
from udnn_lab.workload import Workload

RowMaker = Callable[[Graph, Parallel, int, str], dict[str, Any]]  # graph, spec, budget, policy -> a row's columns


@dataclass(frozen=True)
class Traced:
    """One traced rank: its rows (every setup that uses its spec, x budgets x policies) and, for the DDP rank
    that other DDP ranks are made from, its graph."""

    spec: Parallel
    graph: Graph | None
    trace_s: float
    rows: tuple[dict[str, Any], ...]
    pid: int = field(default_factory=os.getpid)  # the process that traced it (NOTE [sweep processes])


@dataclass(frozen=True)
class RankJob:
    """What a sweep traces and how it turns each rank into rows."""

    work: Workload
    profile: Hardware
    budgets: list[int]
    policies: list[str]
    specs: dict[tuple[str, int], Parallel]  # (setup, world size) -> the rank's spec
    make_row: RowMaker
    traced: list[Parallel] = field(init=False)

    def __post_init__(self) -> None:
        distinct = list(dict.fromkeys(self.specs.values()))  # HSDP within one node is FSDP2: traced once
        base = next((spec for spec in distinct if isinstance(spec, DDP) and spec.world_size >= 2), None)
        object.__setattr__(self, "traced", [spec for spec in distinct if not made_from(spec, base)])

    def setups_of(self, spec: Parallel) -> list[str]:
        return [setup for (setup, _), other in self.specs.items() if other == spec]

    def plans_of(self, spec: Parallel) -> int:
        offloads = sum(setup.endswith("+offload") for setup in self.setups_of(spec))
        return offloads * len(self.budgets) * len(self.policies)

    def run(self, index: int) -> Traced:
        spec = self.traced[index]
        start = time.perf_counter()
        graph = trace(self.work, device=self.profile.device_type, parallel=spec)
        seconds = time.perf_counter() - start
        return Traced(spec, graph if isinstance(spec, DDP) else None, seconds, self.rows(spec, graph, seconds))

    def derived(self, spec: Parallel, found: dict[Parallel, Traced]) -> Traced:
        """The rows of a DDP rank not traced itself, from the DDP rank that was (``same_ddp_rank``)."""
        done = next(done for done in found.values() if made_from(spec, done.spec))
        assert done.graph is not None  # a traced DDP rank keeps its graph
        return Traced(spec, None, 0.0, self.rows(spec, same_ddp_rank(spec, done.spec, done.graph), 0.0))

    def rows(self, spec: Parallel, graph: Graph, trace_s: float) -> tuple[dict[str, Any], ...]:
        rows = []
        for setup in self.setups_of(spec):
            for budget in self.budgets:
                for policy in self.policies if setup.endswith("+offload") else ["keep-all"]:
                    start = time.perf_counter()
                    row = self.make_row(graph, spec, budget, policy)
                    rows.append({"world_size": spec.world_size, "setup": setup, "trace_s": trace_s,
                                 "plan_s": time.perf_counter() - start if policy != "keep-all" else 0.0, **row})
        return tuple(rows)


def made_from(spec: Parallel, traced: Parallel | None) -> bool:
    """Whether ``spec``'s rank is made from ``traced``'s rather than traced (``same_ddp_rank``)."""
    return isinstance(spec, DDP) and isinstance(traced, DDP) and spec != traced and spec.world_size >= 2 \
        and traced.world_size >= 2 and replace(traced, world_size=spec.world_size) == spec


def same_ddp_rank(spec: Parallel, traced: Parallel, graph: Graph) -> Graph:
    """A DDP rank's step at this world size from one traced at another. Every DDP rank of a world of two or more
    holds and runs the same (whole replicas, the same buckets; the gradients' division by the world size is one
    op whatever its value): only the collectives' group differs. Checked in tests/fitting/test_ranks.py."""
    ops = tuple(replace(op, ranks=spec.world_size) if op.ranks == traced.world_size else op for op in graph.ops)
    notes = tuple(describe(spec) if note == describe(traced) else note for note in graph.notes)
    return replace(graph, ops=ops, notes=notes)
