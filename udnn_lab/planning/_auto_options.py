"""What auto may do with each saved tensor: offload it (with the ops its copies free and need it) or recompute it.

An offload is away from when its copy out would be done until a prefetch early enough for its
copy in to be hidden (``HIDE`` copy times before its first reader, at most ``LOOKAHEAD``
backward layers ahead); a second option prefetches it just before its use, to cover a peak
that comes later (only once the tensor is offloaded). A recompute re-runs its producer and the
in-place ops that follow it; ``Chains`` lists, on demand, the longer recomputations that remake
the saved tensors they read as well (the exact planner's chains).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from udnn_lab.cost.model import CostModel
from udnn_lab.graph.step_graph import Graph
from udnn_lab.planning._candidates import Candidate, candidates, first_backward_op, prefetch_point
from udnn_lab.planning._exact_options import CHAIN_DEPTHS, chain_options
from udnn_lab.planning._rebuild import rebuilds
from udnn_lab.planning.vdnn import SIZE_FLOOR

LOOKAHEAD = 2
DEEPER = (0, 1, 2, 3, 4, 6, 8, 12)  # chain depths the thorough greedy lengthens replays to
HIDE = 2.0  # a prefetch is issued this many copy times before its first reader: hidden even behind another copy


@dataclass(frozen=True)
class Option:
    candidate: Candidate
    action: str  # 'offload' or 'recompute'
    window: tuple[int, int]  # ops it is away from the device
    cost_s: float  # recompute: the ops' time; offload: both copies' time (hidden, or not, by choose)
    d2h_s: float = 0.0
    h2d_s: float = 0.0
    exposed_s: float = 0.0  # offload: copy-in time its first reader waits for, even with the stream free
    reader: int = 0  # offload: the first op after forward that reads it (it waits for the copy in)
    release: int | None = None  # offload: the op it is let go before, waiting for its copy (None: as that ends)
    late: bool = False  # offload: prefetched just before its use, only to move an offload's prefetch later
    ops: tuple[int, ...] = ()  # forward ops a recompute re-runs
    sources: tuple[int, ...] = ()  # tensors a recompute needs kept
    made: int = 0  # recompute: what its replay holds at once beyond what it restores, at the op it runs before


def auto_options(graph: Graph, cost: CostModel) -> list[Option]:
    key = ("auto options", id(graph), graph.fingerprint)  # auto plans several times per call: listed once
    if key not in cost.memo:
        cost.memo[key] = _listed_options(graph, cost)
    return list(cost.memo[key])


def _listed_options(graph: Graph, cost: CostModel) -> tuple[Option, ...]:
    found = []
    starts = np.concatenate([[0.0], np.cumsum(cost.op_times_s(graph))])  # each op's start with nothing delaying it
    for c in candidates(graph, SIZE_FLOOR):
        if c.last_forward >= first_backward_op(graph):
            continue
        d2h, h2d = cost.transfer_time_s(c.nbytes, "d2h"), cost.transfer_time_s(c.nbytes, "h2d")
        # away from when its copy out is done until the op that leaves its copy in time to be done
        gone = max(c.freed_after + 1, int(np.searchsorted(starts, starts[c.last_forward + 1] + d2h)))
        ahead = int(np.searchsorted(starts, starts[c.first_backward] - HIDE * h2d, side="right")) - 1
        reader = _first_reader(graph, c)
        # in time to be hidden; and, to cover a peak just before the tensor is needed, as late as it can be
        early = min(prefetch_point(graph, c.first_backward, LOOKAHEAD), ahead)
        for prefetch in sorted({early, c.first_backward - 1}):
            if prefetch > gone:
                exposed = max(0.0, h2d - float(starts[reader] - starts[prefetch]))
                found.append(Option(c, "offload", (gone, prefetch), d2h + h2d, d2h, h2d, exposed_s=exposed,
                                     reader=reader, late=prefetch != early))
    for r in rebuilds(graph, cost, SIZE_FLOOR):
        # back on the device from the op before its replay (NOTE [simulated streams] 1)
        window = (r.window[0], r.candidate.first_backward - 1)
        found.append(Option(r.candidate, "recompute", window, r.time_s, ops=r.ops, sources=r.sources))
    return tuple(found)


class Chains:
    """A tensor's recomputations that also remake the saved tensors they read, a few levels back (the exact
    planner's chains), so that those need not stay; listed only for the tensors asked about (slow on deep graphs)."""

    def __init__(self, graph: Graph, cost: CostModel, depths: tuple[int, ...] = CHAIN_DEPTHS) -> None:
        boundary = first_backward_op(graph)
        self.depths = depths
        self.graph, self.times = graph, cost.op_times_s(graph)
        self.pool = {c.tensor: c for c in candidates(graph, SIZE_FLOOR) if c.last_forward < boundary}
        self.found: dict[int, list[Option]] = {}

    def __call__(self, tensor: int) -> list[Option]:
        if tensor not in self.found:
            c = self.pool[tensor]
            window = (c.freed_after + 1, c.first_backward - 1)
            self.found[tensor] = sorted((Option(c, "recompute", window, chain.time_s, ops=chain.action.ops,
                                                 sources=chain.keeps, made=chain.made_beyond)
                                         for chain in chain_options(self.graph, c, self.pool, self.times, self.depths)),
                                        key=lambda o: o.cost_s)
        return self.found[tensor]


def _first_reader(graph: Graph, c: Candidate) -> int:
    """The first op after forward that reads the tensor (it waits for a prefetch)."""
    return next((i for i in graph.tensors[c.tensor].consumers if i >= c.first_backward), c.first_backward)
