"""A Plan: for each tensor saved for backward, keep it on the device, offload it, or recompute it.

Plain data. A Plan names tensors and ops by their index in the Graph it was made for, and
carries that graph's fingerprint so it cannot be applied to another. ``Plan.validate``
checks every rule and names the one that is broken. ``check_plan`` is the one check every
consumer of a Plan makes first (simulate, the frames, the allocator model, OffloadRuntime and
so train and measure): a plan for another step is refused everywhere with PlanForAnotherStep.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields, replace
from functools import cached_property
from pathlib import Path

from udnn_lab.errors import PlanError, PlanForAnotherStep
from udnn_lab.graph.cached import per_graph
from udnn_lab.graph.followed_calls import followed_calls
from udnn_lab.graph.hook_points import hook_points, on_hook_points, recording_windows, window_ops
from udnn_lab.graph.plan_file import read_plan_file, write_plan_file
from udnn_lab.graph.reruns import NOT_RERUN, module_reruns, rerun_calls
from udnn_lab.graph.step_graph import Graph, HookEvent, TensorInfo, op_family, writes_in_place
from udnn_lab.units import cuda_block_bytes, format_bytes


@dataclass(frozen=True)
class Offload:
    """Copy a saved tensor to host memory after forward is done with it, and back before backward needs it."""

    tensor: int  # Graph tensor id
    after_op: int  # the device-to-host copy starts when this op ends (at or after the last forward use)
    prefetch_at: int  # the host-to-device copy is issued when this op starts (before the first backward use)
    pinned: bool = True  # into the pinned host pool (else pageable memory, staged by the driver)
    wait_before: int | None = None  # this op does not start before the copy completes (vDNN's per-layer sync)
    # the device memory is let go just before this op, which waits for the copy (NOTE [offload runtime] 3);
    # None: at wait_before if set, else before the op after after_op. ul.plan fills it from the simulation.
    release_before: int | None = None

    @property
    def release_op(self) -> int:
        """The op before which the device copy is let go (NOTE [offload runtime] 3)."""
        if self.release_before is not None:
            return self.release_before
        return self.wait_before if self.wait_before is not None else self.after_op + 1


@dataclass(frozen=True)
class Recompute:
    """Drop saved tensors after their last forward use and rebuild them by re-running forward ops."""

    tensors: tuple[int, ...]  # Graph tensor ids it restores
    ops: tuple[int, ...]  # forward ops re-run, in order; each restored tensor is produced by one of them
    at_op: int  # they run just before this backward op


@dataclass(frozen=True)
class TensorSite:
    """Where the runtime meets a planned tensor: the ``position``-th new storage of op ``producer``."""

    tensor: int
    producer: int
    position: int
    nbytes: int
    held_until: int = -1  # the op after which forward lets it go (NOTE [forward holders]); -1: unknown


@dataclass(frozen=True, repr=False)
class Plan:
    """What to do with each saved tensor; every tensor not named is kept on the device."""

    policy: str
    graph_fingerprint: str
    budget_bytes: int | None = None
    offloads: tuple[Offload, ...] = ()
    recomputes: tuple[Recompute, ...] = ()
    pinned_pool_bytes: int = 0  # host pinned memory the runtime allocates once for this plan
    size_floor_bytes: int = 0  # saved tensors smaller than this are always kept
    notes: tuple[str, ...] = field(default=())
    sites: tuple[TensorSite, ...] = ()  # filled by located(): what the runtime needs without the graph
    op_count: int = 0  # ops of the step it was located in
    # op_family of each forward and backward op of that step, in order: the runtime checks them (an optimizer's
    # first step legitimately differs from the steady one the trace shows)
    op_families: tuple[str, ...] = ()
    # the step's saved-tensor hook calls, when the runtime can follow them alone (NOTE [hook points]); else ()
    hook_events: tuple[HookEvent, ...] = ()
    # auto and vdnn-dyn: the policy whose plan they chose (the innermost, when one chose another's); '' otherwise
    chosen_policy: str = ""
    # with hook events and recomputations: where the runtime records them (NOTE [hook points] 6), positions in
    # hook_events of the module calls that open and close each window (len(hook_events): the step's end)
    recording: tuple[tuple[int, int], ...] = ()
    # with hook events: for each recomputation, the position in hook_events of the 'enter' of the module call it
    # re-runs whole (NOTE [hook points] 7), or -1 where it is recorded and replayed; () when none is re-run
    reruns: tuple[int, ...] = ()
    # the located step's Graph.rebuilds_views: the runtime turns view replay on for its steps only then
    replays_views: bool = True

    def __repr__(self) -> str:
        sized = {site.tensor: site.nbytes for site in self.sites}
        offloaded = f" ({format_bytes(sum(sized.get(o.tensor, 0) for o in self.offloads))})" if sized else ""
        restored = sum(len(r.tensors) for r in self.recomputes)
        rerun = sum(len(r.ops) for r in self.recomputes)
        budget = format_bytes(self.budget_bytes) if self.budget_bytes is not None else "none"
        return (f"Plan({self.policy!r}, budget {budget}: {_count(len(self.offloads), 'tensor')} offloaded{offloaded}, "
                f"{restored} recomputed by re-running {_count(rerun, 'op')}, "
                f"pinned pool {format_bytes(self.pinned_pool_bytes)})")

    @property
    def host_pool_bytes(self) -> int:
        """Host memory the runtime sets aside for this plan: its pinned pool, or every offloaded tensor's CUDA blocks
        if that is more (the runtime's pool then holds them all at once). Needs a located plan."""
        if self.offloads and not self.sites:
            raise PlanError("host_pool_bytes needs the plan's tensor sizes: use the plan ul.plan returns, or "
                            "plan.located(graph)")
        sizes = {site.tensor: site.nbytes for site in self.sites}
        return max(self.pinned_pool_bytes, sum(cuda_block_bytes(sizes[o.tensor]) for o in self.offloads))

    @classmethod
    def keep_all(cls, graph: Graph, budget_bytes: int | None = None) -> Plan:
        """The baseline: every saved tensor stays on the device."""
        return cls(policy="keep-all", graph_fingerprint=graph.fingerprint, budget_bytes=budget_bytes)

    def located(self, graph: Graph, on_hooks: bool = True) -> Plan:
        """This plan with the sites of its tensors in ``graph``'s step, so a runtime can act on it alone.

        With ``on_hooks``, where it can, its offloads move onto hook points and it carries the
        step's hook events: the runtime then follows those hooks only (NOTE [hook points])."""
        self.check_belongs(graph)
        sites = tuple(_site(graph, t) for t in sorted(self._actions))
        followed = _followed_by_hooks(graph, self) if on_hooks else None
        located = replace(self, sites=sites, op_count=len(graph.ops), op_families=_families(graph),
                          replays_views=graph.rebuilds_views)
        if followed is None:
            return replace(located, hook_events=(), recording=(), reruns=())
        return replace(located, offloads=followed[0], hook_events=graph.hook_events, recording=followed[1],
                       reruns=followed[2])

    def followed_op_by_op(self, graph: Graph) -> bool:
        """Whether the runtime follows this plan's step op by op, under a dispatch mode (NOTE [hook points] 4),
        rather than by its module and saved-tensor hooks; False for a plan with nothing to do."""
        return bool(self.offloads or self.recomputes) and self.windows_on_hooks(graph) is None

    def windows_on_hooks(self, graph: Graph) -> tuple[tuple[int, int], ...] | None:
        """Where the runtime follows this plan by its hooks: its recording windows (NOTE [hook points] 6; () when
        it records nothing); None where it follows the step op by op."""
        followed = self._followed(graph)
        return None if followed is None else followed[1]

    def hook_actions(self) -> tuple[set[int], set[int]]:
        """A located plan's boundaries where the runtime acts on its hook calls, and the tensors it plans (NOTE
        [hook points]): forward lets a recomputed tensor go at a hook point, or in a recording window (6)."""
        held = {site.tensor: site.held_until for site in self.sites}
        return _acting(self.offloads, self.recomputes, held, self.hook_events, self.reruns)

    def hook_calls(self, graph: Graph, every_module: bool = False) -> dict[int, int]:
        """Boundary -> the module and saved-tensor hook calls the runtime handles there when it follows this plan
        by its hooks (NOTE [hook points] 5; priced by NOTE [simulated streams] 6); {} when there is nothing to do
        or it follows the step op by op. ``every_module``: as a runtime made without the model hooks every module
        call (NOTE [hook points] 8)."""
        followed = self._followed(graph) if self.offloads or self.recomputes else None
        if followed is None:
            return {}
        held = {t: _site(graph, t).held_until for r in self.recomputes for t in r.tensors}
        events = graph.hook_events
        return followed_calls(events, *_acting(followed[0], self.recomputes, held, events, followed[2]), followed[1],
                              rerun_calls(events, followed[2], self.recomputes), not every_module).calls_at(events)

    def reruns_in(self, graph: Graph) -> tuple[int, ...]:
        """For each recomputation, where the runtime re-runs a module call for it (NOTE [hook points] 7) or -1;
        () when it re-runs none."""
        followed = self._followed(graph) if self.recomputes else None
        return () if followed is None else followed[2]

    def _followed(self, graph: Graph) -> _Followed | None:
        if self.sites:  # located: it carries the step's hook events exactly when it is followed by them
            return (self.offloads, self.recording, self.reruns) if self.hook_events else None
        key = (id(graph), graph.fingerprint)
        if key not in self._followed_in:
            self._followed_in[key] = _followed_by_hooks(graph, self)
        return self._followed_in[key]

    @cached_property
    def _followed_in(self) -> dict:
        """Graph -> how the runtime would follow this plan there: a simulation and its pricing ask more than once."""
        return {}

    def dispatched_ops(self, graph: Graph) -> tuple[range, ...]:
        """The ops of ``graph``'s step that the runtime sees through a dispatch mode under this plan: every op
        when it follows the step op by op, those of its recording windows when it follows the hooks (NOTE [hook
        points] 6), none when there is nothing to do."""
        if not (self.offloads or self.recomputes):
            return ()
        return window_ops(graph.hook_events, self.windows_on_hooks(graph), len(graph.ops))

    def with_releases(self, released_before: Mapping[int, int]) -> Plan:
        """This plan with each offload's release point set where a simulation let its memory go.

        An offload the simulation never freed (its prefetch came first) gets its prefetch op:
        the tensor stays on the device, as simulated."""
        offloads = tuple(o if o.release_before is not None
                         else replace(o, release_before=released_before.get(o.tensor, o.prefetch_at))
                         for o in self.offloads)
        return replace(self, offloads=offloads)

    def action(self, tensor: int) -> Offload | Recompute | None:
        """The plan's action for a tensor id (None: keep it)."""
        return self._actions.get(tensor)

    @cached_property
    def _actions(self) -> dict[int, Offload | Recompute]:
        actions: dict[int, Offload | Recompute] = {o.tensor: o for o in self.offloads}
        actions.update({t: r for r in self.recomputes for t in r.tensors})
        return actions

    def save(self, path: str | Path) -> Path:
        """Write this plan to ``path`` as a plan file (JSON, graph/plan_file.py), for ``Plan.load`` in another
        process: the training job a launcher starts. A plan that acts must be located (as ul.plan returns it)."""
        if (self.offloads or self.recomputes) and not self.sites:
            raise PlanError("only a located plan can be saved: the one ul.plan returns, or plan.located(graph); "
                            "the job that loads it has no graph to locate it with")
        return write_plan_file(asdict(self), path)

    @classmethod
    def load(cls, path: str | Path, graph: Graph | None = None) -> Plan:
        """The plan saved at ``path`` by ``Plan.save``; with ``graph``, refused unless made for that graph's step
        (without one, the runtime refuses another step at its first difference)."""
        plan = _from_fields(read_plan_file(path), Path(path))
        if graph is not None:
            check_plan(plan, graph)
        return plan

    def check_belongs(self, graph: Graph) -> None:
        """Refuse ``graph`` unless this plan was made for its step (``check_plan``)."""
        check_plan(self, graph)

    def validate(self, graph: Graph) -> None:
        """Raise PlanError naming the first broken rule."""
        self.check_belongs(graph)
        seen: set[int] = set()
        for tensor in [o.tensor for o in self.offloads] + [t for r in self.recomputes for t in r.tensors]:
            if tensor in seen:
                raise PlanError(f"tensor {graph.tensors[tensor].name} has more than one action")
            seen.add(tensor)
            _check_tensor(graph, tensor)
        for offload in self.offloads:
            _check_offload(graph, offload)
        for recompute in self.recomputes:
            check_recompute(graph, recompute, seen)
        if self.pinned_pool_bytes < 0 or self.size_floor_bytes < 0:
            raise PlanError("pinned_pool_bytes and size_floor_bytes cannot be negative")


def check_plan(plan: Plan | None, graph: Graph | None = None) -> Plan | None:
    """The one check every consumer of a Plan makes before it uses one; returns the plan.

    With ``graph`` (simulate, the frames, the allocator model, measure where it traced the step) the plan
    must be made for that graph's step. Without one (OffloadRuntime, and so train and measure) a plan that
    acts must be located; the runtime then meets the step as it runs and refuses another at its first
    difference with ``other_step`` (NOTE [offload runtime] 1), even a plan that moves nothing, wherever it
    carries the step's hook events. Either way the error is PlanForAnotherStep.
    """
    if plan is None:
        return None
    if not isinstance(plan, Plan):
        raise TypeError(f"plan must be a Plan (from ul.plan(graph, ...)), got {type(plan).__name__}")
    if graph is not None and plan.graph_fingerprint != graph.fingerprint:
        raise other_step(f"this {plan.policy!r} plan was made for another graph than {graph.model_name}'s: "
                         f"{_difference(plan, graph)}; plan again for this step: ul.plan(graph, ...)",
                         f"the plan's graph fingerprint is {plan.graph_fingerprint[:12]}, this graph's "
                         f"{graph.fingerprint[:12]}",
                         "a plan names ops and tensors by their place in the step it was traced from, so it "
                         "acts on that step only")
    if graph is None and (plan.offloads or plan.recomputes) and not plan.sites:
        raise ValueError("this plan does not say where its tensors are made: make it with ul.plan(graph, ...) "
                         "or call plan.located(graph) first")
    return plan


def _from_fields(values: dict, source: Path) -> Plan:
    """A Plan from the fields a plan file holds (nested lists back into tuples and dataclasses)."""
    known = {f.name for f in fields(Plan)}
    if set(values) != known:
        raise PlanError(f"{source} holds a plan with other fields than this udnn_lab's (missing: "
                        f"{sorted(known - set(values)) or 'none'}; unknown: {sorted(set(values) - known) or 'none'}): "
                        "plan again")
    try:
        return Plan(
            policy=values["policy"], graph_fingerprint=values["graph_fingerprint"], budget_bytes=values["budget_bytes"],
            offloads=tuple(Offload(**o) for o in values["offloads"]),
            recomputes=tuple(Recompute(tuple(r["tensors"]), tuple(r["ops"]), r["at_op"]) for r in values["recomputes"]),
            pinned_pool_bytes=values["pinned_pool_bytes"], size_floor_bytes=values["size_floor_bytes"],
            notes=tuple(values["notes"]), sites=tuple(TensorSite(**s) for s in values["sites"]),
            op_count=values["op_count"], op_families=tuple(values["op_families"]),
            hook_events=tuple(HookEvent(**{**e, "shape": tuple(e["shape"])}) for e in values["hook_events"]),
            chosen_policy=values["chosen_policy"], recording=tuple(tuple(w) for w in values["recording"]),
            reruns=tuple(values["reruns"]), replays_views=values["replays_views"])
    except (TypeError, KeyError) as err:
        raise PlanError(f"{source} holds a plan this udnn_lab cannot read ({type(err).__name__}: {err}): "
                        "plan again") from None


def other_step(first: str, *details: str) -> PlanForAnotherStep:
    """The error for a plan used with another step: ``first`` is one line (the first difference, what to do),
    ``details`` go on the lines below it."""
    return PlanForAnotherStep("\n".join((first, *(f"  {detail}" for detail in details))))


def _families(graph: Graph) -> tuple[str, ...]:
    """The op_family of each forward and backward op of the step, in order: what a runtime checks op by op."""
    return tuple(op_family(op.name) for op in graph.ops if op.phase != "optimizer")


def _difference(plan: Plan, graph: Graph) -> str:
    """The first difference between the plan's step and the graph's, in words."""
    if not plan.op_families:
        return "its step's ops or tensor sizes differ"
    ours = _families(graph)
    first = next((i for i, (a, b) in enumerate(zip(ours, plan.op_families)) if a != b), None)
    if first is not None:
        return f"op {first} of this step is {ours[first]}, the plan's step's is {plan.op_families[first]}"
    if len(ours) != len(plan.op_families):
        return f"this step has {len(ours)} forward and backward ops, the plan's {len(plan.op_families)}"
    return "the same forward and backward ops, with another optimizer step or other tensor sizes (batch, input size)"


# the offloads on hook points, the recording windows, the module calls re-run (NOTE [hook points] 2, 6, 7)
_Followed = tuple[tuple[Offload, ...], tuple[tuple[int, int], ...], tuple[int, ...]]


def _followed_by_hooks(graph: Graph, plan: Plan) -> _Followed | None:
    """The plan's offloads moved onto hook points, its recording windows and the module calls it re-runs, when
    the runtime can follow it by its module and saved-tensor hooks (NOTE [hook points]); None when it follows the
    step op by op."""
    if not graph.hook_events:
        return None
    moved = on_hook_points(graph, plan.offloads)
    if moved is None or not plan.recomputes:
        return None if moved is None else (moved, (), ())
    points = set(hook_points(graph.hook_events))
    if not {r.at_op for r in plan.recomputes} <= points:
        return None
    reruns = module_reruns(graph, plan.recomputes)
    spans = []  # each recorded recomputation's ops, and the ops before which forward lets go where no hook is
    for index, recompute in enumerate(plan.recomputes):
        if reruns and reruns[index] != NOT_RERUN:
            continue
        let_go = [_site(graph, t).held_until + 1 for t in recompute.tensors]
        spans.append((min(recompute.ops), max([*recompute.ops, *(b for b in let_go if b not in points)])))
    windows = recording_windows(graph.hook_events, spans)
    return None if windows is None else (moved, windows, reruns)


def _acting(offloads: tuple[Offload, ...], recomputes: tuple[Recompute, ...], held_until: Mapping[int, int],
            events: tuple[HookEvent, ...], reruns: tuple[int, ...] = ()) -> tuple[set[int], set[int]]:
    """The boundaries a runtime following hooks acts at, and the tensors it plans (NOTE [hook points] 2, 6): forward
    lets a recomputed tensor go at a hook point, but one a module re-run restores by itself (7)."""
    recomputed = {t for r in recomputes for t in r.tensors}
    let_go = {held_until[t] + 1 for i, r in enumerate(recomputes) for t in r.tensors
              if not reruns or reruns[i] == NOT_RERUN} & {event.boundary for event in events}
    acting = {o.after_op + 1 for o in offloads} | {o.prefetch_at for o in offloads} | {o.release_op for o in offloads} \
        | {o.wait_before for o in offloads if o.wait_before is not None} | {r.at_op for r in recomputes} | let_go
    return acting, {o.tensor for o in offloads} | recomputed


def _site(graph: Graph, tensor_id: int) -> TensorSite:
    tensor = graph.tensors[tensor_id]
    if tensor.producer is None:
        raise PlanError(f"{tensor.name} exists before the step, so the runtime cannot find it among the tensors "
                        "the step makes: plan only those (the input batch stays with the training loop)")
    uses = [u for u in (tensor.last_forward_use, tensor.forward_release) if u is not None]
    return TensorSite(tensor_id, tensor.producer, graph.ops[tensor.producer].allocated.index(tensor_id), tensor.nbytes,
                      max(uses) if uses else -1)


def _check_tensor(graph: Graph, tensor_id: int) -> None:
    if not 0 <= tensor_id < len(graph.tensors):
        raise PlanError(f"tensor id {tensor_id} is not in this graph (it has {len(graph.tensors)} tensors)")
    tensor = graph.tensors[tensor_id]
    if tensor.category in ("parameter", "buffer"):
        raise PlanError(f"{tensor.name} is a {tensor.category}: parameters and buffers are never offloaded "
                        "or recomputed")
    if not tensor.saved or tensor.first_backward_use is None:
        raise PlanError(f"{tensor.name} is not saved for backward, so there is nothing to offload or recompute")
    if not graph.on_device(tensor):
        # a fused attention kernel's dropout seed lives in host memory, and its backward reads it there
        raise PlanError(f"{tensor.name} lives on {tensor.device}, not on this step's {graph.device}: only the "
                        "device's tensors are offloaded or recomputed")


def _check_offload(graph: Graph, offload: Offload) -> None:
    tensor = graph.tensors[offload.tensor]
    last_forward = tensor.last_forward_use if tensor.last_forward_use is not None else tensor.alloc_step
    if offload.after_op < last_forward:
        raise PlanError(f"{tensor.name} is offloaded after op {offload.after_op}, before its last forward use "
                        f"(op {last_forward}, {graph.ops[last_forward].module or 'the model'}): a later layer "
                        "still reads it")
    assert tensor.first_backward_use is not None  # _check_tensor ran first
    if offload.prefetch_at >= tensor.first_backward_use:
        raise PlanError(f"{tensor.name} is prefetched at op {offload.prefetch_at}, not before its first backward "
                        f"use (op {tensor.first_backward_use})")
    if offload.release_before is not None and offload.release_before <= offload.after_op:
        raise PlanError(f"{tensor.name} is released before op {offload.release_before}, before its copy to the host "
                        f"starts (after op {offload.after_op})")
    if offload.prefetch_at <= offload.after_op:
        raise PlanError(f"{tensor.name} is prefetched (op {offload.prefetch_at}) before it is offloaded "
                        f"(after op {offload.after_op})")


def check_recompute(graph: Graph, recompute: Recompute, dropped: set[int]) -> None:
    names = ", ".join(graph.tensors[t].name for t in recompute.tensors)
    if not recompute.tensors or not recompute.ops:
        raise PlanError("a recomputation needs the tensors it restores and the ops that rebuild them")
    for tensor_id in recompute.tensors:
        tensor = graph.tensors[tensor_id]
        assert tensor.first_backward_use is not None  # validate checked it first; planners pass candidates
        if tensor.producer not in recompute.ops:
            raise PlanError(f"recomputing {tensor.name} must re-run its producer, op {tensor.producer}")
        if recompute.at_op > tensor.first_backward_use:
            raise PlanError(f"{tensor.name} is recomputed at op {recompute.at_op}, after its first backward use "
                            f"(op {tensor.first_backward_use})")
    if list(recompute.ops) != sorted(recompute.ops):
        raise PlanError(f"recomputing {names}: ops must be re-run in their forward order")
    made: set[int] = set()
    for index in recompute.ops:
        op = graph.ops[index]
        if op.phase != "forward":
            raise PlanError(f"recomputing {names} re-runs op {index}, which is not a forward op")
        for source in op.inputs:
            _check_source(graph, names, source, made, dropped, recompute.at_op)
            writer = written_after(graph, source, index) if source not in made else None
            if writer is not None:
                raise PlanError(f"recomputing {names} reads {graph.tensors[source].name} at op {index}, which op "
                                f"{writer} then writes in place: forward cannot be replayed from it")
        made.update(op.outputs)


def replay_reads(graph: Graph, ops: tuple[int, ...] | list[int] | set[int]) -> set[int]:
    """What a replay of ``ops`` (in forward order) reads that it has not made itself by then: its sources. A tensor
    an earlier op reads and a later one writes in place is one of them, though the replay also outputs it."""
    made: set[int] = set()
    reads: set[int] = set()
    for index in sorted(ops):
        reads.update(t for t in graph.ops[index].inputs if t not in made)
        made.update(graph.ops[index].outputs)
    return reads


def written_after(graph: Graph, tensor_id: int, op: int) -> int | None:
    """The first forward op after ``op`` that writes into the tensor in place (None if none does)."""
    tensor = graph.tensors[tensor_id]
    if tensor.category in ("parameter", "buffer"):
        return None  # the optimizer's and running statistics' writes come after any replay, or are cloned
    return next((j for j in tensor.consumers if j > op and graph.ops[j].phase == "forward"
                 and tensor_id in graph.ops[j].outputs and writes_in_place(graph.ops[j].name)), None)


def kept_by_the_step(tensor: TensorInfo) -> bool:
    """A parameter, buffer or input the step holds to its end, so any replay may read it. Not an FSDP2
    parameter's unsharded storage, which is let go after its module's forward (resharded) and gathered again
    only in its module's backward (``gathered_at``); holding the tensor does not keep it (NOTE [resized
    storages] 1)."""
    if tensor.category == "parameter":
        return tensor.free_step is None
    return tensor.category in ("buffer", "input")  # a step's constants too: a replay holds what it reads


def gathered_at(graph: Graph, tensor_id: int, op: int) -> bool:
    """Whether a parameter's storage holds it just before ``op``: kept by the step, or an FSDP2 unsharded
    parameter that its module's backward has gathered again by then (a storage of the same name, live there)."""
    tensor = graph.tensors[tensor_id]
    if tensor.free_step is None or tensor.free_step >= op:
        return True
    lives = _unsharded_lives(graph).get(tensor.name, ())
    return any(alloc < op and (free is None or free >= op) for alloc, free in lives)


@per_graph
def _unsharded_lives(graph: Graph) -> dict[str, list[tuple[int, int | None]]]:
    """Each parameter storage the step frees, by name: when it is live (FSDP2's gathers of one parameter)."""
    lives: dict[str, list[tuple[int, int | None]]] = {}
    for t in graph.tensors:
        if t.category == "parameter" and t.alloc_step >= 0:
            lives.setdefault(t.name, []).append((t.alloc_step, t.free_step))
    return lives


def _check_source(graph: Graph, names: str, source: int, made: set[int], dropped: set[int], at_op: int) -> None:
    tensor = graph.tensors[source]
    if source in made or kept_by_the_step(tensor):
        return
    if tensor.category == "parameter" and not gathered_at(graph, source, at_op):
        raise PlanError(f"recomputing {names} reads {tensor.name}, which FSDP2 lets go after its module's forward "
                        f"(op {tensor.free_step}) and has not gathered again by op {at_op}: recompute there from "
                        "tensors that stay, or later, in that module's backward")
    if source in dropped:
        raise PlanError(f"recomputing {names} needs {tensor.name}, which the plan also drops: recompute sources "
                        "must stay available")
    # one forward lets go before the recomputation stays: the runtime holds it (NOTE [simulated streams] 1)


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"
