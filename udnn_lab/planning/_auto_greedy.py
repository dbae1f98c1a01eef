"""auto's greedy: at the op where the estimated curve peaks, drop whatever frees bytes for the least time.

Recomputes cost their ops' time. Offloads share the copy streams, each running one copy at a
time (NOTE [simulated streams] 2, 3; ``CopyQueue``): they cost nothing while the copies fit in
the compute they overlap, their copy time beyond; a copy out that, behind the queue, ends after
the peak op starts is let go there, compute waiting for it; a copy in costs its reader's wait and
the delay it adds to the copies queued behind it.

NOTE [thorough greedy]
At tight budgets the greedy can get stuck where a solver finds plans twice as fast (ResNet-50 at
batch 64 within its smallest budget: every tensor at the estimated peak chosen or kept as a
replay's source, the estimate there high with copies queued behind others). Its thorough variant
reaches further, and contends beside it:
  1. A recompute frees its own bytes less those of the sources it would keep at the op that could
     go there otherwise; of the first few away there, the least time per byte freed is taken.
  2. Where nothing is left at the op, a chosen offload whose copy out, behind the queue, ends after
     the op starts is let go at the op, compute waiting for its copy (as a solver's release points).
  3. Replays are lengthened up to deeper chains, and what a lengthened replay holds beyond what it
     restores (its chain's intermediates) is counted at the op it runs before.
  4. Stuck at an op, it sets that op aside and goes on at the next highest (the simulator checks).
  5. Where its plan is the fastest that fits, auto's local search starts from the fastest of the
     others as well: from them, the other greedy's can end the faster (BERT-base, 8%).
"""

from __future__ import annotations

import bisect
from dataclasses import replace
from typing import NamedTuple

import numpy as np

from udnn_lab.graph.plan_ir import Plan, replay_reads
from udnn_lab.graph.step_graph import Graph
from udnn_lab.planning._auto_options import Chains, Option
from udnn_lab.planning._candidates import Candidate, candidates
from udnn_lab.planning._copy_queue import CopyQueue
from udnn_lab.planning._curve_estimate import CurveEstimate

# Caps on the search, each trading a little of the greedy's reach for time on deep graphs:
_TRIED = 4  # offloads away at the peak priced at each step, largest first; the cheapest per byte is taken. Pricing
#             one walks the copy queues, and past the few largest the cheapest per byte is rarely further down
_UNPINS = 24  # lengthenings of chosen replays (unpin) at most: each scans every pinned tensor, and past a few dozen
#               a deep graph's peak has moved on and gains little
_UNPINNED = 4  # tensors, largest first, whose replays' lengthenings are priced when the greedy is stuck
_STUCK = 64  # ops the greedy sets aside, stuck there, to go on at the next highest


class Priced(NamedTuple):
    """An option with the time it adds (seconds) and the bytes it frees at the op, if taken now."""

    time_s: float
    option: Option
    freed_bytes: int


class Lengthening(NamedTuple):
    """Chosen replays made longer so that a tensor they read can go: its time per byte freed, the tensor, and the
    longer replay for each chosen tensor whose replay changes."""

    seconds_per_byte: float
    tensor: int
    longer: dict[int, Option]


def choose(graph: Graph, options: list[Option], target: float, starts: np.ndarray, hideable: tuple[float, float],
            chains: Chains, base: Plan | None = None, queued: bool = True, thorough: bool = False) -> list[Option]:
    """Drop, at the estimated peak, whatever frees bytes for the least time, until the estimate fits.

    A recompute costs its ops' time. Offloads share the copy streams: while the copies fit
    in the compute time they overlap (forward for the copies out, backward for the copies
    in) they cost nothing, beyond that their whole copy time. Each stream runs its copies
    one at a time (``CopyQueue``): an offload whose copy out, queued behind the chosen ones,
    ends after the peak op starts is let go there, compute waiting for it; a copy in adds
    its reader's wait and the delay it causes the copies queued behind it. An offloaded
    tensor may later be prefetched later, or recomputed instead. When every tensor at the
    peak is chosen or read by a chosen replay, a replay is lengthened to remake what it
    read (``_Greedy.unpin``), so that that may go too.

    ``thorough`` (NOTE [thorough greedy]): also weigh a recompute by the sources it would keep, let a chosen
    offload go earlier with compute waiting for its copy, and, stuck at an op, go on at the next highest.
    """
    greedy = _Greedy(graph, options, starts, hideable, base, queued, thorough)
    stuck: list[int] = []  # ops where nothing is left to do (thorough): the estimate may be high there
    peak, op = greedy.estimate.peak()
    while peak > target:
        recompute = greedy.first_recompute(op)
        offload = greedy.cheapest_offload(op)
        if recompute is None and offload is None:
            released = greedy.released_earlier(op) if thorough else None  # NOTE [thorough greedy] 2
            if released is not None:
                greedy.take(released.option)
            elif not greedy.unpin(chains, op):
                if not thorough or len(stuck) == _STUCK:
                    break
                stuck.append(op)  # NOTE [thorough greedy] 4
        elif offload is None or (recompute is not None and recompute.time_s / recompute.freed_bytes
                                 < offload.time_s / offload.freed_bytes):
            assert recompute is not None  # not with offload None too
            greedy.take(recompute.option)
        else:
            greedy.take(offload.option)
        peak, op = greedy.estimate.peak(stuck)
    return list(greedy.chosen.values())


class _Greedy:
    """What ``choose`` has chosen so far, the estimate with it taken away, and the options still ranked."""

    def __init__(self, graph: Graph, options: list[Option], starts: np.ndarray, hideable: tuple[float, float],
                 base: Plan | None, queued: bool, thorough: bool = False) -> None:
        self.estimate = CurveEstimate(graph)
        self.thorough = thorough
        self.recomputes = sorted((o for o in options if o.action == "recompute"), key=self._recompute_key)
        self.offloads = sorted((o for o in options if o.action == "offload" and not o.late), key=self._offload_key)
        self.later: dict[int, list[Option]] = {}  # ranked only once their tensor is offloaded
        self.by_tensor: dict[int, list[Option]] = {}
        for option in options:
            self.by_tensor.setdefault(option.candidate.tensor, []).append(option)
            if option.late:
                self.later.setdefault(option.candidate.tensor, []).append(option)
        self.chosen: dict[int, Option] = {}
        self.held: set[int] = set()  # what base's replays read: it must stay
        self.away: set[int] = set()  # what base offloads or recomputes: no replay may read it
        self.streams = _Streams(starts, hideable, queued)
        if base is not None:
            self.held = taken(graph, base, self.estimate)
            self.away = {o.tensor for o in base.offloads} | {t for r in base.recomputes for t in r.tensors}
            copies = {o.candidate.tensor: o for o in self.offloads}
            for offload in base.offloads:
                if offload.tensor in copies:
                    self.streams.add(replace(copies[offload.tensor], window=(0, offload.prefetch_at)), None)
        self.pinned = set(self.held)  # and the sources of chosen recomputes
        self.unpinned = 0

    def _recompute_key(self, o: Option) -> tuple[float, int]:
        return o.cost_s / self.estimate.size(o.candidate), o.candidate.tensor

    @staticmethod
    def _offload_key(o: Option) -> tuple[int, float, int]:
        return -o.candidate.nbytes, o.exposed_s, o.candidate.tensor

    def take(self, pick: Option) -> None:
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

    def first_recompute(self, op: int) -> Priced | None:
        """The best recompute away at ``op`` (an offloaded tensor may be recomputed instead where copies queue):
        the first in the ranking; thorough, of the first few that free more than the sources they would keep there,
        the least time per byte freed. Recomputes no longer allowed are dropped from the ranking on the way, so each
        is passed over once."""
        stale = []
        best: tuple[float, Option, int] | None = None
        tried = 0
        for index, option in enumerate(self.recomputes):
            if not self._allowed(option, switch=self.streams.queued):
                stale.append(index)
            elif option.window[0] <= op < option.window[1] and (freed := self.freed(option, op)) > 0:
                if best is None or option.cost_s / freed < best[0]:
                    best = (option.cost_s / freed, option, freed)
                tried += 1
                if tried == (_TRIED if self.thorough else 1):
                    break
        for index in reversed(stale):
            del self.recomputes[index]
        return None if best is None else Priced(best[1].cost_s, best[1], best[2])

    def freed(self, option: Option, op: int) -> int:
        """The bytes ``option`` frees at ``op``: its own; thorough, less those of the sources it would keep there
        that could go there otherwise (NOTE [thorough greedy] 1)."""
        kept = 0
        for source in option.sources if self.thorough else ():
            if source in self.pinned or source in self.chosen or source not in self.by_tensor:
                continue
            c = self.by_tensor[source][0].candidate
            if c.freed_after < op < c.first_backward:
                kept += self.estimate.size(c)
        return self.estimate.size(option.candidate) - kept

    def cheapest_offload(self, op: int) -> Priced | None:
        """Of the first few offloads away at ``op`` once their copy out has queued, the least time per byte,
        with the window it has behind the queue."""
        best: tuple[float, Priced] | None = None
        tried = 0
        stale = []
        for index, option in enumerate(self.offloads):
            if not self._allowed(option):
                stale.append(index)
                continue
            before = self.chosen.get(option.candidate.tensor)
            if not (option.candidate.freed_after < op if before is None else option.window[0] <= op) \
                    or op >= option.window[1]:
                continue
            time_s, release = self.streams.price(option, before, op)
            if release is not None and not self.streams.queued:
                continue  # priced alone, an offload is away from when its copy would end with the stream to itself
            size = self.estimate.size(option.candidate)
            if best is None or time_s / size < best[0]:
                window = (op if release is not None else option.window[0], option.window[1])
                best = (time_s / size, Priced(time_s, replace(option, window=window, release=release), size))
            tried += 1
            if tried == (_TRIED if self.streams.queued else 1):
                break
        for index in reversed(stale):
            del self.offloads[index]
        return None if best is None else best[1]

    def released_earlier(self, op: int) -> Priced | None:
        """Of the chosen offloads whose copy out, behind the queue, ends after ``op`` starts, the one whose wait
        there costs the least per byte, let go at ``op`` (compute waiting for its copy) rather than once it ends."""
        best: tuple[float, Priced] | None = None
        for chosen in self.chosen.values():
            c = chosen.candidate
            if chosen.action != "offload" or not c.freed_after < op < chosen.window[0]:
                continue
            wait = max(0.0, self.streams.copied_out(chosen) - float(self.streams.starts[op]))
            size = self.estimate.size(c)
            if best is None or wait / size < best[0]:
                best = (wait / size, Priced(wait, replace(chosen, window=(op, chosen.window[1]), release=op), size))
        return None if best is None else best[1]

    def _allowed(self, option: Option, switch: bool = True) -> bool:
        """``switch``: an offloaded tensor may be recomputed instead."""
        tensor = option.candidate.tensor
        before = self.chosen.get(tensor)
        if before is not None and before.action == "offload":
            # an offload may still be prefetched later, to cover a peak closer to its use, or recomputed instead
            if option.action == "offload":
                return option.window[1] > before.window[1]
            return switch and not self._reads_what_goes(option)
        if before is not None:
            return False
        return not option.late and tensor not in self.pinned and not self._reads_what_goes(option)

    def _reads_what_goes(self, option: Option) -> bool:
        """Whether a replay reads a tensor chosen here or moved by the base plan."""
        return any(s in self.chosen or s in self.away for s in option.sources)

    def unpin(self, chains: Chains, op: int) -> bool:
        """Free a tensor at ``op`` that chosen replays read, by lengthening them; False if none can be."""
        lengthening = None if self.unpinned == _UNPINS else self._lengthening(chains, op)
        if lengthening is None:
            return False
        for tensor, longer in lengthening.longer.items() if self.thorough else ():  # NOTE [thorough greedy] 3
            self.estimate.hold(longer.candidate.first_backward, longer.made - self.chosen[tensor].made)
        self.chosen.update(lengthening.longer)
        self.unpinned += 1
        self.pinned = self.held | {s for o in self.chosen.values() for s in o.sources}
        for option in self.by_tensor[lengthening.tensor]:  # back among the options (a copy left there: passed twice)
            if option.action == "recompute":
                bisect.insort(self.recomputes, option, key=self._recompute_key)
            elif not option.late:
                bisect.insort(self.offloads, option, key=self._offload_key)
        return True

    def _lengthening(self, chains: Chains, op: int) -> Lengthening | None:
        """Stuck at ``op`` with every tensor there chosen or read by a chosen replay: let the replays that read
        one such tensor remake it instead (a longer chain of theirs), so that it may go too. Of the largest few
        such tensors, the one whose replays cost the least added time per byte it frees; None if none can be
        freed that way."""
        readers: dict[int, list[Option]] = {}
        for option in self.chosen.values():
            for source in option.sources:
                readers.setdefault(source, []).append(option)
        by_tensor = self.by_tensor
        there = [t for t in self.pinned - self.held - set(self.chosen) if t in by_tensor
                 and by_tensor[t][0].candidate.freed_after < op < by_tensor[t][0].candidate.first_backward
                 and any(o.window[0] <= op < o.window[1] and not o.late and not self._reads_what_goes(o)
                         for o in by_tensor[t])]
        best: Lengthening | None = None
        found = 0
        for tensor in sorted(there, key=lambda t: (-by_tensor[t][0].candidate.nbytes, t)):
            longer: dict[int, Option] = {}
            for reader in readers.get(tensor, ()):
                chain = next((o for o in chains(reader.candidate.tensor)
                              if tensor not in o.sources and not self._reads_what_goes(o)), None)
                if chain is None:
                    break
                longer[reader.candidate.tensor] = chain
            else:
                if not longer:
                    continue
                added = sum(o.cost_s - self.chosen[t].cost_s for t, o in longer.items())
                score = added / self.estimate.size(by_tensor[tensor][0].candidate)
                if best is None or score < best.seconds_per_byte:
                    best = Lengthening(score, tensor, longer)
                found += 1
                if found == _UNPINNED:
                    break
        return best


class _Streams:
    """The copies chosen so far on each stream, and what is left of the compute time that hides them."""

    def __init__(self, starts: np.ndarray, hideable: tuple[float, float], queued: bool) -> None:
        self.starts, self.queued = starts, queued
        self.out, self.back = CopyQueue(), CopyQueue()
        self.d2h_left, self.h2d_left = hideable

    def price(self, option: Option, before: Option | None, op: int) -> tuple[float, int | None]:
        """The option's time, away at ``op``: copy time beyond what compute hides, its reader's wait for its
        copy in behind the queue, and, if its copy out (behind the queue) ends after ``op`` starts, the wait
        for it there (its release op, returned; None: let go as its copy ends). ``before``: already out."""
        c = option.candidate
        added = 0.0
        release = None
        if before is None:
            ready = self._out_from(c)
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

    def _out_from(self, c: Candidate) -> float:
        """When a tensor's copy out may start: as the op after its last reader in forward starts."""
        return float(self.starts[c.last_forward + 1])

    def copied_out(self, option: Option) -> float:
        """When the chosen offload's copy out ends, behind the queue (with the stream to itself if not queued)."""
        c = option.candidate
        ready = self._out_from(c)
        return self.out.end_of(ready, c.tensor) if self.queued else ready + option.d2h_s

    def remove(self, option: Option) -> None:
        c = option.candidate
        self.out.remove(self._out_from(c), c.tensor)
        self.back.remove(float(self.starts[option.window[1]]), c.tensor)
        self.d2h_left, self.h2d_left = self.d2h_left + option.d2h_s, self.h2d_left + option.h2d_s

    def add(self, option: Option, before: Option | None) -> None:
        c = option.candidate
        if before is None:
            self.out.add(self._out_from(c), c.tensor, option.d2h_s)
            self.d2h_left, self.h2d_left = self.d2h_left - option.d2h_s, self.h2d_left - option.h2d_s
        else:
            self.back.remove(float(self.starts[before.window[1]]), c.tensor)
        self.back.add(float(self.starts[option.window[1]]), c.tensor, option.h2d_s, float(self.starts[option.reader]))


def taken(graph: Graph, base: Plan, estimate: CurveEstimate) -> set[int]:
    """Take ``base``'s tensors out of the estimate; what they are and what its replays read stays as it is."""
    where = {c.tensor: c for c in candidates(graph)}
    taken: set[int] = set()
    for offload in base.offloads:
        if offload.tensor in where:
            estimate.drop(where[offload.tensor], (where[offload.tensor].freed_after + 1, offload.prefetch_at))
        taken.add(offload.tensor)
    for recompute in base.recomputes:
        taken |= replay_reads(graph, recompute.ops) | set(recompute.tensors)
        for t in recompute.tensors:
            if t in where:
                estimate.drop(where[t], (where[t].freed_after + 1, recompute.at_op - 1))
    return taken
