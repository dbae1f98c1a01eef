"""Following a step by its module and saved-tensor hook calls alone (NOTE [hook points], NOTE [offload runtime] 1)."""

from __future__ import annotations

from collections.abc import Collection, Mapping
from types import MappingProxyType
from typing import NamedTuple

import torch

from udnn_lab.errors import PlanMismatch
from udnn_lab.graph.followed_calls import followed_calls
from udnn_lab.graph.plan_ir import other_step
from udnn_lab.graph.reruns import RerunCall
from udnn_lab.graph.step_graph import HookEvent

WHOLE_STEP = "the whole step"
# a traced event's dtype, as the trace writes it, to the dtype itself
_DTYPES = {str(dtype): dtype for dtype in vars(torch).values() if isinstance(dtype, torch.dtype)}


class ModuleAction(NamedTuple):
    """What the runtime does at one module call."""

    boundary: int | None  # the boundary to act at (None: none)
    switch: int  # saved-tensor hooks go on (1), off (-1) or stay as they are (0) (NOTE [hook points] 5)
    recording: int | None  # the recording mode opens (the index of the next op), closes (-1) or neither (None) (6)
    rerun: int | None  # the recomputation whose module call this enters or leaves (7)


class HookSchedule:
    """Counts a step's module calls and autograd's pack and unpack calls against the traced ones.

    Saved-tensor hooks are in force only inside the plan's windows (NOTE [hook points] 5), so
    the calls counted are the step's module calls (of the modules hooked, 8) and the packs and
    unpacks of those windows.
    Each is checked against the trace's (a module by its class and mode, a pack by the saved
    tensor's autograd node, dtype and shape): the first that differs raises PlanMismatch. At the
    call that stands for a boundary where the plan acts it says so.
    """

    def __init__(self, events: tuple[HookEvent, ...], acting: set[int], op_families: tuple[str, ...],
                 planned: Collection[int] = (), recording: tuple[tuple[int, int], ...] = (),
                 reruns: Mapping[int, RerunCall] = MappingProxyType({}),
                 model: torch.nn.Module | None = None) -> None:
        self.op_families = op_families
        self.reruns = reruns  # recomputation -> the module call it re-runs (NOTE [hook points] 7)
        self.seen = 0
        followed = followed_calls(events, acting, planned, recording, reruns, by_path=model is not None)
        # the only modules to hook (NOTE [hook points] 8); None: every module, by global hooks
        traced = None if followed.hooked is None else _traced_modules(model, events)
        # the modules whose mode (train or eval) each step must have, as the trace met them: unhooked calls go unseen
        self.modes: tuple[tuple[str, torch.nn.Module, bool], ...] = () if traced is None else tuple(
            (path, module, training) for path, (module, training) in traced.items() if training is not None)
        self.modules = None if traced is None else tuple(traced[path][0] for path in sorted(followed.hooked or ()))
        if followed.hooked is not None and traced is None:  # not the traced model: hook every module
            followed = followed_calls(events, acting, planned, recording, reruns, by_path=False)
        self.whole_step = followed.whole_step  # hooks in force from start to finish
        self.events = tuple(event for event, visible in zip(events, followed.seen) if visible)
        position = dict(zip((o for o, visible in enumerate(followed.seen) if visible), range(len(self.events))))
        # module events (by position in self.events) where hooks go on (+1) or off (-1)
        self.switches = {position[o]: change for o, change in followed.switches.items()}
        # module events (by position) where the recording mode opens (at the op index given) or closes (-1)
        # (NOTE [hook points] 6)
        self.recording = {position[o]: at for o, at in followed.recording.items()}
        # module events (by position) of the calls a recomputation re-runs: 'enter' and 'exit' -> which
        # recomputation (NOTE [hook points] 7)
        self.rerun_calls = {position[o]: recompute for o, recompute in followed.reruns.items()}
        self.triggers = {position[o]: boundary for o, boundary in followed.triggers.items()}
        self.last_trigger = max(self.triggers, default=-1)
        # what each call must be, compared in one go: (kind, class, mode) of a module call, (kind, shape, dtype) of a
        # pack (its node apart: views' nodes vary), (kind,) of an unpack
        self.expected = tuple((e.kind, e.node, e.training) if e.kind in ("enter", "exit") else
                              (e.kind, e.shape, _DTYPES.get(e.dtype)) if e.kind == "pack" else (e.kind,)
                              for e in self.events)
        # module events (by position) at which anything is done, and what: few of them
        self.module_actions: dict[int, ModuleAction] = {
            position: ModuleAction(self.triggers.get(position), self.switches.get(position, 0),
                                   self.recording.get(position), self.rerun_calls.get(position))
            for position in {*self.switches, *self.recording, *self.rerun_calls,
                             *(p for p in self.triggers if self.events[p].kind in ("enter", "exit"))}}

    @staticmethod
    def covers(events: tuple[HookEvent, ...], acting: set[int]) -> bool:
        """Whether every boundary the plan acts at is a hook point of ``events``."""
        return acting <= {event.boundary for event in events}

    @property
    def windows(self) -> str:
        """Where hooks are in force, in words: for a table of steps."""
        opened = sum(change > 0 for change in self.switches.values())
        return WHOLE_STEP if self.whole_step else f"{opened} window{'' if opened == 1 else 's'}"

    def check_modes(self) -> None:
        """As a step starts: every traced module in the mode the trace met it in (NOTE [offload runtime] 1)."""
        for path, module, training in self.modes:
            if module.training != training:
                mode = {True: "training", False: "eval"}
                raise other_step(
                    f"this step is not the one the plan was made for: its module {path or '(the model)'} "
                    f"({type(module).__name__}) is in {mode[module.training]} mode, where the plan's step had it in "
                    f"{mode[training]} mode; trace this step and plan again",
                    "plan for this step with ul.plan(ul.trace(...), ...), or set the module's mode back")

    def packed(self, tensor: torch.Tensor) -> tuple[HookEvent, int | None]:
        """A pack call: the traced event it is, and the boundary to act at now (None: none)."""
        ordinal = self.seen
        self.seen += 1
        # compared as cheaply as it can be: this runs for every saved tensor inside the windows
        if ordinal >= len(self.expected) or self.expected[ordinal] != ("pack", tensor.shape, tensor.dtype):
            self._pack_differs(ordinal, tensor)
        expected = self.events[ordinal]
        node = tensor.grad_fn
        name = type(node).__name__ if node is not None else ""
        if name != expected.node and _view_family(expected.node) != _view_family(name):
            self._pack_differs(ordinal, tensor)
        return expected, self.triggers.get(ordinal)

    def _pack_differs(self, ordinal: int, tensor: torch.Tensor) -> None:
        node = tensor.grad_fn
        seen = (type(node).__name__ if node is not None else "", str(tensor.dtype), tuple(tensor.shape))
        expected = self.events[ordinal] if ordinal < len(self.events) else None
        self._mismatch(ordinal, expected, "it saves a {1} tensor of shape {2} made by {0}".format(*_named(seen)))

    def module_called(self, kind: str, module: torch.nn.Module) -> ModuleAction | None:
        """A module's forward starts ('enter') or returns ('exit'): what to do now (None: nothing)."""
        ordinal = self.seen
        self.seen += 1
        if ordinal >= len(self.expected) or self.expected[ordinal] != (kind, type(module).__name__, module.training):
            expected = self.events[ordinal] if ordinal < len(self.events) else None
            name = type(module).__name__
            mode = "" if expected is None or expected.training == module.training else \
                f" in {'training' if module.training else 'eval'} mode"
            self._mismatch(ordinal, expected, f"it {'enters' if kind == 'enter' else 'leaves'} a {name}{mode}")
        return self.module_actions.get(ordinal)

    def unpacked(self) -> int | None:
        """An unpack call: the boundary to act at before it (None: none)."""
        ordinal = self.seen
        self.seen += 1
        expected = self.events[ordinal] if ordinal < len(self.events) else None
        if expected is None or expected.kind != "unpack":
            self._mismatch(ordinal, expected, "it starts a backward node")
        return self.triggers.get(ordinal)

    def check_complete(self) -> None:
        if self.seen == 0 and self.modules:
            raise PlanMismatch(
                "the step called none of the modules the runtime hooks in the model it was given (NOTE [hook points] "
                "8): run that model inside the runtime, or give it the one you run with runtime.for_model(model)")
        if self.seen <= self.last_trigger:
            raise PlanMismatch(
                f"the step made {self.seen} hook calls but the plan acts at call {self.last_trigger + 1} of "
                f"{len(self.events)}: run forward and backward inside the runtime, and plan again if the model, batch "
                "or optimizer changed")

    def _mismatch(self, ordinal: int, expected: HookEvent | None, what: str) -> None:
        boundary = expected.boundary if expected is not None else (self.events[-1].boundary if self.events else 0)
        if expected is None:
            planned = "saves nothing more"
        elif expected.kind == "unpack":
            planned = "starts a backward node"
        elif expected.kind in ("enter", "exit"):
            mode = "" if expected.training else " in eval mode"
            planned = f"{'enters' if expected.kind == 'enter' else 'leaves'} a {expected.node}{mode}"
        else:
            planned = "saves a {1} tensor of shape {2} made by {0}".format(*_named((expected.node, expected.dtype,
                                                                                   expected.shape)))
        op = max(boundary - 1, 0)  # the call came after this op
        family = f" ({self.op_families[op]})" if op < len(self.op_families) else ""
        raise other_step(
            f"this step is not the one the plan was made for: after its op {op}{family} {what}, where the plan's "
            f"step {planned}; trace this step and plan again", f"(hook call {ordinal} differs)",
            "the model, its mode (train or eval), the loss, the optimizer or the input changed since the plan was "
            "made: plan for this step with ul.plan(ul.trace(...), ...)",
            "if nothing changed, the device's kernels save other tensors than the traced ones did: follow the plan "
            "op by op with plan.located(graph, on_hooks=False)")


def _traced_modules(model: torch.nn.Module | None,
                    events: tuple[HookEvent, ...]) -> dict[str, tuple[torch.nn.Module, bool | None]] | None:
    """Path -> (the module, its mode; None: called in both) for every module the trace met in ``model``, when
    ``model`` holds one of the traced class at each path; None where it does not (another model: NOTE [hook points]
    8)."""
    traced: dict[str, tuple[str, set[bool]]] = {}
    for event in events:
        if event.kind == "enter" and event.path is not None:
            traced.setdefault(event.path, (event.node, set()))[1].add(event.training)
    found = {}
    for path, (node, modes) in traced.items():
        try:
            module = model.get_submodule(path) if model is not None else None
        except AttributeError:
            return None
        if module is None or type(module).__name__ != node:
            return None
        found[path] = (module, next(iter(modes)) if len(modes) == 1 else None)
    return found


# A view's backward node depends on how autograd rebuilds views (NOTE [view replay] 1): a traced step names
# it ViewBackward0 where the real step may name it ReshapeAliasBackward0 or AsStridedBackward0.
_VIEW_NODES = dict.fromkeys(("ViewBackward0", "ReshapeAliasBackward0", "AsStridedBackward0", "AsStridedBackward1",
                             "UnsafeViewBackward0", "AliasBackward0"), "a view")


def _view_family(node: str) -> str:
    return _VIEW_NODES.get(node, node)


def _named(seen: tuple[str, str, tuple[int, ...]]) -> tuple[str, str, list[int]]:
    node, dtype, shape = seen
    return node or "no autograd node (a leaf)", dtype.removeprefix("torch."), list(shape)
