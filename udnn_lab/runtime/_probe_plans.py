"""The plans the step probes time the step under (NOTE [host probes] 4): which saved activations they offload, and
which recomputations they record or re-run. Plain data from the step's Graph; the probes time them (_step_probes.py).
"""

from __future__ import annotations

from udnn_lab.errors import PlanError
from udnn_lab.graph import Graph, Offload, Plan, Recompute
from udnn_lab.graph.plan_ir import written_after
from udnn_lab.graph.reruns import NOT_RERUN, repeated_block
from udnn_lab.runtime._host_probe import offload_by_hooks

SMALLEST_OFFLOADS = 16  # the offload plans offload among this many of the step's smallest saved activations
LARGEST_BYTES = 256 * 2**20  # and on a CPU, as many of its largest, up to this many bytes in all

# the chains' shares of the forward: the middle half, and nearly all of it (the planner's plans that re-run the most,
# where it counts); where one cannot be recorded, the next
MIDDLE_SHARES = (0.5, 0.375, 0.25, 0.125)
MOST_SHARES = (0.95, 0.75)

# besides its ops, each recomputation recorded costs a fixed time, and a step that records any once more (on GPT-2's
# small decoder on one EPYC thread about 100 us and 1 ms, against 15 to 25 us per op): the pieces plan records this
# many spread over the forward, each this share of its part wide (the next where one cannot be), in all about as many
# ops as the middle chain, so that its extra over that chain is the pieces' count (with 6 rather than 12, the figure
# per recomputation spread twice as wide over four profiles)
PIECES = 12
PIECE_SHARES = (0.5, 0.4, 0.6, 0.3, 0.7)


def offload_plans(graph: Graph, every_module: bool = False, largest: bool = False) -> dict[str, Plan] | None:
    """Located plans offloading one saved activation (the fewest hook calls: 'fewest'; the one farthest from
    'several' in calls per offload: 'one') and several of the smallest ('several'), or None where 'one' and
    'several' are too close in calls per offload to solve for; with ``largest``, as many of the largest (up to
    LARGEST_BYTES in all: 'large') where they copy several times the smallest's bytes. ``every_module``: counted as
    a runtime without the model hooks every module call (NOTE [hook points] 8)."""
    candidates: list[tuple[Offload, int]] = []  # (the offload, its hook calls alone), smallest tensors first
    for tensor in sorted(graph.tensors, key=lambda t: t.nbytes):
        if len(candidates) == SMALLEST_OFFLOADS:
            break
        alone = offload_by_hooks(graph, tensor)
        if alone is not None:  # its hook calls from the analysis that found it followed by hooks
            candidates.append((alone.offloads[0], hook_calls_of(alone, graph, every_module)))
    if len(candidates) < 2:
        return None
    # every module hooked, each offload's plan makes the step's many module calls: the fewest is the cleanest;
    # only the modules a plan needs hooked, one offload's calls are its windows': the most stand farthest apart
    fewest = min(candidates, key=lambda candidate: candidate[1])[0]
    one = fewest if every_module else max(candidates, key=lambda candidate: candidate[1])[0]
    plans = {name: Plan("probe", graph.fingerprint, offloads=offloads).located(graph) for name, offloads in
             (("one", (one,)), ("several", tuple(offload for offload, _ in candidates)))}
    plans["fewest"] = plans["one"] if fewest == one else \
        Plan("probe", graph.fingerprint, offloads=(fewest,)).located(graph)
    per_offload = (hook_calls_of(plans["one"], graph, every_module),
                   hook_calls_of(plans["several"], graph, every_module) / len(plans["several"].offloads))
    if per_offload[0] < 2 * per_offload[1]:
        return None
    # with 'fewest' the one offload's plan, two distinct plans cannot give a fourth unknown: none is timed for it
    large = _largest_offloads(graph, len(candidates)) if largest and fewest != one else ()
    if large:
        plan = Plan("probe", graph.fingerprint, offloads=large).located(graph)
        if offloaded_bytes(plan, graph) >= 4 * offloaded_bytes(plans["several"], graph):
            plans["large"] = plan
    return plans


def _largest_offloads(graph: Graph, count: int) -> tuple[Offload, ...]:
    """Up to ``count`` of the largest saved activations offloaded by hooks alone, LARGEST_BYTES in all at most."""
    chosen: list[Offload] = []
    total = 0
    for tensor in sorted(graph.tensors, key=lambda t: -t.nbytes):
        if len(chosen) == count:
            break
        if total + tensor.nbytes > LARGEST_BYTES:
            continue
        alone = offload_by_hooks(graph, tensor)
        if alone is not None:
            chosen.append(alone.offloads[0])
            total += tensor.nbytes
    return tuple(chosen)


def hook_calls_of(plan: Plan, graph: Graph, every_module: bool) -> int:
    return sum(plan.hook_calls(graph, every_module=every_module).values())


def offloaded_bytes(plan: Plan, graph: Graph) -> int:
    return sum(graph.tensors[offload.tensor].nbytes for offload in plan.offloads)


def recorded_chain(graph: Graph, shares: tuple[float, ...] = MIDDLE_SHARES) -> Plan | None:
    """A located plan recomputing every saved activation made in the middle ``shares[0]`` of the step's forward,
    from its first op there, recorded and replayed (NOTE [offload runtime] 6) and otherwise followed by hooks: the
    next shares in turn where one cannot be; None where none can."""
    forward = [op.index for op in graph.ops if op.phase == "forward"]
    for share in shares:
        recompute = _span(graph, forward, 0.5 - share / 2, 0.5 + share / 2)
        plan = _probe_plan(graph, (recompute,)) if recompute is not None else None
        if plan is not None:
            return plan.located(graph)
    return None


def recorded_pieces(graph: Graph, count: int = PIECES) -> Plan | None:
    """A located plan recording ``count`` recomputations, one in the middle of each of as many equal parts of the
    forward (``PIECE_SHARES`` of the part wide, the first that can be), or as many as can be; None where fewer than
    two can."""
    forward = [op.index for op in graph.ops if op.phase == "forward"]
    chosen: list[Recompute] = []
    for index in range(count):
        centre = (index + 0.5) / count
        for share in PIECE_SHARES:
            recompute = _span(graph, forward, centre - share / count / 2, centre + share / count / 2)
            if recompute is not None and _probe_plan(graph, (*chosen, recompute)) is not None:
                chosen.append(recompute)
                break
    plan = _probe_plan(graph, tuple(chosen)) if len(chosen) >= 2 else None
    return plan.located(graph) if plan is not None else None


def _span(graph: Graph, forward: list[int], low: float, high: float) -> Recompute | None:
    """A recomputation of every saved activation the forward's ops from share ``low`` to share ``high`` make, from
    the first of them; None where they make none."""
    first = forward[max(int(len(forward) * low), 0)]
    last = forward[min(int(len(forward) * high), len(forward) - 1)]
    ops = tuple(i for i in forward if first <= i <= last)
    uses = {t.id: t.first_backward_use for t in graph.tensors if t.producer in ops and t.saved
            and t.category == "feature_map" and t.first_backward_use is not None}
    return Recompute(tuple(uses), ops, min(uses.values())) if uses else None


def recorded_chains(graph: Graph) -> tuple[Plan, ...]:
    """``recorded_chain``s of the middle half of the forward and of nearly all of it, and ``recorded_pieces``, each
    once."""
    chains: list[Plan] = []
    for plan in (recorded_chain(graph, MIDDLE_SHARES), recorded_chain(graph, MOST_SHARES), recorded_pieces(graph)):
        if plan is not None and all(plan.recomputes != other.recomputes for other in chains):
            chains.append(plan)
    return tuple(chains)


def rerun_blocks(graph: Graph) -> Plan | None:
    """A located plan re-running (NOTE [hook points] 7) each call of the step's repeated block (a transformer's
    layers, a ResNet's bottlenecks) that can be, to restore the saved activations it makes and forward leaves alone
    after it, as checkpointing each block does; None where none can be."""
    chosen: list[Recompute] = []
    for call in repeated_block(graph):
        ops = tuple(range(call.first_op, call.last_op + 1))
        inside = set(ops)
        uses = {t.id: t.first_backward_use for t in graph.tensors if t.producer in inside and t.saved
                and t.category == "feature_map" and t.first_backward_use is not None
                and (t.last_forward_use if t.last_forward_use is not None else t.alloc_step) <= call.last_op
                and written_after(graph, t.id, call.last_op) is None}
        if not uses:
            continue
        recompute = Recompute(tuple(uses), ops, min(uses.values()))
        if _probe_plan(graph, (*chosen, recompute), rerun=True) is not None:
            chosen.append(recompute)
    return Plan("probe", graph.fingerprint, recomputes=tuple(chosen)).located(graph) if chosen else None


def _probe_plan(graph: Graph, recomputes: tuple[Recompute, ...], rerun: bool = False) -> Plan | None:
    """A plan of ``recomputes`` where it is valid, follows the step by hooks, and carries out every recomputation
    one way: recorded and replayed (NOTE [offload runtime] 6), or with ``rerun`` by re-running a module call (NOTE
    [hook points] 7); else None."""
    plan = Plan("probe", graph.fingerprint, recomputes=recomputes)
    try:
        plan.validate(graph)
    except PlanError:
        return None
    reruns = plan.reruns_in(graph)
    ways = bool(reruns) and NOT_RERUN not in reruns if rerun else all(enter == NOT_RERUN for enter in reruns)
    return plan if ways and not plan.followed_op_by_op(graph) else None
