"""The work of a sweep over world sizes: which ranks to trace, and each one's rows (``sweep_processes`` runs
them here or in worker processes)."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from udnn_lab.analysis import trace
from udnn_lab.fitting._fsdp_ranks import TracedSizes, derivable, family, plan_traces, sharded_rows
from udnn_lab.graph import Graph
from udnn_lab.hardware import Hardware
from udnn_lab.parallel import DDP, FSDP, Parallel, describe
from udnn_lab.workload import Workload

RowMaker = Callable[[Graph, Parallel, int, str], dict[str, Any]]  # graph, spec, budget, policy -> a row's columns


@dataclass(frozen=True)
class Traced:
    """One rank, traced or made from traced ones: its rows (every setup that uses its spec, x budgets x
    policies) and, for a traced rank that others are made from, its graph."""

    spec: Parallel
    graph: Graph | None
    trace_s: float  # 0: made from traced ranks
    rows: tuple[dict[str, Any], ...]
    pid: int = field(default_factory=os.getpid)  # the process that traced it (NOTE [sweep processes])


@dataclass(frozen=True)
class RankJob:
    """What a sweep traces, what it makes from traced ranks, and how it turns each rank into rows. Its tasks are
    the ranks to trace, then those made from them (``needs`` says from which)."""

    work: Workload
    profile: Hardware
    budgets: list[int]
    policies: list[str]
    specs: dict[tuple[str, int], Parallel]  # (setup, world size) -> the rank's spec
    make_row: RowMaker
    tasks: list[Parallel] = field(init=False)  # traced ones first
    traced: int = field(init=False)  # how many of the tasks are traced
    _families: dict[Parallel, TracedSizes] = field(init=False, default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        distinct = list(dict.fromkeys(self.specs.values()))  # HSDP within one node is FSDP2: traced once
        bases: dict[Parallel, Parallel] = {}  # the traced rank that more replicas of it are made from
        for spec in distinct:
            key = replicas_of(spec)
            if key is not None and key not in bases and (not isinstance(spec, DDP) or spec.world_size >= 2):
                bases[key] = spec
        made = {spec for spec in distinct if made_from(spec, bases.get(replicas_of(spec)))}  # type: ignore[arg-type]
        rows = sharded_rows(self.work.model)
        for kin in dict.fromkeys(family(spec) for spec in distinct if derivable(spec)):
            sizes = [spec.world_size for spec in distinct if derivable(spec) and family(spec) == kin]
            _, derived = plan_traces(sizes, rows)  # NOTE [FSDP ranks across world sizes] 4
            if derived:
                made |= {replace(kin, world_size=size) for size in derived}
                self._families[kin] = TracedSizes(rows or ())
        traced = [spec for spec in distinct if spec not in made]
        object.__setattr__(self, "tasks", traced + [spec for spec in distinct if spec in made])
        object.__setattr__(self, "traced", len(traced))

    def needs(self, index: int) -> list[int]:
        """The traced tasks that task ``index`` is made from (none for a traced one)."""
        if index < self.traced:
            return []
        spec = self.tasks[index]
        if replicas_of(spec) is not None:
            return [i for i in range(self.traced) if made_from(spec, self.tasks[i])]
        return [i for i in range(self.traced) if derivable(self.tasks[i]) and family(self.tasks[i]) == family(spec)
                and self.tasks[i].world_size < spec.world_size]  # NOTE [FSDP ranks across world sizes] 3

    def is_base(self, index: int) -> bool:
        """Whether another task is made from this one (its graph then comes back with its rows)."""
        return any(index in self.needs(other) for other in range(self.traced, len(self.tasks)))

    def setups_of(self, spec: Parallel) -> list[str]:
        return [setup for (setup, _), other in self.specs.items() if other == spec]

    def plans_of(self, spec: Parallel) -> int:
        offloads = sum(setup.endswith("+offload") for setup in self.setups_of(spec))
        return offloads * len(self.budgets) * len(self.policies)

    def run(self, index: int, done: Callable[[list[int]], list[Traced]]) -> Traced:
        """Task ``index``'s rows; ``done(indices)`` gives the traced tasks it is made from (waiting for them)."""
        spec = self.tasks[index]
        if index >= self.traced:
            return self._derived(spec, done(self.needs(index)))
        return self._traced(spec, keep=self.is_base(index))

    def _traced(self, spec: Parallel, keep: bool) -> Traced:
        start = time.perf_counter()
        graph = trace(self.work, device=self.profile.device_type, parallel=spec)
        seconds = time.perf_counter() - start
        return Traced(spec, graph if keep else None, seconds, self.rows(spec, graph, seconds))

    def _derived(self, spec: Parallel, bases: list[Traced]) -> Traced:
        """A DDP or HSDP rank from the one traced with other replicas (``same_replica_rank``); an FSDP2 rank from
        the same rank at other world sizes (NOTE [FSDP ranks across world sizes]), or, where that cannot be
        exact after all, traced."""
        if replicas_of(spec) is not None:
            done = bases[0]
            assert done.graph is not None  # a base keeps its graph
            return Traced(spec, None, 0.0, self.rows(spec, same_replica_rank(spec, done.spec, done.graph), 0.0))
        assert isinstance(spec, FSDP)
        sizes = self._families[family(spec)]
        for done in bases:
            assert done.graph is not None and isinstance(done.spec, FSDP)
            sizes.add(done.spec, done.graph)
        graph = sizes.derive(spec)
        return self._traced(spec, keep=False) if graph is None else Traced(spec, None, 0.0,
                                                                           self.rows(spec, graph, 0.0))

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


def replicas_of(spec: Parallel) -> Parallel | None:
    """What ranks that differ only in how many replicas there are share: a DDP spec, or an HSDP rank 0 with its
    shard group; None for other specs."""
    if isinstance(spec, DDP):
        return replace(spec, world_size=1)
    if spec.replicate > 1 and spec.rank == 0:
        return replace(spec, world_size=spec.world_size // spec.replicate, replicate=1)
    return None


def made_from(spec: Parallel, traced: Parallel | None) -> bool:
    """Whether ``spec``'s rank is made from ``traced``'s rather than traced (``same_replica_rank``)."""
    if traced is None or spec == traced or replicas_of(spec) is None or replicas_of(spec) != replicas_of(traced):
        return False
    return not isinstance(traced, DDP) or traced.world_size >= 2


def same_replica_rank(spec: Parallel, traced: Parallel, graph: Graph) -> Graph:
    """A rank's step with more or fewer replicas, from one traced with two or more. Every DDP rank holds and runs
    the same (whole replicas, the same buckets; the gradients' division by the world size is one op whatever its
    value; DDP over one rank still all-reduces, in a group of one), and so does rank 0 of HSDP over any number of
    replicas of one shard group (its gradients' all-reduce across the replicas aside): only the group of the
    collectives across replicas differs. Checked in tests/fitting/test_ranks.py and test_fsdp_ranks.py."""
    if isinstance(spec, DDP):
        assert isinstance(traced, DDP)
        ops = tuple(replace(op, ranks=spec.world_size) if op.ranks == traced.world_size else op for op in graph.ops)
    else:
        assert isinstance(spec, FSDP) and isinstance(traced, FSDP)
        stride = traced.world_size // traced.replicate  # the replicate group's ranks are a shard group apart
        ops = tuple(replace(op, ranks=spec.replicate) if op.ranks == traced.replicate and op.rank_stride == stride
                    else op for op in graph.ops)
    notes = tuple(describe(spec) if note == describe(traced) else note for note in graph.notes)
    return replace(graph, ops=ops, notes=notes)
