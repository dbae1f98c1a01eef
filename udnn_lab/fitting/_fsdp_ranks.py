"""An FSDP2 rank at one world size from the same rank traced at others, as a sweep over world sizes makes them.

NOTE [FSDP ranks across world sizes]
  1. FSDP2 shards every parameter on dim 0. Of a parameter of d rows, rank 0 of N ranks holds ceil(d / N) rows
     (the most any rank holds), and the collectives move it padded to N * ceil(d / N) rows. Every size in rank
     0's step that changes with N (a tensor's bytes and shape; an op's output shapes and bytes read and written)
     is a sum of those two counts, each times the size of the parameter's other dims, and of a part that does
     not change (activations, a parameter once gathered whole). So each is linear in
     v(N) = (1, ceil(d/N) and N * ceil(d/N) for each distinct d).
  2. Where v(N) = sum_i w_i v(M_i) over world sizes M_i already traced, every such size at N is sum_i w_i of the
     same size at each M_i: exact, with no fitting, whenever rank 0 runs the same ops on the same tensors at N
     as at each M_i, only their sizes differing. That is checked between the M_i (a step whose ops differ
     between them is traced) and assumed for N: FSDP2 takes one path for every world size of two or more (its
     gradient pre-divide factor, a power of two, is the exception, and it differs between traced sizes too).
     tests/fitting/test_fsdp_ranks.py holds derived ranks against their own traces, on the corpus too.
  3. A collective's group of M_i ranks becomes one of N, and so does a size that is M_i at each M_i (FSDP2 views
     a gathered buffer as one row per rank). Only M_i below N are used: a size of N * ceil(d / N) rows that is
     M_i at each M_i has d <= M_i, so it is N at N too. Any other derived size that is not a whole number of 0 or more
     means the step is not linear in v(N) after all: that rank is traced.
  4. World sizes are taken from the smallest up: a size whose v(N) the traced ones span is derived, any other
     is traced and joins them. A model whose dims split evenly over every size asked for needs two traces
     (v(N) is then 1, d / N and d); each further size that leaves some dim uneven adds one or two. Only
     rank 0 of a plain FSDP2 world (no HSDP replicas, a bool ``reshard_after_forward``) is derived; world
     size 1 is always traced.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import replace
from fractions import Fraction

import torch

from udnn_lab.analysis.recording import HOST_NOTE_START, with_host_note
from udnn_lab.graph import Graph
from udnn_lab.parallel import FSDP, Parallel, describe


def derivable(spec: Parallel) -> bool:
    """Whether ``spec``'s rank can be made from the same rank at other world sizes (NOTE [FSDP ranks ...] 4)."""
    return isinstance(spec, FSDP) and spec.world_size >= 2 and spec.rank == 0 and spec.replicate == 1 \
        and isinstance(spec.reshard_after_forward, bool)


def family(spec: Parallel) -> Parallel:
    """What ranks of one family share: every setting but the world size."""
    return replace(spec, world_size=1)


def sharded_rows(model: torch.nn.Module) -> tuple[int, ...] | None:
    """The distinct dim-0 sizes of the parameters FSDP2 shards (all of them); None if one has no dim 0."""
    rows = [param.shape[0] if param.dim() else None for param in model.parameters()]
    return None if None in rows else tuple(sorted(set(rows)))  # type: ignore[arg-type]


def basis(rows: Sequence[int], world_size: int) -> tuple[int, ...]:
    """v(N) of NOTE [FSDP ranks across world sizes] 1."""
    per_rank = [-(-d // world_size) for d in rows]
    return (1, *per_rank, *(world_size * n for n in per_rank))


def weights(target: int, traced: Sequence[int], rows: Sequence[int]) -> dict[int, Fraction] | None:
    """w with v(target) = sum w[M] v(M) over the ``traced`` world sizes, or None where they do not span it."""
    if len(traced) < 2:
        return None
    columns = [[Fraction(x) for x in basis(rows, size)] for size in traced]
    goal = [Fraction(x) for x in basis(rows, target)]
    # solve sum_j w_j columns[j] = goal by Gauss-Jordan elimination over the rationals
    matrix = [[columns[j][i] for j in range(len(traced))] + [goal[i]] for i in range(len(goal))]
    pivots: list[int] = []
    row = 0
    for col in range(len(traced)):
        found = next((r for r in range(row, len(matrix)) if matrix[r][col] != 0), None)
        if found is None:
            continue
        matrix[row], matrix[found] = matrix[found], matrix[row]
        lead = matrix[row][col]
        matrix[row] = [x / lead for x in matrix[row]]
        for r in range(len(matrix)):
            if r != row and matrix[r][col] != 0:
                factor = matrix[r][col]
                matrix[r] = [x - factor * y for x, y in zip(matrix[r], matrix[row], strict=True)]
        pivots.append(col)
        row += 1
    if any(all(x == 0 for x in line[:-1]) and line[-1] != 0 for line in matrix):
        return None  # inconsistent: v(target) is not in the span
    found_weights = {size: Fraction(0) for size in traced}
    for r, col in enumerate(pivots):
        found_weights[traced[col]] = matrix[r][-1]
    return {size: w for size, w in found_weights.items() if w != 0}


def plan_traces(sizes: Iterable[int], rows: Sequence[int] | None) -> tuple[list[int], list[int]]:
    """The world sizes of one family to trace and those to derive from them (NOTE [FSDP ranks ...] 4)."""
    traced: list[int] = []
    derived: list[int] = []
    for size in sorted(set(sizes)):
        if size >= 2 and rows is not None and weights(size, [s for s in traced if s >= 2], rows) is not None:
            derived.append(size)
        else:
            traced.append(size)
    return traced, derived


class TracedSizes:
    """Rank 0 of one FSDP2 family (``family``) as traced at some world sizes, and the ranks made from them."""

    def __init__(self, rows: Sequence[int]) -> None:
        self.rows = rows
        self.graphs: dict[int, Graph] = {}
        self._parts: dict[int, tuple[tuple, tuple[int, ...]]] = {}

    def __reduce__(self):  # what one process made is not sent to another (NOTE [sweep processes] 6)
        return TracedSizes, (self.rows,)

    def add(self, spec: FSDP, graph: Graph) -> None:
        if spec.world_size >= 2:
            self.graphs[spec.world_size] = graph

    def derive(self, spec: FSDP) -> Graph | None:
        """Rank 0 of ``spec`` (NOTE [FSDP ranks across world sizes]); None where it cannot be made exactly."""
        below = [size for size in self.graphs if size < spec.world_size]  # NOTE [FSDP ranks across world sizes] 3
        found = weights(spec.world_size, below, self.rows)
        if found is None or len(found) < 2:
            return None
        parts = [self._parts_of(spec, size) for size in found]
        if any(skeleton != parts[0][0] for skeleton, _ in parts[1:]):
            return None  # the traced sizes' ops differ (NOTE [FSDP ranks across world sizes] 2)
        sizes, world, factors = [], tuple(found), tuple(found.values())
        for column in zip(*(numbers for _, numbers in parts), strict=True):
            if column == world:  # the world size itself (a gathered buffer viewed as one row per rank)
                sizes.append(spec.world_size)
            elif all(n == column[0] for n in column):  # the weights add up to 1 (v's first component)
                sizes.append(column[0])
            else:
                value = sum((w * n for w, n in zip(factors, column, strict=True)), Fraction(0))
                if value.denominator != 1 or value < 0:
                    return None  # NOTE [FSDP ranks across world sizes] 3
                sizes.append(int(value))
        return _rebuilt(self.graphs[world[0]], world[0], spec, iter(sizes))

    def _parts_of(self, spec: FSDP, size: int) -> tuple[tuple, tuple[int, ...]]:
        if size not in self._parts:
            self._parts[size] = _parts(self.graphs[size], size, describe(replace(spec, world_size=size)))
        return self._parts[size]


def _parts(graph: Graph, world_size: int, own_note: str) -> tuple[tuple, tuple[int, ...]]:
    """The step with every size that may change with the world size taken out, and those sizes in order."""
    numbers: list[int] = []
    tensors = []
    for tensor in graph.tensors:
        numbers.append(tensor.nbytes)
        numbers.extend(tensor.shape)
        tensors.append(replace(tensor, nbytes=0, shape=(0,) * len(tensor.shape)))
    ops = []
    for op in graph.ops:
        numbers += [op.flops, op.bytes_read, op.bytes_written]
        for shape in op.output_shapes:
            numbers.extend(shape)
        ops.append(replace(op, flops=0, bytes_read=0, bytes_written=0, ranks=-1 if op.ranks == world_size else op.ranks,
                           output_shapes=tuple((0,) * len(shape) for shape in op.output_shapes),
                           released=tuple(sorted(op.released))))  # in the order their last references went
    events = []
    for event in graph.hook_events:
        numbers.extend(event.shape)
        events.append(replace(event, shape=(0,) * len(event.shape)))
    notes = tuple(note for note in graph.notes if note != own_note and not note.startswith(HOST_NOTE_START))
    skeleton = (tuple(tensors), tuple(ops), tuple(events), graph.module_calls, notes, graph.device, graph.fake)
    return skeleton, tuple(numbers)


def _rebuilt(graph: Graph, world_size: int, spec: FSDP, sizes) -> Graph:
    """``graph`` (traced at ``world_size``) with the sizes of ``spec``'s world, in ``_parts``'s order."""

    def shape(dims: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(next(sizes) for _ in dims)

    tensors = []
    for tensor in graph.tensors:
        nbytes = next(sizes)
        tensors.append(replace(tensor, nbytes=nbytes, shape=shape(tensor.shape)))
    ops = []
    for op in graph.ops:
        flops, read, written = next(sizes), next(sizes), next(sizes)
        ops.append(replace(op, flops=flops, bytes_read=read, bytes_written=written,
                           ranks=spec.world_size if op.ranks == world_size else op.ranks,
                           output_shapes=tuple(shape(s) for s in op.output_shapes)))
    events = tuple(replace(event, shape=shape(event.shape)) for event in graph.hook_events)
    traced_as = describe(replace(spec, world_size=world_size))
    notes = tuple(describe(spec) if note == traced_as else note for note in graph.notes
                  if not note.startswith(HOST_NOTE_START))
    derived = replace(graph, ops=tuple(ops), tensors=tuple(tensors), hook_events=events, notes=notes)
    hosted = any(note.startswith(HOST_NOTE_START) for note in graph.notes)
    return with_host_note(derived) if hosted else derived  # its figures are the derived rank's
