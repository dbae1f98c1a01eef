"""Following a step by its module and saved-tensor hook calls (NOTE [offload runtime] 1, NOTE [hook points]), with
a dispatch mode only in the windows where a recomputation records its ops (NOTE [hook points] 6)."""

from __future__ import annotations

import threading

import torch
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook
from torch.utils._python_dispatch import _get_current_dispatch_mode

from udnn_lab.errors import PlanMismatch
from udnn_lab.runtime._hook_schedule import HookSchedule
from udnn_lab.runtime._slots import Handle, Kept, OpMode, Owner, last_look
from udnn_lab.runtime._step import Step


class HookStep(Step):
    """Counts the step's module calls and its packs and unpacks inside the windows; acts at the calls that stand
    for the plan's boundaries."""

    by_hook_events = True

    def __init__(self, runtime: Owner, events: HookSchedule) -> None:
        super().__init__(runtime, events.reruns)
        self.events = events
        self._recorder = OpMode(self.on_recorded_op) if self.plan.recomputes else None
        self._recording = False  # the recorder is on (NOTE [hook points] 6)
        self._module_hooks: tuple = ()
        self._replaying = False  # a re-run's module calls are not the step's (NOTE [hook points] 7)
        self._thread = threading.get_ident()  # follow this thread's step only: a module may run on others too

    def _begin(self) -> None:
        self.events.check_modes()
        if self.events.whole_step:
            self._switch_hooks(True)
        self._hook_modules()

    def _hook_modules(self) -> None:
        thread = self._thread  # a re-run in backward may run on autograd's own thread

        def entered(module, args) -> None:
            self._module_event(thread, "enter", module)

        def exited(module, args, kwargs, output) -> None:
            self._module_event(thread, "exit", module, args, kwargs)

        modules = self.events.modules
        if modules is None:  # every module, by global hooks: each module call then takes torch's slow path
            self._module_hooks = (register_module_forward_pre_hook(entered),
                                  register_module_forward_hook(exited, with_kwargs=True))
            return
        # NOTE [hook points] 8: those the plan needs alone, called first as global hooks would be
        self._module_hooks = tuple(handle for module in modules for handle in (
            module.register_forward_pre_hook(entered, prepend=True),
            module.register_forward_hook(exited, with_kwargs=True, prepend=True)))

    def _unhook_modules(self) -> None:
        for handle in self._module_hooks:
            handle.remove()
        self._module_hooks = ()

    def _end(self) -> None:
        try:
            if self._recording:  # an error inside a recording window
                self._switch_recording(None)
        finally:
            self._unhook_modules()

    def _hook_calls(self) -> int | None:
        return self.events.seen

    def _check_complete(self) -> None:
        self.events.check_complete()

    def _module_event(self, thread: int, kind: str, module: torch.nn.Module, args: tuple = (),
                      kwargs: dict | None = None) -> None:
        if self._replaying or threading.get_ident() != thread:
            return
        action = self.events.module_called(kind, module)
        if action is None:  # nearly every call: counted and checked only
            return
        if action.rerun is not None:  # NOTE [hook points] 7: the call a recomputation re-runs
            if kind == "enter":
                self.reruns[action.rerun].entered(module)
            else:
                self.reruns[action.rerun].exited(args, kwargs or {})
        if action.recording is not None and action.recording < 0:
            self._switch_recording(None)
        if action.switch < 0:
            self._switch_hooks(False)
        if action.boundary is not None:
            self._at_boundary(action.boundary)
        if action.switch > 0:
            self._switch_hooks(True)
        if action.recording is not None and action.recording >= 0:
            self._switch_recording(action.recording)

    def _switch_recording(self, index: int | None) -> None:
        """The recording mode on from op ``index``, or off (None) (NOTE [hook points] 6)."""
        assert self._recorder is not None  # a schedule with recording windows is made only for recomputations
        if index is not None:
            self.index = index
            self._recorder.__enter__()
            self._recording = True
        elif self._recording:
            self._recording = False
            if _get_current_dispatch_mode() is not self._recorder:
                self._recorder.__exit__(None, None, None)
                raise PlanMismatch(
                    "a dispatch mode entered inside the step is still on where the runtime's recording of a "
                    "recomputation ends (NOTE [hook points] 6): enter it around the whole step, or follow the plan "
                    "op by op with plan.located(graph, on_hooks=False)")
            self._recorder.__exit__(None, None, None)

    def on_recorded_op(self, func, args: tuple, kwargs: dict):
        """One op inside a recording window (NOTE [hook points] 6): counted, checked, recorded where planned."""
        family = self._known(func)[0]
        if not family:
            return func(*args, **kwargs)
        index = self._counted(family)
        for tensor in self.layout.let_go.get(index, ()):  # where no hook call stands for the op (NOTE [hook points] 6)
            last_look(self.slots[tensor])
        return self._call(index, func, args, kwargs)

    def _pack(self, tensor: torch.Tensor) -> Handle | Kept:
        """NOTE [offload runtime] 2: a handle for a planned storage, the tensor and its version otherwise."""
        expected, boundary = self.events.packed(tensor)  # NOTE [offload runtime] 1: the traced pack names the storage
        slot = self.slots.get(expected.tensor)
        if slot is not None and slot.key is None:
            self._meet_packed(slot, tensor)
        packed = Kept(tensor, tensor._version) if slot is None else self._handle(slot, tensor)
        if boundary is not None:
            self._at_boundary(boundary)
        return packed

    def _replay(self, replay) -> None:
        """A re-run's module calls are not the step's (NOTE [hook points] 7): without the global hooks, torch calls
        them on its fast path, as checkpoint's recomputation is called; the few modules hooked alone (8) keep their
        hooks, which let the re-run's calls pass."""
        if self.events.modules is not None:
            self._replaying = True
            try:
                super()._replay(replay)
            finally:
                self._replaying = False
            return
        hooked = bool(self._module_hooks)
        self._unhook_modules()
        try:
            super()._replay(replay)
        finally:
            if hooked:
                self._hook_modules()

    def _unpack(self, packed):
        """The call may stand for a boundary where the plan acts (a replay, a prefetch) before it unpacks."""
        boundary = self.events.unpacked()
        if boundary is not None:
            self._at_boundary(boundary)
        return super()._unpack(packed)
