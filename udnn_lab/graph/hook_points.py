"""Where a runtime that follows only autograd's saved-tensor hooks can act on a plan.

NOTE [hook points]
  1. Without a dispatch mode over every op, a runtime sees the step only when a module's
     forward starts or returns, when autograd packs a tensor for backward (an op's inputs
     before it runs, its outputs after) and when a backward node unpacks one (as it
     starts). Boundary ``b`` is "after op b - 1, before op b"; it is a hook point when such
     a call happens there in the traced step (``Graph.hook_events``), and a real step of
     the same model makes the same calls in the same order.
  2. ``Plan.located`` moves each offload's actions onto hook points, each first in the
     direction that never raises memory at any op: the copy to the host starts at the
     first hook point at or after its planned start (never before the tensor is first
     packed: that is where the runtime meets it); the device copy is let go at the last
     hook point at or before its planned release, but not before the copy starts (compute
     may wait longer for the copy; the memory leaves no later); vDNN's sync moves the same
     way (to the release, when there is no hook point between the copy's start and the
     sync); the prefetch is issued at the first hook point at or after its planned op and
     before the tensor's first backward use (the buffer is allocated no earlier). Where
     there is no such hook point, a release moves later and a prefetch earlier, which can
     raise memory: ``ul.plan`` keeps a moved plan only when its simulation still fits the
     budget (with no budget: when its peak is no higher), else it keeps the plan as made.
     The simulation of the moved plan is what the runtime does.
  3. A planned tensor's release point comes after its last use in forward, so every
     forward write into it comes before the runtime lets go of the alias autograd saved
     and reads its version (NOTE [offload runtime] 5).
  4. A plan with an offload that has no hook point where one is needed, or with a
     recomputation that cannot be recorded in windows (6), is not moved: the runtime follows
     it op by op, with a dispatch mode.
  5. Windows. A saved-tensor hook is a Python call for every tensor autograd saves, which
     costs about what the step's own host work per op does; so the runtime keeps its hooks
     on only in windows: the module calls that hold a pack of a planned tensor (innermost
     first), and the stretches between calls made outside every module (the loss, after
     the forward). Module calls are followed throughout (of the modules hooked: 8). A window
     opens at a call's enter and closes at its exit (or at the next top-level enter, or the
     step's end), so the runtime's hooks go on and off at the top of autograd's stack of
     hooks, and only where the trace saw no hooks pushed inside the step in force
     (``HookEvent.own_hooks``). The runtime then sees those module calls, the packs inside
     windows and their unpacks, in the traced order; an acting boundary with none of those
     gets the window of one of its packs (of an unpack's pack in backward). Where no window
     can hold what is needed, the hooks stay on for the whole step. Outside windows the step
     is checked by its hooked module calls only (class and mode): a change between them,
     other than in the loss, goes unseen there.
  6. Recording windows. A recomputation replays the forward ops it names, so the runtime must
     see those ops: a dispatch mode records them, on only from the last module call (enter or
     exit) at or before the first of them to the first module call after the last, or to the
     step's end where there is none (``recording_windows``; windows that overlap are one). It
     counts ops from the boundary it opens at, so op indices are the plan's there. The replay
     runs at the recomputation's op, which must be a hook point (the first unpack of its node),
     else the plan is followed op by op (4). Forward lets a recomputed tensor go before the op
     after its last forward use: at that hook point, or, where it is none, the window reaches
     that op and the mode lets go there. Outside the windows no op goes through Python; the
     simulator charges the mode's host time to the ops inside them only (NOTE [simulated
     streams] 6).
  7. Module re-runs. A recomputation whose ops are exactly one module call's forward needs no
     recording window: as non-reentrant torch.utils.checkpoint does, the runtime keeps that
     call's arguments (detached, each as it required grad; taken at its 'exit', where the
     module hook sees keyword arguments too), and at its 'enter' the generators' states and
     autocast's; at the recomputation's op it calls the module's forward again under them, with
     grad on and its own saved-tensor hooks, and the i-th pack of the re-run is the i-th pack
     of the traced call: those of the restored tensors are kept (each checked against the
     trace's dtype and shape, and their count against the trace's), every other is dropped.
     BatchNorm's running statistics, which it writes undeclared, are swapped for copies during
     the re-run, so buffers stay as eager leaves them. The runtime holds no alias of a restored
     tensor past its pack, so forward lets it go where it would without hooks, at no hook point
     if need be; a write into it after it was saved, which eager refuses in backward, then goes
     unseen (as under checkpoint: the re-run, not forward's tensor, is what backward reads). It
     qualifies (``graph/reruns.py``) only where no op of the call writes in place into a tensor
     from before it (a parameter, buffer or input included) or is a collective, and no
     saved-tensor hooks are pushed inside the step around it. A module whose own forward pre-hooks
     run ops (FSDP2's all-gather of its parameters) re-runs its forward alone: the recomputation is
     the ops of ``forward`` (its ModuleCall's), and the pre-hooks' ops, which save nothing, are not
     run again; under FSDP2 the parameters are there, gathered by the module's pre-backward hook
     before any of its backward unpacks (``gathered_at`` in plan_ir.py). The module's
     Python runs again as it did in forward, without the runtime's global module hooks (they are
     removed while it runs, so torch calls its modules on its fast path, as under checkpoint;
     the few modules hooked alone, 8, keep their hooks, which let the re-run's calls pass): the
     simulator charges no per-op replay, only a hook call per pack inside the call (NOTE
     [simulated streams] 6).
  8. Hooked modules. A global module hook sends every module call through torch's slow path
     and a Python call; the runtime needs only the module calls it acts at: those where a
     window opens or closes (5), a recording window opens or closes (6), a re-run call enters
     or leaves (7), or that stand for an acting boundary (``followed_calls``; in forward a
     boundary's last pack stands for it where it has one, so that fewer modules need hooks,
     and a planned pack inside a re-run call opens that call's window). Given the traced model,
     it hooks just those calls' modules, by the path the trace recorded for each
     (``HookEvent.path``: the first name ``named_modules`` gives it), ahead of the module's
     other hooks, so it sees every call of those modules (a module called twice, twice), the
     packs inside its windows and their unpacks, in the traced order; every other module call
     runs on torch's fast path, as under checkpoint. The step is checked at those calls, and
     as it starts every traced module's mode (train or eval) is checked. Where a needed call's
     module is outside the traced model (a loss module), where the runtime is not given the
     model, where the model holds another class at a traced path, or where the plan moves
     nothing (it is followed only to refuse another step), the runtime hooks every module
     globally and checks every call. The simulator prices the calls of the first case
     (``Plan.hook_calls``): a runtime without the model pays more than it says.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Collection, Iterable
from dataclasses import replace

from udnn_lab.graph.step_graph import Graph, HookEvent


def hook_points(events: tuple[HookEvent, ...]) -> list[int]:
    """The sorted boundaries at which a saved-tensor hook is called (NOTE [hook points] 1)."""
    return sorted({event.boundary for event in events})


def first_packs(events: tuple[HookEvent, ...]) -> dict[int, int]:
    """Graph tensor id -> the boundary of its first pack: where the runtime meets it."""
    found: dict[int, int] = {}
    for event in events:
        if event.kind == "pack":
            found.setdefault(event.tensor, event.boundary)
    return found


def on_hook_points(graph: Graph, offloads: tuple) -> tuple | None:
    """``offloads`` moved onto hook points (NOTE [hook points] 2), or None when one cannot be (4)."""
    points = hook_points(graph.hook_events)
    met = first_packs(graph.hook_events)
    moved = []
    for offload in offloads:
        first_use = graph.tensors[offload.tensor].first_backward_use
        if offload.tensor not in met or first_use is None:
            return None
        start = _first_in(points, max(offload.after_op + 1, met[offload.tensor]), first_use)
        if start is None:
            return None
        prefetch = _either(_first_in(points, offload.prefetch_at, first_use),
                           _last_in(points, start + 1, offload.prefetch_at))
        if prefetch is None:
            return None
        release = _either(_last_in(points, start, offload.release_op),
                          _first_in(points, offload.release_op, prefetch + 1))
        if release is None:
            return None
        wait = None
        if offload.wait_before is not None:  # before the copy starts it is the release's wait, which comes anyway
            wait = _either(_last_in(points, start, offload.wait_before), release)
        moved.append(replace(offload, after_op=start - 1, release_before=release, prefetch_at=prefetch,
                             wait_before=wait))
    return tuple(moved)


def recording_windows(events: tuple[HookEvent, ...],
                      spans: Iterable[tuple[int, int]]) -> tuple[tuple[int, int], ...] | None:
    """NOTE [hook points] 6: (opening, closing) positions in ``events`` of the module calls between which a
    dispatch mode sees each span of ops (first, last), merged where they overlap. A span with no module call
    after it closes at the step's end (``len(events)``); None where one has no module call at or before it."""
    calls = [(ordinal, event.boundary) for ordinal, event in enumerate(events) if event.kind in ("enter", "exit")]
    boundaries = [boundary for _, boundary in calls]
    windows = []
    for first, last in spans:
        opening = bisect_right(boundaries, first) - 1  # the last call at or before the first op
        closing = bisect_right(boundaries, last)  # the first call after the last op
        if opening < 0:
            return None
        windows.append((calls[opening][0], calls[closing][0] if closing < len(calls) else len(events)))
    merged: list[tuple[int, int]] = []
    for opening, closing in sorted(windows):
        if merged and opening <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], closing))
        else:
            merged.append((opening, closing))
    return tuple(merged)


def window_ops(events: tuple[HookEvent, ...], windows: tuple[tuple[int, int], ...] | None,
               op_count: int) -> tuple[range, ...]:
    """The ops a dispatch mode sees in recording ``windows`` (NOTE [hook points] 6); None: every op (op by op)."""
    if windows is None:
        return (range(op_count),)
    return tuple(range(events[opening].boundary, events[closing].boundary if closing < len(events) else op_count)
                 for opening, closing in windows)


# -- windows (NOTE [hook points] 5) -------------------------------------------------------------
# A window is named by the position of the event that opens it: a module call's 'enter' (it closes at
# that call's 'exit'), or the 'exit' of a call made outside every module (it closes at the next such
# call's 'enter', or at the end of the step).

def saved_tensor_windows(events: tuple[HookEvent, ...], acting: set[int], planned: Collection[int],
                         within: Collection[tuple[int, int]] = ()) -> set[int] | None:
    """The windows that show every pack of a planned tensor, every top-level pack (the loss: the
    step's fingerprint), and a call at each acting boundary; None when one cannot be opened. A
    planned pack inside one of the calls ``within`` (enter, exit: the re-run calls, NOTE [hook
    points] 7) gets that call's window, whose module calls are hooked anyway (8): every pack of a
    re-run call is handled again when it re-runs, as checkpoint handles each."""
    return _windows_seen(events, acting, planned, within)[0]


def _windows_seen(events: tuple[HookEvent, ...], acting: set[int], planned: Collection[int],
                  within: Collection[tuple[int, int]] = ()) -> tuple[set[int] | None, list[bool]]:
    """``saved_tensor_windows`` and which events a runtime sees with them (every one where there are none)."""
    calls = _calls(events)
    chosen = {start for start, (kind, _) in calls.items() if kind == "gap"}
    outer = [(enter, exit_) for enter, exit_ in within if calls.get(enter) == ("call", exit_)]
    for ordinal, event in enumerate(events):
        if event.kind == "pack" and event.tensor in planned:
            holder = next((enter for enter, exit_ in outer if enter < ordinal < exit_), None)
            if holder is not None:
                chosen.add(holder)
            elif not _add_window(ordinal, calls, chosen):
                return None, [True] * len(events)
    visible, _ = _seen(events, calls, chosen)
    by_boundary: dict[int, list[int]] = {}
    for ordinal, event in enumerate(events):
        by_boundary.setdefault(event.boundary, []).append(ordinal)
    for boundary in acting:  # a call that stands for it must be seen
        at_boundary = by_boundary.get(boundary, [])
        if any(visible[i] for i in at_boundary):
            continue
        unpacks = [i for i in at_boundary if events[i].kind == "unpack"]
        needed = events[unpacks[0]].packed_at if unpacks else at_boundary[-1] if at_boundary else -1
        if needed < 0 or not _add_window(needed, calls, chosen):
            return None, [True] * len(events)
        visible, _ = _seen(events, calls, chosen)
    return chosen, visible


def _calls(events: tuple[HookEvent, ...]) -> dict[int, tuple[str, int]]:
    """The windows that can be opened: start -> ('call', its end) or ('gap', its end; len(events): the step's).

    Only where no hooks pushed inside the step are in force (``own_hooks``), so that the
    runtime's hooks go on and off at the top of autograd's stack of hooks."""
    calls: dict[int, tuple[str, int]] = {}
    stack: list[int] = []
    gap: int | None = None
    for ordinal, event in enumerate(events):
        if event.kind == "enter":
            if not stack and gap is not None and event.own_hooks:
                calls[gap] = ("gap", ordinal)
                gap = None
            stack.append(ordinal)
        elif event.kind == "exit" and stack:
            start = stack.pop()
            if events[start].own_hooks and event.own_hooks:
                calls[start] = ("call", ordinal)
            if not stack and event.own_hooks and gap is None:
                gap = ordinal
    if gap is not None:
        calls[gap] = ("gap", len(events))
    return calls


def _add_window(pack: int, calls: dict[int, tuple[str, int]], chosen: set[int]) -> bool:
    """Open the innermost window that holds event ``pack``; False when none can."""
    holder = max((start for start, (_, end) in calls.items() if start < pack < end), default=None)
    if holder is None:
        return False
    chosen.add(holder)
    return True


def seen_in_windows(events: tuple[HookEvent, ...], windows: set[int]) -> tuple[list[bool], list[bool]]:
    """With hooks in force inside ``windows``: which events a runtime sees (every module call, the
    packs inside a window, the unpacks of those packs), and whether hooks are on after each event."""
    return _seen(events, _calls(events), windows)


def _seen(events: tuple[HookEvent, ...], calls: dict[int, tuple[str, int]],
          windows: set[int]) -> tuple[list[bool], list[bool]]:
    ends = {start: calls[start][1] for start in windows}
    shown, on = [False] * len(events), [False] * len(events)
    open_until: list[int] = []  # ends of the open windows, innermost last (windows nest)
    for ordinal, event in enumerate(events):
        while open_until and open_until[-1] <= ordinal:
            open_until.pop()
        if event.kind in ("enter", "exit"):
            shown[ordinal] = True
            if ordinal in ends:
                open_until.append(ends[ordinal])
        elif event.kind == "pack":
            shown[ordinal] = bool(open_until)
        else:
            shown[ordinal] = event.packed_at >= 0 and shown[event.packed_at]
        on[ordinal] = bool(open_until)
    return shown, on


def _either(preferred: int | None, otherwise: int | None) -> int | None:
    return preferred if preferred is not None else otherwise


def _first_in(points: list[int], low: int, below: int) -> int | None:
    """The first hook point ``p`` with ``low <= p < below``."""
    at = bisect_left(points, low)
    return points[at] if at < len(points) and points[at] < below else None


def _last_in(points: list[int], low: int, high: int) -> int | None:
    """The last hook point ``p`` with ``low <= p <= high``."""
    at = bisect_right(points, high) - 1
    return points[at] if at >= 0 and points[at] >= low else None
