"""auto: choose keep, offload or recompute per saved tensor, jointly, for the fastest step that fits.

For each candidate it prices both ways out of memory (``_auto_options``): a recompute costs
re-running its producer and the in-place ops that follow it; an offload shares the copy
streams, each running one copy at a time, so it costs the copy time the compute it overlaps
does not hide, the wait of its reader behind the copies queued before it and the delay it
adds to those behind, and, if its copy out ends (behind the queue) after the peak it must
cover, the wait for it there. Greedily (``_auto_greedy``), at the op where the estimated
curve peaks, it drops whatever frees bytes for the least time, until the estimate fits: an
offloaded tensor may later be prefetched later or recomputed instead, and when every tensor
at the peak is chosen or read by a chosen replay, a replay is lengthened to remake what it
reads. The simulator checks, and it aims lower if it must. On graphs of up to
``SECOND_GREEDY_OPS`` ops the greedy runs a second time with each copy priced as if it had
its stream to itself (it wins on some graphs), and a third time, thorough (NOTE [thorough greedy]:
it wins at tight budgets). Then every other policy is planned and
simulated as well; the fastest of them that do not fit are completed by the same greedy
(what they still need, on top of their actions), and the fastest plan that fits wins, so
auto is never slower (in simulation) than any of them. Beside them, offloads spaced out along
forward's copy stream (``_spaced_offloads``), completed by the greedy, contend too (on graphs of
up to ``SECOND_GREEDY_OPS`` ops), and so does checkpointing the first calls of the model's
repeated block (``_checkpointed_blocks``: the fewest that fit alone, and one fewer completed by
the greedy). On those graphs a local search (``_local_search``) then starts from the winner: it
drops actions no longer needed and replaces the dearest by the greedy's completion without them.
``optimal`` (the exact reference) measures how far from the best it is.
"""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace

import numpy as np

from udnn_lab.collector import collector_paused
from udnn_lab.cost.model import CostModel
from udnn_lab.graph.plan_ir import Offload, Plan, Recompute
from udnn_lab.graph.step_graph import Graph
from udnn_lab.planning._auto_greedy import choose, taken
from udnn_lab.planning._auto_options import DEEPER, Chains, Option, auto_options
from udnn_lab.planning._candidates import first_backward_op
from udnn_lab.planning._curve_estimate import CurveEstimate
from udnn_lab.planning._local_search import improved
from udnn_lab.planning._spaced_offloads import PREFIXES, SPACED, spaced_offloads
from udnn_lab.planning.host import plan_host_bytes
from udnn_lab.planning.registry import CHOOSING_POLICIES, POLICIES, SOLVER_POLICIES, keep_all_peak, policy
from udnn_lab.planning.reserved import allocated_peak_bytes, counts_whole_blocks
from udnn_lab.planning.segments import block_prefixes
from udnn_lab.planning.vdnn import MARGINS, SIZE_FLOOR, pinned_pool_bytes
from udnn_lab.simulation.simulator import Simulation, simulate_with

SECOND_GREEDY_OPS = 4000  # up to this many ops, the greedy is run twice, with copies priced alone as well
COMPLETED = 2  # how many of the fastest plans that do not fit auto completes
THOROUGH = "auto-joint (thorough)"
_REACH = 1.25  # a start for the local search this much slower than the fastest is not searched from
BLOCKS = "checkpointed blocks"  # the first calls of the model's repeated block (_checkpointed_blocks)


@policy("auto", chooses=True)
def auto(graph: Graph, cost: CostModel, budget: int | None) -> Plan:
    return _fastest(graph, cost, budget, None)


def auto_within_host(graph: Graph, cost: CostModel, budget: int | None, host_budget: int | None,
                     counted_within: int | None = None) -> Plan:
    """auto's plan, chosen among those whose offloads take at most ``host_budget`` bytes of host memory
    (NOTE [host budget]); a recompute-only greedy joins the contenders. When no plan that fits the device keeps
    within it, the fastest that fits the device is returned (the caller says what it needs).

    ``counted_within``: on a step whose budget counts whole blocks (NOTE [whole blocks] in planning/reserved.py),
    the budget as the caching allocator counts it: of the plans that fit ``budget`` in live bytes, the fastest
    counted within it, else the one counted lowest (``budget`` may be lower, in a search for such a plan)."""
    if budget is None or keep_all_peak(graph, cost) <= budget or \
            host_budget is None and (counted_within is None or not counts_whole_blocks(graph)):
        return POLICIES["auto"](graph, cost, budget)  # the registry's rule: nothing to move, no host memory
    return _fastest(graph, cost, budget, host_budget, counted_within=counted_within)


def auto_fits(graph: Graph, cost: CostModel, budget: int) -> bool:
    """Whether auto meets ``budget``: decided before its local search, which only makes a plan that fits faster
    (what min_budget's bisection asks, at a tenth of the time on ResNet-50)."""
    if keep_all_peak(graph, cost) <= budget:
        return True
    with collector_paused():  # auto fits where any of its contenders does
        return any(sim.fits for sim, _ in _contenders(graph, cost, budget, until_one_fits=True))


def _fastest(graph: Graph, cost: CostModel, budget: int | None, host_budget: int | None,
             counted_within: int | None = None) -> Plan:
    if budget is None:
        return Plan.keep_all(graph)  # nothing to save: every action only adds time
    with collector_paused():  # its simulations' results pile up: on a deep graph, a full collection every few
        runs = _contenders(graph, cost, budget)
        fitting = [(sim.step_time_s, len(plan.offloads) + len(plan.recomputes), i)
                   for i, (sim, plan) in enumerate(runs) if sim.fits]
        within = [key for key in fitting
                  if host_budget is None or plan_host_bytes(graph, runs[key[2]][1]) <= host_budget]
        ranked = sorted(within or fitting)
        if not ranked:
            chosen = runs[0][1]
        else:
            ranked = ranked[_counted_pick(graph, [runs[key[2]] for key in ranked], counted_within):]
            chosen = runs[ranked[0][2]][1]
            if len(graph.ops) <= SECOND_GREEDY_OPS:
                searched = _searched(graph, cost, budget, runs, ranked, host_budget if within else None)
                chosen = _counted_choice(graph, cost, [searched, chosen], counted_within)
    return Plan("auto", chosen.graph_fingerprint, budget, chosen.offloads, chosen.recomputes,
                chosen.pinned_pool_bytes, chosen.size_floor_bytes, chosen.notes,
                chosen_policy=chosen.chosen_policy or chosen.policy)


def _counted_pick(graph: Graph, ranked: list[tuple[Simulation, Plan]], counted_within: int | None) -> int:
    """The index in ``ranked`` (plans that fit, fastest first) of the one to take: the first; where a budget
    counts whole blocks (``auto_within_host``), the first counted within ``counted_within``, else the one counted
    lowest (the fastest of those)."""
    if counted_within is None or not counts_whole_blocks(graph):
        return 0
    counted = []
    for index, (sim, plan) in enumerate(ranked):
        counted.append(allocated_peak_bytes(graph, plan, sim) if plan.offloads or plan.recomputes else sim.peak_bytes)
        if counted[-1] <= counted_within:
            return index
    return counted.index(min(counted))


def _counted_choice(graph: Graph, cost: CostModel, plans: list[Plan], counted_within: int | None) -> Plan:
    """Of ``plans`` (each fits), the one ``_counted_pick`` takes among them, fastest first."""
    runs = sorted(((simulate_with(graph, plan, cost), plan) for plan in plans), key=lambda run: run[0].step_time_s)
    return runs[_counted_pick(graph, runs, counted_within)][1]


def _contenders(graph: Graph, cost: CostModel, budget: int, until_one_fits: bool = False
                ) -> list[tuple[Simulation, Plan]]:
    """Every contender's plan for ``budget``, simulated; the first is the joint greedy's. ``until_one_fits``: up to
    the first that fits (whether auto fits)."""
    runs = []
    for plan in _first_contenders(graph, cost, budget):
        runs.append((simulate_with(graph, plan, cost), plan))
        if until_one_fits and runs[-1][0].fits:
            return runs
    # the fastest plans that act but do not fit, with what they still need chosen by the same greedy
    over = sorted((sim.step_time_s, i) for i, (sim, plan) in enumerate(runs)
                  if not sim.fits and (plan.offloads or plan.recomputes))
    bases = list({(runs[i][1].offloads, runs[i][1].recomputes): runs[i][1] for _, i in reversed(over)}.values())
    for base in bases[::-1][:COMPLETED]:
        completed = joint(graph, cost, budget, base=base)
        runs.append((simulate_with(graph, completed, cost), completed))
    return runs


def _first_contenders(graph: Graph, cost: CostModel, budget: int) -> Iterator[Plan]:
    """The contenders' plans, made one at a time, before the completions of those that do not fit."""
    yield joint(graph, cost, budget)
    if len(graph.ops) <= SECOND_GREEDY_OPS:
        yield joint(graph, cost, budget, queued=False)
        yield joint(graph, cost, budget, thorough=True)
    # recompute alone, then completed (below) when it falls short: a host budget or not, auto weighs it (with none,
    # a superset of the plans a host budget allows, auto must not do worse than with one)
    yield joint(graph, cost, budget, offloads=False)
    # spaced copies out in forward, completed by the greedy (_spaced_offloads.py): with or without more offloads;
    # on deep graphs only where the second greedy runs too (each completion is a greedy of its own)
    spaced = spaced_offloads(graph, cost) if len(graph.ops) <= SECOND_GREEDY_OPS else []
    for count in sorted({min(n, len(spaced)) for n in (*PREFIXES, len(spaced))} - {0}):
        base = replace(_build(graph, budget, spaced[:count]), policy=SPACED)
        yield from (joint(graph, cost, budget, base=base, offloads=more) for more in (False, True))
    if len(graph.ops) <= SECOND_GREEDY_OPS:
        yield from _checkpointed_blocks(graph, cost, budget)
    # the policies that choose among others (auto, vdnn-dyn) add none of their own; solvers take up to a minute
    yield from (POLICIES[name](graph, cost, budget) for name in POLICIES
                if name not in CHOOSING_POLICIES | SOLVER_POLICIES)


def _checkpointed_blocks(graph: Graph, cost: CostModel, budget: int) -> list[Plan]:
    """Checkpointing the first n calls of the model's repeated block, for the least n that fits alone, and the n
    below it completed by the greedy, with offloads and without: at tight budgets the exact planner's plans for a
    transformer re-run whole layers, which a greedy freeing a tensor at a time does not reach."""
    plans = [Plan(BLOCKS, graph.fingerprint, budget, recomputes=actions) for actions in block_prefixes(graph)]
    low, high = 0, len(plans)  # bisected: the least n whose plan fits is low + 1 (the peak falls as n grows)
    while low < high:
        middle = (low + high) // 2
        if simulate_with(graph, plans[middle], cost).fits:
            high = middle
        else:
            low = middle + 1
    below = [plans[low - 1]] if low > 0 and plans[low - 1].recomputes else []
    return plans[low:low + 1] + [joint(graph, cost, budget, base=base, offloads=more)
                                 for base in below for more in (False, True)]


def _searched(graph: Graph, cost: CostModel, budget: int, runs: list[tuple[Simulation, Plan]],
              ranked: list[tuple[float, int, int]], host_budget: int | None) -> Plan:
    """The local search's best from the plan taken (``ranked``'s first; step, actions, index in ``runs``) and,
    where that is the thorough greedy's or checkpoints blocks, from the fastest of each other family too: searched
    from, any may end the faster (NOTE [thorough greedy] 5)."""
    def family(key: tuple[float, int, int]) -> str:  # contenders whose plans, searched from, may end apart
        policy = runs[key[2]][1].policy
        return THOROUGH if policy == THOROUGH else BLOCKS if policy.startswith(BLOCKS) else ""

    best = ranked[0]
    starts = [best]
    if family(best):  # the fastest of each other family too, unless far slower
        firsts: dict[str, tuple[float, int, int]] = {}
        for key in ranked:
            firsts.setdefault(family(key), key)
        starts += [key for name, key in firsts.items() if name != family(best) and key[0] <= best[0] * _REACH]
    found = [improved(graph, cost, runs[index][1], step_s, lambda base, more: joint(graph, cost, budget, base,
                                                                                    offloads=more), host_budget)
             for step_s, _, index in starts]
    return min(found, key=lambda plan: simulate_with(graph, plan, cost).step_time_s)


def joint(graph: Graph, cost: CostModel, budget: int, base: Plan | None = None, queued: bool = True,
          offloads: bool = True, thorough: bool = False) -> Plan:
    """The joint keep/offload/recompute greedy, checked by simulation; from ``base``'s actions if given.
    ``queued``: price each copy behind those chosen before it (else as if it had its stream to itself).
    ``offloads``: False to choose among recomputes only (a plan that takes no host memory).
    ``thorough``: the greedy's further-reaching variant (NOTE [thorough greedy])."""
    options = [o for o in auto_options(graph, cost) if offloads or o.action != "offload"]
    times = cost.op_times_s(graph)
    boundary = first_backward_op(graph)
    hideable = (float(times[:boundary].sum()), float(times[boundary:].sum()))  # copy time each stream can hide
    starts = np.concatenate([[0.0], np.cumsum(times)])  # each op's start with nothing delaying it
    plan = _build(graph, budget, [], base, queued, offloads, thorough)
    chains = Chains(graph, cost, DEEPER) if thorough else Chains(graph, cost)
    for margin in MARGINS:
        chosen = choose(graph, options, budget * (1 - margin), starts, hideable, chains, base, queued, thorough)
        plan = _build(graph, budget, chosen, base, queued, offloads, thorough)
        if simulate_with(graph, plan, cost).fits or _short_of(graph, chosen, budget * (1 - margin), base):
            break  # fits; or the options ran out before this target, and a lower one gets no further
    return plan


def _short_of(graph: Graph, chosen: list[Option], target: float, base: Plan | None) -> bool:
    """The estimate with ``chosen`` (and ``base``) taken away is still over ``target``."""
    estimate = CurveEstimate(graph)
    if base is not None:
        taken(graph, base, estimate)
    for option in chosen:
        estimate.drop(option.candidate, option.window)
    return estimate.peak()[0] > target


def _build(graph: Graph, budget: int, chosen: list[Option], base: Plan | None = None, queued: bool = True,
           copies: bool = True, thorough: bool = False) -> Plan:
    offloads = tuple(sorted([Offload(o.candidate.tensor, o.candidate.last_forward, o.window[1],
                                     release_before=o.release)
                             for o in chosen if o.action == "offload"] + list(base.offloads if base else ()),
                            key=lambda x: (x.after_op, x.tensor)))
    recomputes = tuple(sorted([Recompute((o.candidate.tensor,), o.ops, o.candidate.first_backward)
                               for o in chosen if o.action == "recompute"] + list(base.recomputes if base else ()),
                              key=lambda r: (r.at_op, r.tensors)))
    greedy = "auto-joint" if queued else "auto-joint (copies priced alone)"
    greedy = greedy if copies else "auto-joint (recompute only)"
    greedy = THOROUGH if thorough else greedy
    name = greedy if base is None else f"{base.policy} completed by {greedy}"
    return Plan(name, graph.fingerprint, budget, offloads=offloads, recomputes=recomputes,
                pinned_pool_bytes=pinned_pool_bytes(graph, offloads), size_floor_bytes=SIZE_FLOOR)
