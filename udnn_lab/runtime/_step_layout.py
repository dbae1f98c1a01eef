"""Where a plan acts in its step, by op index: worked out once per plan, read by each step that follows it.

A step under the runtime starts every training iteration; what it needs of the plan alone (which tensors each
op makes, releases or prefetches, which recomputations record which ops) is the same every time, so a step
only makes its own mutable state (its slots and replays) and reads the rest from here.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass

from udnn_lab.graph.plan_ir import Plan, TensorSite


@dataclass(frozen=True)
class StepLayout:
    """A plan's actions by op index; tensors by Graph id, recomputations by their index in ``plan.recomputes``."""

    site_of: Mapping[int, TensorSite]  # planned tensor -> where the step makes it
    sites: Mapping[int, tuple[TensorSite, ...]]  # producing op -> the planned tensors it makes
    let_go: Mapping[int, tuple[int, ...]]  # op -> recomputed tensors forward lets go before it
    offload_after: Mapping[int, tuple[int, ...]]  # op -> offloaded tensors copied out after it
    prefetch_at: Mapping[int, tuple[int, ...]]
    release_at: Mapping[int, tuple[int, ...]]
    wait_at: Mapping[int, tuple[int, ...]]  # vDNN's per-layer sync: op -> offloads compute waits for before it
    replay_at: Mapping[int, tuple[int, ...]]  # op -> recomputations run after it
    recording: Mapping[int, tuple[int, ...]]  # op -> recomputations that record it (those not re-running a call)
    acted_at: frozenset[int]  # every op at which anything above happens

    @classmethod
    def of(cls, plan: Plan, reruns: Collection[int] = ()) -> StepLayout:
        """``reruns``: the recomputations carried out by re-running a module call, which record no ops."""
        planned = {o.tensor for o in plan.offloads} | {t for r in plan.recomputes for t in r.tensors}
        recomputed = {t for r in plan.recomputes for t in r.tensors}
        sites: dict[int, list[TensorSite]] = {}
        let_go: dict[int, list[int]] = {}
        for site in plan.sites:
            if site.tensor in planned:  # a plan edited after located() may list sites it no longer acts on
                sites.setdefault(site.producer, []).append(site)
                if site.tensor in recomputed:  # a tensor both offloaded and recomputed is recomputed
                    let_go.setdefault(site.held_until + 1, []).append(site.tensor)
        recording: dict[int, list[int]] = {}
        replay_at: dict[int, list[int]] = {}
        for index, recompute in enumerate(plan.recomputes):
            if index not in reruns:
                for op in recompute.ops:
                    recording.setdefault(op, []).append(index)
            # autograd unpacks a node's saved tensors before the node's first op: replay after the op before
            replay_at.setdefault(recompute.at_op - 1, []).append(index)
        by_op = {
            "offload_after": _tensors_by(plan, "after_op"), "prefetch_at": _tensors_by(plan, "prefetch_at"),
            "release_at": _tensors_by(plan, "release_op"), "wait_at": _tensors_by(plan, "wait_before"),
            "sites": _frozen(sites), "let_go": _frozen(let_go), "replay_at": _frozen(replay_at),
            "recording": _frozen(recording)}
        acted_at = frozenset(op for grouped in by_op.values() for op in grouped)
        return cls(site_of={site.tensor: site for site in plan.sites}, acted_at=acted_at, **by_op)


def _tensors_by(plan: Plan, field_name: str) -> dict[int, tuple[int, ...]]:
    grouped: dict[int, list[int]] = {}
    for offload in plan.offloads:
        op = getattr(offload, field_name)
        if op is not None:
            grouped.setdefault(op, []).append(offload.tensor)
    return _frozen(grouped)


def _frozen(grouped: Mapping[int, list]) -> dict[int, tuple]:
    return {op: tuple(values) for op, values in grouped.items()}
