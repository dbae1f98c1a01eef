"""What the exact planner may choose for each saved tensor: the menu its MILP picks from.

Per candidate (``_candidates``): keep it; offload it (its copy out starts after its last
forward use; its device memory is let go before one of a few release ops, which wait for the
copy; it is prefetched at one of a few backward ops); or recompute it. A recomputation
re-runs the forward ops that remake it, and, to a depth, the ops that remake its inputs as
well, so that those inputs need not stay; what it reads at the end of that chain must stay
on the device. Groups that restore several tensors by one replay (the segments of
``checkpoint-segments``) are options too, and so are the release and prefetch ops of plans
the caller passes as seeds: every such plan is then one of the MILP's choices.

Only the ops where the keep-all curve is over the budget ("binding") matter: an option that
takes nothing away at one of them only costs time and is left out, and of two release ops
with no binding op between them only the later is kept (as much memory where it matters,
less waiting for the copy). Neither cut loses a faster plan.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from dataclasses import dataclass, replace

import numpy as np

from udnn_lab.cost.model import CostModel
from udnn_lab.errors import PlanError
from udnn_lab.graph.plan_ir import (
    Plan,
    Recompute,
    check_recompute,
    gathered_at,
    kept_by_the_step,
    replay_reads,
    written_after,
)
from udnn_lab.graph.reruns import module_reruns
from udnn_lab.graph.step_graph import Graph
from udnn_lab.planning._candidates import Candidate, candidates, first_backward_op, prefetch_point, writers
from udnn_lab.simulation.simulator import counted_replay_peak_bytes, held_sources
from udnn_lab.units import cuda_block_bytes

RELEASE_DELAYS = (0.0, 1.0, 2.0, 4.0)  # release ops: where the copy out would end after this many copy times
PREFETCH_LAYERS = (0, 1, 2, 3, 5, 8)  # prefetch ops: this many backward layers ahead of the first use
CHAIN_DEPTHS = (0, 1, 2, 3)  # saved inputs a recomputation may remake too, levels back
MAX_CHAIN_OPS = 64  # a longer chain is not an option (segment groups cover long replays)


@dataclass(frozen=True)
class OffloadOption:
    candidate: Candidate
    size: int  # bytes as the budget counts them
    d2h_s: float
    h2d_s: float
    releases: tuple[int, ...]  # ops its device memory may be let go before (they wait for the copy out)
    prefetches: tuple[int, ...]  # ops its copy in may be issued at
    readers: tuple[int, ...]  # per prefetch op: the first op at or after it that reads the tensor


@dataclass(frozen=True)
class RecomputeOption:
    action: Recompute
    sizes: tuple[int, ...]  # per restored tensor, bytes as the budget counts them
    windows: tuple[tuple[int, int], ...]  # per restored tensor, the ops [first, last) it is off the device
    time_s: float  # the replayed ops' compute time
    keeps: tuple[int, ...]  # candidates the replay reads: they must stay on the device
    # what the replay holds at once beyond the tensors it restores and its op's own allocations, counted at that op
    # as the simulator counts it (NOTE [simulated streams] 8)
    made_beyond: int = 0
    # per source forward lets go that the runtime holds for the replay: (tensor, bytes, first, last), the ops
    # [first, last) it is on the device beyond the keep-all curve, through the replay's op (NOTE [simulated
    # streams] 1)
    held: tuple[tuple[int, int, int, int], ...] = ()


@dataclass(frozen=True)
class Choice:
    """Options of a menu: (offload option, release op, prefetch op) and recompute options."""

    offloads: tuple[tuple[int, int, int], ...]
    recomputes: tuple[int, ...]


@dataclass(frozen=True)
class Menu:
    offloads: tuple[OffloadOption, ...]
    recomputes: tuple[RecomputeOption, ...]


def menu(graph: Graph, cost: CostModel, starts_s: np.ndarray, binding: np.ndarray,
         seeds: Iterable[tuple[Plan, dict[int, int]]]) -> Menu:
    """The options for every candidate. ``starts_s``: each op's start with every tensor kept; ``binding``: the
    ops where the keep-all curve is over the budget (only there does taking a tensor away help); ``seeds``:
    plans, each with the op before which its simulation let each offloaded tensor go."""
    boundary = first_backward_op(graph)
    pool = [c for c in candidates(graph) if c.last_forward < boundary]
    extra_releases: dict[int, set[int]] = {}
    extra_prefetches: dict[int, set[int]] = {}
    groups: list[Recompute] = []
    for plan, released in seeds:
        for offload in plan.offloads:
            if offload.tensor in released and released[offload.tensor] < offload.prefetch_at:
                extra_releases.setdefault(offload.tensor, set()).add(released[offload.tensor])
                extra_prefetches.setdefault(offload.tensor, set()).add(offload.prefetch_at)
        groups += [r for r in plan.recomputes if len(r.tensors) > 1]
    over = np.concatenate([[0], np.cumsum(binding)])  # binding ops before each op

    def helps(first: int, last: int) -> bool:
        return last > first and over[last] > over[first]

    offloads = [o for c in pool if (o := _offload(graph, cost, c, starts_s, helps, extra_releases.get(c.tensor, set()),
                                                  extra_prefetches.get(c.tensor, set()))) is not None]
    by_tensor = {c.tensor: c for c in pool}
    times = cost.op_times_s(graph)
    chains = [option for c in pool for option in chain_options(graph, c, by_tensor, times)]
    grouped = [option for g in groups if (option := _group(graph, g, by_tensor, times)) is not None]
    recomputes = [r for r in _unique(chains + grouped) if any(helps(first, last) for first, last in r.windows)]
    return Menu(tuple(offloads), tuple(_holding(graph, r) for r in recomputes))


def _holding(graph: Graph, option: RecomputeOption) -> RecomputeOption:
    """``option`` with the sources the runtime holds for it (only the program counts them: auto's own options,
    many more, are simulated)."""
    held = tuple((t, size(graph, t), freed + 1, until + 1)
                 for t, (freed, until) in held_sources(graph, (option.action,)).items())
    return replace(option, held=held) if held else option


def choice_of(graph: Graph, options: Menu, plan: Plan, released: dict[int, int], binding: np.ndarray) -> Choice | None:
    """A plan as a choice of the menu, or None if it does something the menu cannot.

    Actions the menu left out because they free nothing where the budget binds are left out,
    and a release op the menu passed over becomes the next one it has (as much memory where
    it binds, no more waiting): the choice is no slower than the plan, and fits as it does."""
    offloads = []
    by_tensor = {o.candidate.tensor: i for i, o in enumerate(options.offloads)}
    for offload in plan.offloads:
        i, release = by_tensor.get(offload.tensor), released.get(offload.tensor)
        if release is None:
            continue  # its copy never let it go: it stayed
        later = [] if i is None else [r for r in options.offloads[i].releases if r >= release]
        if i is not None and later and offload.prefetch_at in options.offloads[i].prefetches:
            offloads.append((i, later[0], offload.prefetch_at))
        elif binding[release:offload.prefetch_at].any():
            return None
    by_action = {r.action: j for j, r in enumerate(options.recomputes)}
    pool = {c.tensor: c for c in candidates(graph)}
    for action in plan.recomputes:
        if action not in by_action and any(binding[pool[t].freed_after + 1:action.at_op - 1].any()
                                           for t in action.tensors if t in pool):
            return None
    return Choice(tuple(offloads), tuple(by_action[r] for r in plan.recomputes if r in by_action))


def size(graph: Graph, tensor: int) -> int:
    nbytes = graph.tensors[tensor].nbytes
    return cuda_block_bytes(nbytes) if graph.device == "cuda" else nbytes


def _offload(graph: Graph, cost: CostModel, c: Candidate, starts_s: np.ndarray, helps, releases: set[int],
             prefetches: set[int]) -> OffloadOption | None:
    d2h, h2d = cost.transfer_time_s(c.nbytes, "d2h"), cost.transfer_time_s(c.nbytes, "h2d")
    releases, prefetches = set(releases), set(prefetches)
    first_release = c.freed_after + 1
    copy_starts = starts_s[min(c.last_forward + 1, len(starts_s) - 1)]
    for delay in RELEASE_DELAYS:  # the first op that starts once the copy would be done, queue aside
        releases.add(max(first_release, int(np.searchsorted(starts_s, copy_starts + delay * d2h, side="left"))))
    prefetches |= {prefetch_point(graph, c.first_backward, layers) for layers in PREFETCH_LAYERS}
    # every release before every prefetch, so that a choice of each is a window [release, prefetch)
    prefetches = {p for p in prefetches if first_release < p < c.first_backward and helps(first_release, p)}
    if not prefetches:
        return None
    ordered = sorted(r for r in releases if first_release <= r < min(prefetches))
    # a release op with nowhere the budget binds before the next one is no better than that one (later: less wait)
    ends = [*ordered[1:], max(prefetches)]
    kept = tuple(r for r, end in zip(ordered, ends) if helps(r, end))
    if not kept:
        return None
    consumers = graph.tensors[c.tensor].consumers
    chosen = sorted(prefetches)
    readers = tuple(consumers[k] if (k := bisect.bisect_left(consumers, p)) < len(consumers) else len(graph.ops) - 1
                    for p in chosen)
    return OffloadOption(c, size(graph, c.tensor), d2h, h2d, kept, tuple(chosen), readers)


def chain_options(graph: Graph, c: Candidate, pool: dict[int, Candidate], times: np.ndarray,
                  depths: tuple[int, ...] = CHAIN_DEPTHS) -> list[RecomputeOption]:
    """Recompute ``c`` remaking its saved inputs up to each of ``depths``; inputs freed before the replay are always
    remade."""
    found = []
    for depth in depths:
        ops = _chain_ops(graph, c, pool, depth)
        if ops is None:
            continue
        option = _option(graph, Recompute((c.tensor,), ops, c.first_backward), pool, times)
        if option is not None:
            found.append(option)
    return found


def _chain_ops(graph: Graph, c: Candidate, pool: dict[int, Candidate], depth: int) -> tuple[int, ...] | None:
    ops = set(writers(graph, c.tensor))
    level, frontier = 0, _inputs(graph, ops)
    while frontier:
        remake = [t for t in frontier if not _there(graph, t, ops, c.first_backward) or (t in pool and level < depth)]
        if not remake:
            break
        for t in remake:
            producer = graph.tensors[t].producer
            if producer is None or graph.ops[producer].phase != "forward" or graph.tensors[t].category == "parameter":
                return None  # not made by forward, or an FSDP2 gather's: nothing to replay
            ops.update(writers(graph, t))
        if len(ops) > MAX_CHAIN_OPS:
            return None
        level += 1
        frontier = _inputs(graph, ops)
    return tuple(sorted(ops))


def _inputs(graph: Graph, ops: set[int]) -> set[int]:
    return {t for t in replay_reads(graph, ops) if not kept_by_the_step(graph.tensors[t])}


def _there(graph: Graph, tensor: int, ops: set[int], at_op: int) -> bool:
    """Still on the device, unchanged, when a replay at ``at_op`` reads it."""
    t = graph.tensors[tensor]
    if t.category == "parameter":
        if not gathered_at(graph, tensor, at_op):
            return False
    elif t.free_step is not None and t.free_step < at_op:
        return False
    return written_after(graph, tensor, min(i for i in ops if tensor in graph.ops[i].inputs)) is None


def _group(graph: Graph, recompute: Recompute, pool: dict[int, Candidate], times: np.ndarray) -> RecomputeOption | None:
    if not all(t in pool for t in recompute.tensors):
        return None
    return _option(graph, recompute, pool, times)


def _option(graph: Graph, action: Recompute, pool: dict[int, Candidate], times: np.ndarray) -> RecomputeOption | None:
    try:
        check_recompute(graph, action, set(action.tensors))
    except PlanError:
        return None
    # the restored tensors count from the op before the one the replay runs at (NOTE [simulated streams] 1)
    windows = tuple((pool[t].freed_after + 1, action.at_op - 1) for t in action.tensors)
    if all(last <= first for first, last in windows):
        return None
    keeps = tuple(sorted(t for t in replay_reads(graph, action.ops) if t in pool))
    sizes = tuple(size(graph, t) for t in action.tensors)
    own = sum(size(graph, t) for t in graph.ops[action.at_op].allocated if graph.on_device(graph.tensors[t]))
    rerun = module_reruns(graph, (action,)) != ()  # where it can re-run a module call, as a plan on hooks does
    made = counted_replay_peak_bytes(graph, action, rerun)
    return RecomputeOption(action, sizes, windows, float(sum(times[i] for i in action.ops)), keeps,
                           max(0, made - sum(sizes) - own))


def _unique(options: list[RecomputeOption]) -> list[RecomputeOption]:
    seen: dict[Recompute, RecomputeOption] = {}
    for option in options:
        seen.setdefault(option.action, option)
    return list(seen.values())
