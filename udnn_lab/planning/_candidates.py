"""What every policy looks at: the saved tensors a plan may act on, and where layers start.

A candidate is a feature map, or autocast's low-precision copy of a weight, on the graph's
device: produced in forward, saved by autograd, read again in backward, and let go by the
forward pass before backward (NOTE [forward holders]). Parameters, buffers, the input batch
and what the training loop holds through backward (the output, the loss) are never
candidates: moving them frees nothing.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from udnn_lab.graph.cached import per_graph
from udnn_lab.graph.step_graph import Graph
from udnn_lab.vocabulary import PLANNED_CATEGORIES


@dataclass(frozen=True)
class Candidate:
    tensor: int
    nbytes: int
    producer: int
    last_forward: int  # last forward op that reads it (or its producer)
    freed_after: int  # the op after which forward lets it go if autograd does not hold it (>= last_forward)
    first_backward: int  # first backward op that needs it: autograd unpacks it when a node that saved it starts
    conv_input: bool  # a convolution reads it in forward (vDNN's conv layers)


def candidates(graph: Graph, size_floor: int = 0) -> list[Candidate]:
    """Saved feature maps of at least ``size_floor`` bytes, in the order forward produces them."""
    return [c for c in _all_candidates(graph) if c.nbytes >= size_floor]


@per_graph
def _all_candidates(graph: Graph) -> tuple[Candidate, ...]:
    found = []
    for t in graph.tensors:
        if t.category not in PLANNED_CATEGORIES or not graph.on_device(t) or t.producer is None \
                or t.first_backward_use is None or t.held_past_forward:
            continue
        conv = any(graph.ops[i].name == "aten.convolution.default" for i in t.consumers
                   if graph.ops[i].phase == "forward")
        last = t.last_forward_use if t.last_forward_use is not None else t.producer
        starts = _node_starts(graph)
        unpacked = min((starts[op] for op in t.saved_by if op in starts), default=t.first_backward_use)
        unpacked = max(unpacked, _first_unpacks(graph).get(t.id, unpacked))
        freed = max(last, t.forward_release) if t.forward_release is not None else last
        found.append(Candidate(t.id, t.nbytes, t.producer, last, freed, min(unpacked, t.first_backward_use), conv))
    return tuple(sorted(found, key=lambda c: (c.producer, c.tensor)))


@per_graph
def _node_starts(graph: Graph) -> dict[int, int]:
    """Forward op -> the first backward op its autograd node runs: the node unpacks everything it saved
    before that op (an addmm's node runs t and mm before the op that reads the saved input)."""
    starts: dict[int, int] = {}
    for op in graph.ops:
        if op.phase == "backward" and op.forward_op is not None:
            starts.setdefault(op.forward_op, op.index)
    return starts


@per_graph
def _first_unpacks(graph: Graph) -> dict[int, int]:
    """Tensor id -> the boundary where backward first takes it back (its first unpack hook call). Where hooks
    registered on a node's gradient run ops first (FSDP2's pre-backward all-gather), the node's first op comes
    before it, and a tensor restored at that op would be restored before any hook point."""
    found: dict[int, int] = {}
    for event in graph.hook_events:
        if event.kind == "unpack":
            found.setdefault(event.tensor, event.boundary)
    return found


@per_graph
def backward_layer_starts(graph: Graph) -> tuple[int, ...]:
    """First op of each backward layer: a run of consecutive backward ops of one module."""
    starts = []
    previous = None
    for op in graph.ops:
        if op.phase != "backward":
            continue
        if previous is None or op.module != previous.module or op.index != previous.index + 1:
            starts.append(op.index)
        previous = op
    return tuple(starts)


def prefetch_point(graph: Graph, first_backward: int, layers_ahead: int) -> int:
    """The op that issues a prefetch ``layers_ahead`` backward layers before the layer of ``first_backward``."""
    starts = backward_layer_starts(graph)
    layer = bisect.bisect_right(starts, first_backward) - 1
    point = starts[max(layer - layers_ahead, 0)] if starts else first_backward - 1
    return min(point, first_backward - 1)


def writers(graph: Graph, tensor: int) -> tuple[int, ...]:
    """Its producer and the forward ops that return its storage again: in-place writes (ReLU(inplace), +=)
    and views. Rebuilding the tensor means re-running them all."""
    t = graph.tensors[tensor]
    assert t.producer is not None  # callers pass candidates, which forward produces
    later = [i for i in t.consumers if graph.ops[i].phase == "forward" and tensor in graph.ops[i].outputs]
    return (t.producer, *sorted(i for i in later if i > t.producer))


def next_forward_op(graph: Graph, op: int) -> int | None:
    """The forward op after ``op`` (vDNN makes it wait for the offload of ``op``'s layer)."""
    following = op + 1
    if following < len(graph.ops) and graph.ops[following].phase == "forward":
        return following
    return None


@per_graph
def first_backward_op(graph: Graph) -> int:
    return next((op.index for op in graph.ops if op.phase == "backward"), len(graph.ops))
