"""The hook calls a runtime following a plan by its hooks sees, and what it does at each (NOTE [hook points] 5-8).

One account for the runtime, which counts and acts on these calls, and for the simulator, which prices them.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass
from types import MappingProxyType

from udnn_lab.graph.hook_points import saved_tensor_windows, seen_in_windows
from udnn_lab.graph.reruns import RerunCall
from udnn_lab.graph.step_graph import HookEvent


@dataclass(frozen=True)
class FollowedCalls:
    """The step's hook events a runtime sees, and its actions, each keyed by the event's position in the step's
    hook events (not among those seen)."""

    seen: tuple[bool, ...]  # per event: the runtime's hooks are called there
    whole_step: bool  # saved-tensor hooks in force from start to finish (no window could be opened)
    switches: Mapping[int, int]  # module events where saved-tensor hooks go on (1) or off (-1) (NOTE [hook points] 5)
    recording: Mapping[int, int]  # module events where the recording mode opens (at this op) or closes (-1) (6)
    reruns: Mapping[int, int]  # the 'enter' and 'exit' of each re-run module call -> its recomputation (7)
    triggers: Mapping[int, int]  # the event that stands for each acting boundary -> that boundary
    # the paths of the only modules whose calls the runtime hooks (8); None: every module's, by global hooks
    hooked: frozenset[str] | None

    def calls_at(self, events: tuple[HookEvent, ...]) -> dict[int, int]:
        """Boundary -> the hook calls the runtime handles there."""
        calls: dict[int, int] = {}
        for event, handled in zip(events, self.seen):
            if handled:
                calls[event.boundary] = calls.get(event.boundary, 0) + 1
        return calls


def followed_calls(events: tuple[HookEvent, ...], acting: Collection[int], planned: Collection[int] = (),
                   recording: tuple[tuple[int, int], ...] = (),
                   reruns: Mapping[int, RerunCall] = MappingProxyType({}), by_path: bool = True) -> FollowedCalls:
    """What a runtime acting at boundaries ``acting`` on tensors ``planned``, recording ops in windows
    ``recording`` and re-running the module calls ``reruns``, sees of the step and does (NOTE [hook points]).
    ``by_path``: it can hook modules by their paths (it was given the model), else it hooks every module."""
    windows = saved_tensor_windows(events, set(acting), planned, [(call.enter, call.exit) for call in reruns.values()])
    if windows is None:
        shown, on = [True] * len(events), [True] * len(events)
    else:
        shown, on = seen_in_windows(events, windows)
    switches: dict[int, int] = {}
    before = False
    for ordinal, (event, after) in enumerate(zip(events, on)):
        if windows is not None and event.kind in ("enter", "exit") and after != before:
            switches[ordinal] = 1 if after else -1
        before = after
    recorded = {closing: -1 for _, closing in recording if closing < len(events)}
    recorded |= {opening: events[opening].boundary for opening, _ in recording}  # an opening wins
    rerun_at = {ordinal: index for index, call in reruns.items() for ordinal in (call.enter, call.exit)}
    triggers = _triggers(events, shown, acting)
    needed = {*switches, *recorded, *rerun_at, *(at for at in triggers if events[at].kind in ("enter", "exit"))}
    hooked = _hooked(events, needed) if by_path else None
    if hooked is not None:
        shown = [visible and (event.kind not in ("enter", "exit") or event.path in hooked)
                 for event, visible in zip(events, shown)]
    return FollowedCalls(tuple(shown), windows is None, MappingProxyType(switches), MappingProxyType(recorded),
                         MappingProxyType(rerun_at), MappingProxyType(triggers), hooked)


def _hooked(events: tuple[HookEvent, ...], needed: Collection[int]) -> frozenset[str] | None:
    """NOTE [hook points] 8: the modules whose calls must be seen, by path; None when one has no path."""
    paths = {events[ordinal].path for ordinal in needed}
    if None in paths:
        return None
    return frozenset(path for path in paths if path is not None)


def _triggers(events: tuple[HookEvent, ...], shown: list[bool], acting: Collection[int]) -> dict[int, int]:
    """Position -> the boundary it stands for, among the events seen: in forward its last pack (every tensor packed
    there is met; the module calls after it run no op), else its last module call; in backward its first unpack
    (before any node at it runs). A pack rather than a module call, so that fewer modules need hooks (NOTE [hook
    points] 8)."""
    last_pack: dict[int, int] = {}
    last_call: dict[int, int] = {}
    first_unpack: dict[int, int] = {}
    for ordinal, event in enumerate(events):
        if not shown[ordinal]:
            continue
        if event.kind == "unpack":
            first_unpack.setdefault(event.boundary, ordinal)
        elif event.kind == "pack":
            last_pack[event.boundary] = ordinal
        else:
            last_call[event.boundary] = ordinal
    triggers: dict[int, int] = {}
    for boundary in acting:
        at = first_unpack.get(boundary, last_pack.get(boundary, last_call.get(boundary)))
        if at is None:
            raise ValueError(f"boundary {boundary} is not a hook point (NOTE [hook points])")
        triggers[at] = boundary
    return triggers
