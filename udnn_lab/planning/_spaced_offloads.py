"""Offloads whose copies out run one after another in forward, for auto to complete with recomputes.

A joint greedy chooses at the peak, one tensor at a time, and prices a copy by the queue it
joins there; on a step whose peak is at the start of backward (a CNN at a large batch), what
pays best is often to copy out, early and all through forward, tensors that are dear to re-run,
so that each copy has the stream to itself and ends before backward, and to recompute the cheap
rest. Here: the offload options of the tensors whose cheapest recomputation costs the most per
byte (the dearer half, and those with none), in the order forward makes them, each taken when its
copy out can start as its last forward reader ends, after the copy before it, and end before
backward starts. auto completes prefixes of that list with its greedy and lets the simulator choose.
"""

from __future__ import annotations

import statistics

import numpy as np

from udnn_lab.cost.model import CostModel
from udnn_lab.graph.step_graph import Graph
from udnn_lab.planning._auto_options import Option, auto_options
from udnn_lab.planning._candidates import first_backward_op

SPACED = "spaced offloads"  # the base plan's name: a plan auto completes from it says so
PREFIXES = (2, 4, 6)  # and the whole list: how many of the spaced offloads a completed base starts from


def spaced_offloads(graph: Graph, cost: CostModel) -> list[Option]:
    """The offload options described above, in forward order."""
    options = auto_options(graph, cost)
    per_byte: dict[int, float] = {}
    for option in options:
        if option.action == "recompute":
            tensor = option.candidate.tensor
            per_byte[tensor] = min(per_byte.get(tensor, np.inf), option.cost_s / option.candidate.nbytes)
    if not per_byte:
        return []
    median = statistics.median(per_byte.values())
    times = cost.op_times_s(graph)
    starts = np.concatenate([[0.0], np.cumsum(times)])
    backward = float(starts[first_backward_op(graph)])
    spaced: list[Option] = []
    free = 0.0  # when the stream out is done with the copies taken
    for option in sorted((o for o in options if o.action == "offload" and not o.late),
                         key=lambda o: (o.candidate.producer, o.candidate.tensor)):
        if per_byte.get(option.candidate.tensor, np.inf) <= median:
            continue  # cheap to re-run: left to the greedy
        start = float(starts[option.candidate.last_forward + 1])
        if start >= free and start + option.d2h_s <= backward:
            spaced.append(option)
            free = start + option.d2h_s
    return spaced

