"""A quick memory estimate for planners: the keep-all curve with dropped tensors' windows taken out.

It ignores copy times (a dropped tensor counts as gone from the op after its drop point
until its restore point), so it is optimistic; planners choose with it and check with the
simulator, asking for a margin when the simulator disagrees.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import numpy as np

from udnn_lab.graph.liveness import live_bytes
from udnn_lab.graph.step_graph import Graph
from udnn_lab.planning._candidates import Candidate
from udnn_lab.units import cuda_block_bytes

Window = Callable[[Candidate], tuple[int, int]]  # ops [first, last) a candidate is away from the device


class CurveEstimate:
    def __init__(self, graph: Graph) -> None:
        live = live_bytes(graph)  # the memory curve's totals, without building its DataFrame
        self.cuda = graph.device == "cuda"
        self.live = (live.cuda_total if self.cuda else live.total).astype(np.float64)

    def size(self, candidate: Candidate) -> int:
        return cuda_block_bytes(candidate.nbytes) if self.cuda else candidate.nbytes

    def drop(self, candidate: Candidate, window: tuple[int, int]) -> None:
        first, last = window
        if last > first:
            self.live[first:last] -= self.size(candidate)

    def hold(self, op: int, nbytes: int) -> None:
        """``nbytes`` more (or fewer) while op ``op`` runs."""
        if op < len(self.live):
            self.live[op] += nbytes

    def peak(self, aside: list[int] | None = None) -> tuple[float, int]:
        """The highest estimate and its op, of the ops not set ``aside``."""
        live = self.live
        if aside:
            live = live.copy()
            live[aside] = -np.inf
        op = int(live.argmax()) if len(live) else 0
        return (float(live[op]) if len(live) else 0.0), op


def choose_until_fits(graph: Graph, pool: Iterable[Candidate], target: float, window: Window,
                      score: Callable[[Candidate], float]) -> list[Candidate]:
    """Greedy: while the estimated peak is over ``target``, drop the best-scoring candidate away at the peak op."""
    estimate = CurveEstimate(graph)
    remaining = sorted(pool, key=lambda c: (-score(c), c.tensor))
    windows = {c.tensor: window(c) for c in remaining}
    chosen: list[Candidate] = []
    peak, op = estimate.peak()
    while peak > target and remaining:
        found = next((i for i, c in enumerate(remaining) if windows[c.tensor][0] <= op < windows[c.tensor][1]), None)
        if found is None:
            break  # nothing left that is away at the peak: this target cannot be met this way
        pick = remaining.pop(found)
        chosen.append(pick)
        estimate.drop(pick, windows[pick.tensor])
        peak, op = estimate.peak()
    return chosen
