"""auto: choose keep, offload or recompute per saved tensor, jointly, for the fastest step that fits.

For each candidate it prices both ways out of memory: a recompute costs re-running its
producer and the in-place ops that follow it (when their inputs outlive it); offloads
share the copy streams, so they cost nothing while their copies fit in the compute they
overlap, and their whole copy time beyond. An offload is away from when its copy out
would be done until a prefetch early enough for its copy in to be hidden; where a peak
comes later than that, its prefetch moves to just before its use, at the cost of the
wait. Greedily, at the op where the estimated curve peaks, it drops whatever frees bytes
for the least time, until the estimate fits; the simulator checks, and it aims lower if
it must. Then every other policy is planned and simulated as well; the fastest of them
that do not fit are completed by the same greedy (what they still need, on top of their
actions), and the fastest plan that fits wins, so auto is never slower (in simulation)
than any of them. ``optimal`` (the exact reference) measures how far from the best it is.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, replace

import numpy as np

from udnn_lab.cost.model import CostModel
from udnn_lab.graph.plan_ir import Offload, Plan, Recompute
from udnn_lab.graph.step_graph import Graph
from udnn_lab.planning._candidates import Candidate, candidates, first_backward_op, prefetch_point
from udnn_lab.planning._copy_queue import CopyQueue
from udnn_lab.planning._estimate import CurveEstimate
from udnn_lab.planning._exact_options import chain_options
from udnn_lab.planning._rebuild import rebuilds
from udnn_lab.planning.registry import POLICIES, policy
from udnn_lab.planning.vdnn import MARGINS, SIZE_FLOOR, pinned_pool_bytes
from udnn_lab.simulation.simulator import simulate_with

LOOKAHEAD = 2
HIDE = 2.0  # a prefetch is issued this many copy times before its first reader: hidden even behind another copy
_TRIED = 4  # offloads away at the peak compared at each step, largest first: the cheapest per byte is taken
_UNPINS = 24  # at most this many (each scans what is pinned; past that a deep graph gains little)
_UNPINNED = 4  # tensors whose replays' swaps are compared when the greedy is stuck
SECOND_GREEDY_OPS = 4000  # up to this many ops, the greedy is run twice, with copies priced alone as well
COMPLETED = 2  # how many of the fastest plans that do not fit auto completes
_NOT_CONTENDERS = ("auto", "vdnn-dyn", "optimal")  # vdnn-dyn picks among others; optimal is the exact reference


@dataclass(frozen=True)
class _Option:
    candidate: Candidate
    action: str  # 'offload' or 'recompute'
    window: tuple[int, int]  # ops it is away from the device
    cost_s: float  # recompute: the ops' time; offload: both copies' time (hidden, or not, by _choose)
    d2h_s: float = 0.0
    h2d_s: float = 0.0
    exposed_s: float = 0.0  # offload: copy-in time its first reader waits for, even with the stream free
    reader: int = 0  # offload: the first op after forward that reads it (it waits for the copy in)
    release: int | None = None  # offload: the op it is let go before, waiting for its copy (None: as that ends)
    late: bool = False  # offload: prefetched just before its use, only to move an offload's prefetch later
    ops: tuple[int, ...] = ()  # forward ops a recompute re-runs
    sources: tuple[int, ...] = ()  # tensors a recompute needs kept


@policy("auto")
def auto(graph: Graph, cost: CostModel, budget: int | None) -> Plan:
    if budget is None:
        return Plan.keep_all(graph)  # nothing to save: every action only adds time
    contenders = [joint(graph, cost, budget)]
    if len(graph.ops) <= SECOND_GREEDY_OPS:
        contenders.append(joint(graph, cost, budget, queued=False))
    contenders += [POLICIES[name](graph, cost, budget) for name in POLICIES if name not in _NOT_CONTENDERS]
    runs = [(simulate_with(graph, plan, cost), plan) for plan in contenders]
    # the fastest plans that act but do not fit, with what they still need chosen by the same greedy
    over = sorted((sim.step_time_s, i) for i, (sim, plan) in enumerate(runs)
                  if not sim.fits and (plan.offloads or plan.recomputes))
    bases = list({(runs[i][1].offloads, runs[i][1].recomputes): runs[i][1] for _, i in reversed(over)}.values())
    for base in bases[::-1][:COMPLETED]:
        completed = joint(graph, cost, budget, base=base)
        runs.append((simulate_with(graph, completed, cost), completed))
    best = None
    for sim, plan in runs:
        key = (sim.step_time_s, len(plan.offloads) + len(plan.recomputes))
        if sim.fits and (best is None or key < best[0]):
            best = (key, plan)
    chosen = best[1] if best else contenders[0]
    return Plan("auto", chosen.graph_fingerprint, budget, chosen.offloads, chosen.recomputes,
                chosen.pinned_pool_bytes, chosen.size_floor_bytes, chosen.notes + (f"chose {chosen.policy}",))


def joint(graph: Graph, cost: CostModel, budget: int, base: Plan | None = None, queued: bool = True) -> Plan:
    """The joint keep/offload/recompute greedy, checked by simulation; from ``base``'s actions if given.
    ``queued``: price each copy behind those chosen before it (else as if it had its stream to itself)."""
    options = _options(graph, cost)
    times = cost.op_times_s(graph)
    boundary = first_backward_op(graph)
    hideable = (float(times[:boundary].sum()), float(times[boundary:].sum()))  # copy time each stream can hide
    starts = np.concatenate([[0.0], np.cumsum(times)])  # each op's start with nothing delaying it
    plan = _build(graph, budget, [], base, queued)
    chains = _Chains(graph, cost)
    for margin in MARGINS:
        chosen = _choose(graph, options, budget * (1 - margin), starts, hideable, chains, base, queued)
        plan = _build(graph, budget, chosen, base, queued)
        if simulate_with(graph, plan, cost).fits or _short_of(graph, chosen, budget * (1 - margin), base):
            break  # fits; or the options ran out before this target, and a lower one gets no further
    return plan


def _options(graph: Graph, cost: CostModel) -> list[_Option]:
    key = ("auto options", id(graph), graph.fingerprint)  # auto plans several times per call: listed once
    if key not in cost.memo:
        cost.memo[key] = _listed_options(graph, cost)
    return list(cost.memo[key])


def _listed_options(graph: Graph, cost: CostModel) -> tuple[_Option, ...]:
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
                found.append(_Option(c, "offload", (gone, prefetch), d2h + h2d, d2h, h2d, exposed_s=exposed,
                                     reader=reader, late=prefetch != early))
    for r in rebuilds(graph, cost, SIZE_FLOOR):
        # back on the device from the op before its replay (NOTE [simulated streams] 1)
        window = (r.window[0], r.candidate.first_backward - 1)
        found.append(_Option(r.candidate, "recompute", window, r.time_s, ops=r.ops, sources=r.sources))
    return tuple(found)


class _Chains:
    """A tensor's recomputations that also remake the saved tensors they read, a few levels back (the exact
    planner's chains), so that those need not stay; listed only for the tensors asked about (slow on deep graphs)."""

    def __init__(self, graph: Graph, cost: CostModel) -> None:
        boundary = first_backward_op(graph)
        self.graph, self.times = graph, cost.op_times_s(graph)
        self.pool = {c.tensor: c for c in candidates(graph, SIZE_FLOOR) if c.last_forward < boundary}
        self.found: dict[int, list[_Option]] = {}

    def __call__(self, tensor: int) -> list[_Option]:
        if tensor not in self.found:
            c = self.pool[tensor]
            window = (c.freed_after + 1, c.first_backward - 1)
            self.found[tensor] = sorted((_Option(c, "recompute", window, chain.time_s, ops=chain.action.ops,
                                                 sources=chain.keeps)
                                         for chain in chain_options(self.graph, c, self.pool, self.times)),
                                        key=lambda o: o.cost_s)
        return self.found[tensor]


def _short_of(graph: Graph, chosen: list[_Option], target: float, base: Plan | None) -> bool:
    """The estimate with ``chosen`` (and ``base``) taken away is still over ``target``."""
    estimate = CurveEstimate(graph)
    if base is not None:
        _taken(graph, base, estimate)
    for option in chosen:
        estimate.drop(option.candidate, option.window)
    return estimate.peak()[0] > target


def _choose(graph: Graph, options: list[_Option], target: float, starts: np.ndarray, hideable: tuple[float, float],
            chains: _Chains, base: Plan | None = None, queued: bool = True) -> list[_Option]:
    """Drop, at the estimated peak, whatever frees bytes for the least time, until the estimate fits.

    A recompute costs its ops' time. Offloads share the copy streams: while the copies fit
    in the compute time they overlap (forward for the copies out, backward for the copies
    in) they cost nothing, beyond that their whole copy time. Each stream runs its copies
    one at a time (``CopyQueue``): an offload whose copy out, queued behind the chosen ones,
    ends after the peak op starts is let go there, compute waiting for it; a copy in adds
    its reader's wait and the delay it causes the copies queued behind it. An offloaded
    tensor may later be prefetched later, or recomputed instead. When every tensor at the
    peak is chosen or read by a chosen replay, a replay is lengthened to remake what it
    read (``_unpin``), so that that may go too.
    """
    greedy = _Greedy(graph, options, starts, hideable, base, queued)
    peak, op = greedy.estimate.peak()
    while peak > target:
        recompute = _first(greedy.recomputes, op, greedy.chosen, greedy.pinned, greedy.away, queued)
        offload = _cheapest_offload(greedy.offloads, op, greedy.chosen, greedy.pinned, greedy.away, greedy.streams,
                                    greedy.estimate)
        if recompute is None and offload is None:
            if not greedy.unpin(chains, op):
                break
        elif offload is None or (recompute is not None and recompute.cost_s / greedy.estimate.size(recompute.candidate)
                                 < offload[0] / greedy.estimate.size(offload[1].candidate)):
            assert recompute is not None  # not with offload None too
            greedy.take(recompute)
        else:
            greedy.take(offload[1])
        peak, op = greedy.estimate.peak()
    return list(greedy.chosen.values())


class _Greedy:
    """What ``_choose`` has chosen so far, the estimate with it taken away, and the options still ranked."""

    def __init__(self, graph: Graph, options: list[_Option], starts: np.ndarray, hideable: tuple[float, float],
                 base: Plan | None, queued: bool) -> None:
        self.estimate = CurveEstimate(graph)
        self.recomputes = sorted((o for o in options if o.action == "recompute"), key=self._recompute_key)
        self.offloads = sorted((o for o in options if o.action == "offload" and not o.late), key=self._offload_key)
        self.later: dict[int, list[_Option]] = {}  # ranked only once their tensor is offloaded
        self.by_tensor: dict[int, list[_Option]] = {}
        for option in options:
            self.by_tensor.setdefault(option.candidate.tensor, []).append(option)
            if option.late:
                self.later.setdefault(option.candidate.tensor, []).append(option)
        self.chosen: dict[int, _Option] = {}
        self.held: set[int] = set()  # what base's replays read: it must stay
        self.away: set[int] = set()  # what base offloads or recomputes: no replay may read it
        self.streams = _Streams(starts, hideable, queued)
        if base is not None:
            self.held = _taken(graph, base, self.estimate)
            self.away = {o.tensor for o in base.offloads} | {t for r in base.recomputes for t in r.tensors}
            copies = {o.candidate.tensor: o for o in self.offloads}
            for offload in base.offloads:
                if offload.tensor in copies:
                    self.streams.add(replace(copies[offload.tensor], window=(0, offload.prefetch_at)), None)
        self.pinned = set(self.held)  # and the sources of chosen recomputes
        self.unpinned = 0

    def _recompute_key(self, o: _Option) -> tuple[float, int]:
        return o.cost_s / self.estimate.size(o.candidate), o.candidate.tensor

    @staticmethod
    def _offload_key(o: _Option) -> tuple[int, float, int]:
        return -o.candidate.nbytes, o.exposed_s, o.candidate.tensor

    def take(self, pick: _Option) -> None:
        tensor = pick.candidate.tensor
        before = self.chosen.get(tensor)
        if pick.action == "offload":
            self.streams.add(pick, before)
            if before is None:
                for option in self.later.get(tensor, ()):
                    bisect.insort(self.offloads, option, key=self._offload_key)
        self.chosen[tensor] = pick
        self.pinned.update(pick.sources)
        if before is None:
            self.estimate.drop(pick.candidate, pick.window)
        else:  # an offloaded tensor away longer (prefetched later, or recomputed instead): only the difference is new
            self.estimate.drop(pick.candidate, (pick.window[0], before.window[0]))
            self.estimate.drop(pick.candidate, (before.window[1], pick.window[1]))
            if pick.action == "recompute":
                self.streams.remove(before)

    def unpin(self, chains: _Chains, op: int) -> bool:
        """Free a tensor at ``op`` that chosen replays read, by lengthening them (``_unpin``); False if none."""
        freed = None if self.unpinned == _UNPINS else \
            _unpin(self.by_tensor, chains, op, self.chosen, self.pinned, self.held, self.away, self.estimate)
        if freed is None:
            return False
        self.unpinned += 1
        self.pinned = self.held | {s for o in self.chosen.values() for s in o.sources}
        for option in self.by_tensor[freed]:  # back among the options (a copy left there is passed over twice)
            if option.action == "recompute":
                bisect.insort(self.recomputes, option, key=self._recompute_key)
            elif not option.late:
                bisect.insort(self.offloads, option, key=self._offload_key)
        return True


class _Streams:
    """The copies chosen so far on each stream, and what is left of the compute time that hides them."""

    def __init__(self, starts: np.ndarray, hideable: tuple[float, float], queued: bool) -> None:
        self.starts, self.queued = starts, queued
        self.out, self.back = CopyQueue(), CopyQueue()
        self.d2h_left, self.h2d_left = hideable

    def price(self, option: _Option, before: _Option | None, op: int) -> tuple[float, int | None]:
        """The option's time, away at ``op``: copy time beyond what compute hides, its reader's wait for its
        copy in behind the queue, and, if its copy out (behind the queue) ends after ``op`` starts, the wait
        for it there (its release op, returned; None: let go as its copy ends). ``before``: already out."""
        c = option.candidate
        added = 0.0
        release = None
        if before is None:
            ready = float(self.starts[c.last_forward + 1])
            done = self.out.end_if_added(ready, c.tensor, option.d2h_s) if self.queued else ready + option.d2h_s
            if max(c.freed_after + 1, int(np.searchsorted(self.starts, done))) > op:
                added, release = done - float(self.starts[op]), op
        if before is None or not self.queued:
            added += max(0.0, option.d2h_s - self.d2h_left) + max(0.0, option.h2d_s - self.h2d_left)
        issued, due = float(self.starts[option.window[1]]), float(self.starts[option.reader])
        if not self.queued:
            return added + max(0.0, issued + option.h2d_s - due), release
        replaced = None if before is None else (float(self.starts[before.window[1]]), c.tensor)
        return added + self.back.added_wait(issued, c.tensor, option.h2d_s, due, replaced), release

    def remove(self, option: _Option) -> None:
        c = option.candidate
        self.out.remove(float(self.starts[c.last_forward + 1]), c.tensor)
        self.back.remove(float(self.starts[option.window[1]]), c.tensor)
        self.d2h_left, self.h2d_left = self.d2h_left + option.d2h_s, self.h2d_left + option.h2d_s

    def add(self, option: _Option, before: _Option | None) -> None:
        c = option.candidate
        if before is None:
            self.out.add(float(self.starts[c.last_forward + 1]), c.tensor, option.d2h_s)
            self.d2h_left, self.h2d_left = self.d2h_left - option.d2h_s, self.h2d_left - option.h2d_s
        else:
            self.back.remove(float(self.starts[before.window[1]]), c.tensor)
        self.back.add(float(self.starts[option.window[1]]), c.tensor, option.h2d_s, float(self.starts[option.reader]))


def _cheapest_offload(ranked: list[_Option], op: int, chosen: dict[int, _Option], pinned: set[int], away: set[int],
                      streams: _Streams, estimate: CurveEstimate) -> tuple[float, _Option] | None:
    """Of the first few offloads away at ``op`` once their copy out has queued, the least time per byte,
    with the window it has behind the queue."""
    best: tuple[float, float, _Option] | None = None
    tried = 0
    stale = []
    for index, option in enumerate(ranked):
        if not _allowed(option, chosen, pinned, away):
            stale.append(index)
            continue
        before = chosen.get(option.candidate.tensor)
        if not (option.candidate.freed_after < op if before is None else option.window[0] <= op) \
                or op >= option.window[1]:
            continue
        time_s, release = streams.price(option, before, op)
        if release is not None and not streams.queued:
            continue  # priced alone, an offload is away from when its copy would end with the stream to itself
        size = estimate.size(option.candidate)
        if best is None or time_s / size < best[0]:
            window = (op if release is not None else option.window[0], option.window[1])
            best = (time_s / size, time_s, replace(option, window=window, release=release))
        tried += 1
        if tried == (_TRIED if streams.queued else 1):
            break
    for index in reversed(stale):
        del ranked[index]
    return None if best is None else (best[1], best[2])


def _unpin(by_tensor: dict[int, list[_Option]], chains: _Chains, op: int, chosen: dict[int, _Option], pinned: set[int],
           held: set[int], away: set[int], estimate: CurveEstimate) -> int | None:
    """Stuck at ``op`` with every tensor there chosen or read by a chosen replay: let the replays that read
    one such tensor remake it instead (a longer chain of theirs), so that it may go too. Of the largest few
    such tensors, the one whose replays cost the least added time per byte it frees (returned); None if none
    can be freed that way."""
    def allowed(option: _Option) -> bool:
        return not any(s in chosen or s in away for s in option.sources)

    readers: dict[int, list[_Option]] = {}
    for option in chosen.values():
        for source in option.sources:
            readers.setdefault(source, []).append(option)
    there = [t for t in pinned - held - set(chosen) if t in by_tensor
             and by_tensor[t][0].candidate.freed_after < op < by_tensor[t][0].candidate.first_backward
             and any(o.window[0] <= op < o.window[1] and not o.late and allowed(o) for o in by_tensor[t])]
    best: tuple[float, int, dict[int, _Option]] | None = None
    found = 0
    for tensor in sorted(there, key=lambda t: (-by_tensor[t][0].candidate.nbytes, t)):
        swaps: dict[int, _Option] = {}
        for reader in readers.get(tensor, ()):
            longer = next((o for o in chains(reader.candidate.tensor) if tensor not in o.sources and allowed(o)),
                          None)
            if longer is None:
                break
            swaps[reader.candidate.tensor] = longer
        else:
            if not swaps:
                continue
            added = sum(o.cost_s - chosen[t].cost_s for t, o in swaps.items())
            score = added / estimate.size(by_tensor[tensor][0].candidate)
            if best is None or score < best[0]:
                best = (score, tensor, swaps)
            found += 1
            if found == _UNPINNED:
                break
    if best is None:
        return None
    chosen.update(best[2])
    return best[1]


def _first(ranked: list[_Option], op: int, chosen: dict[int, _Option], pinned: set[int],
           away: set[int], switch: bool = True) -> _Option | None:
    """The best option away at ``op``; options no longer allowed are dropped from ``ranked`` on the way
    (what is chosen or pinned stays so), so each is passed over at most once."""
    stale = []
    found = None
    for index, option in enumerate(ranked):
        if not _allowed(option, chosen, pinned, away, switch):
            stale.append(index)
        elif option.window[0] <= op < option.window[1]:
            found = option
            break
    for index in reversed(stale):
        del ranked[index]
    return found


def _allowed(option: _Option, chosen: dict[int, _Option], pinned: set[int], away: set[int],
             switch: bool = True) -> bool:
    """``switch``: an offloaded tensor may be recomputed instead."""
    tensor = option.candidate.tensor
    before = chosen.get(tensor)
    if before is not None and before.action == "offload":
        # an offload may still be prefetched later, to cover a peak closer to its use, or recomputed instead
        if option.action == "offload":
            return option.window[1] > before.window[1]
        return switch and not any(s in chosen or s in away for s in option.sources)
    if before is not None:
        return False
    return not option.late and tensor not in pinned and not any(s in chosen or s in away for s in option.sources)


def _first_reader(graph: Graph, c: Candidate) -> int:
    """The first op after forward that reads the tensor (it waits for a prefetch)."""
    return next((i for i in graph.tensors[c.tensor].consumers if i >= c.first_backward), c.first_backward)


def _taken(graph: Graph, base: Plan, estimate: CurveEstimate) -> set[int]:
    """Take ``base``'s tensors out of the estimate; what they are and what its replays read stays as it is."""
    where = {c.tensor: c for c in candidates(graph)}
    taken: set[int] = set()
    for offload in base.offloads:
        if offload.tensor in where:
            estimate.drop(where[offload.tensor], (where[offload.tensor].freed_after + 1, offload.prefetch_at))
        taken.add(offload.tensor)
    for recompute in base.recomputes:
        made = {t for i in recompute.ops for t in graph.ops[i].outputs}
        taken |= {t for i in recompute.ops for t in graph.ops[i].inputs if t not in made} | set(recompute.tensors)
        for t in recompute.tensors:
            if t in where:
                estimate.drop(where[t], (where[t].freed_after + 1, recompute.at_op - 1))
    return taken


def _build(graph: Graph, budget: int, chosen: list[_Option], base: Plan | None = None, queued: bool = True) -> Plan:
    offloads = tuple(sorted([Offload(o.candidate.tensor, o.candidate.last_forward, o.window[1],
                                     release_before=o.release)
                             for o in chosen if o.action == "offload"] + list(base.offloads if base else ()),
                            key=lambda x: (x.after_op, x.tensor)))
    recomputes = tuple(sorted([Recompute((o.candidate.tensor,), o.ops, o.candidate.first_backward)
                               for o in chosen if o.action == "recompute"] + list(base.recomputes if base else ()),
                              key=lambda r: (r.at_op, r.tensors)))
    greedy = "auto-joint" if queued else "auto-joint (copies priced alone)"
    name = greedy if base is None else f"{base.policy} completed by {greedy}"
    return Plan(name, graph.fingerprint, budget, offloads=offloads, recomputes=recomputes,
                pinned_pool_bytes=pinned_pool_bytes(graph, offloads), size_floor_bytes=SIZE_FLOOR)
