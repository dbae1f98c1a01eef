"""One step under the offload runtime: the plan's actions on its planned storages, however the step is followed.

Two ways of following a step share this (NOTE [offload runtime] 1): by its module and saved-tensor hook calls,
with a dispatch mode only to record recomputations (_by_hooks.py), or op by op under a dispatch mode
(_by_ops.py). Each says where the step is; this class acts there.
"""

from __future__ import annotations

import weakref
from collections import deque
from collections.abc import Mapping
from contextlib import nullcontext
from functools import partial
from types import MappingProxyType
from typing import cast

import torch

from udnn_lab.analysis.recording import flat_tensors, records_op, written_positions
from udnn_lab.analysis.step import view_replay
from udnn_lab.errors import PlanMismatch
from udnn_lab.graph.plan_ir import Offload, Recompute, other_step
from udnn_lab.graph.reruns import RerunCall
from udnn_lab.graph.step_graph import op_family
from udnn_lab.runtime._copies import Copies
from udnn_lab.runtime._made_bytes import MadeBytes
from udnn_lab.runtime._replay import Replay, per_op_kind, recorded_call
from udnn_lab.runtime._rerun import ModuleRerun
from udnn_lab.runtime._slots import (
    Handle,
    Kept,
    Owner,
    Slot,
    StepStats,
    bytes_of,
    last_look,
    modified_in_place,
)


@per_op_kind
def _op_kind(func) -> tuple[str, tuple[int | str, ...]]:
    return op_family(str(func)) if records_op(func) else "", written_positions(func)


class Step:
    """The planned storages of one step and what the plan does with them (NOTE [offload runtime])."""

    by_hook_events = False  # how the subclass follows the step: by hook calls, or op by op

    def __init__(self, runtime: Owner, reruns: Mapping[int, RerunCall] = MappingProxyType({})) -> None:
        self.runtime, plan = runtime, runtime.plan
        assert plan is not None  # a runtime makes steps only when enabled, and it is enabled only with a plan
        self.plan = plan
        self.index = 0
        self.copies: Copies | None = None  # made when the first planned tensor is found: before any action
        self.layout = runtime.step_layout(reruns)  # what the plan does where: the same every step
        self.slots = {a.tensor: Slot(a.tensor, a) for a in plan.offloads}
        self.replays: list[Replay | ModuleRerun] = []  # by recomputation, as plan.recomputes lists them
        self.reruns: dict[int, ModuleRerun] = {}  # recomputation -> its module call's re-run (NOTE [hook points] 7)
        for index, recompute in enumerate(plan.recomputes):
            rerun = ModuleRerun(recompute, reruns[index], plan.hook_events) if index in reruns else None
            self.replays.append(rerun or Replay(recompute))
            if rerun is not None:
                self.reruns[index] = rerun
            for tensor in recompute.tensors:
                self.slots[tensor] = Slot(tensor, recompute, rerun)
        self.expected = plan.op_families  # NOTE [offload runtime] 1: the step must be the plan's step
        self.copying_in: deque[Slot] = deque()  # prefetches in flight
        self.dropped_in_flight: list = []  # tokens of prefetches their slot let go of, waited for at the end (7, 9)
        self.recomputed = self.on_demand = 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks_on = False
        self._top_at_start: tuple | None = None  # autograd's innermost saved-tensor hooks when the step started
        self._views = view_replay() if plan.replays_views else nullcontext()  # NOTE [view replay] 4

    # -- lifetime ----------------------------------------------------------------------------
    def start(self) -> None:
        self._views.__enter__()  # NOTE [view replay] 2: the ops the trace saw
        self._top_at_start = torch._C._autograd._top_saved_tensors_default_hooks(False)
        try:
            self._begin()
        except BaseException:
            self._switch_hooks(False)
            self._views.__exit__(None, None, None)
            raise

    def _begin(self) -> None:
        """Start following the step: the subclass's hooks or mode."""
        raise NotImplementedError

    def _end(self) -> None:
        """Stop following the step (normally or on an error): the subclass's hooks and mode off."""
        raise NotImplementedError

    def _check_complete(self) -> None:
        """Raise PlanMismatch when the step ended before the plan's last action."""
        raise NotImplementedError

    def _ops_seen(self) -> int | None:
        return None

    def _hook_calls(self) -> int | None:
        return None

    def _switch_hooks(self, on: bool) -> None:
        """Saved-tensor hooks on or off, at the top of autograd's stack of them (NOTE [hook points] 5)."""
        if on == self._hooks_on:
            return
        top = torch._C._autograd._top_saved_tensors_default_hooks(False)
        expected = self._top_at_start if on else (self._hooks.pack_hook, self._hooks.unpack_hook)
        if top != expected:
            raise PlanMismatch(
                "saved-tensor hooks were pushed inside the step where the traced step had none (e.g. "
                "torch.autograd.graph.save_on_cpu or a checkpoint around part of the model): trace the step as it "
                "runs, with them, and plan again")
        if on:
            self._hooks.__enter__()
        else:
            self._hooks.__exit__(None, None, None)
        self._hooks_on = on

    def finish(self, completed: bool) -> StepStats:
        """NOTE [offload runtime] 9: mode and hooks off, copies waited for, every reference dropped."""
        try:
            self._end()
        finally:
            if self._hooks_on:  # NOTE [hook points] 5: on at the end of the step, or left on by an error
                self._hooks.__exit__(None, None, None)
                self._hooks_on = False
            self._views.__exit__(None, None, None)
        copies = self.copies
        if copies is not None:
            for token in self.dropped_in_flight:
                copies.finish(token)
        self.dropped_in_flight.clear()
        for slot in self.slots.values():
            if copies is not None:
                copies.finish(slot.offload_done)
                copies.finish(slot.prefetch_done)
            slot.restored = slot.rebuilt = slot.device_data = slot.prefetch_done = slot.offload_done = slot.host = None
            slot.watchers.clear()
            slot.saved.clear()
        self.copying_in.clear()
        # The hooks and weakref callbacks make this object a reference cycle that only the
        # garbage collector frees: hold no tensor past the step (NOTE [offload runtime] 9).
        for slot in self.slots.values():
            slot.replay = None
        self.replays.clear()
        self.reruns.clear()
        if self.runtime.pool is not None:
            self.runtime.pool.reset()
        if completed:
            self._check_complete()
        return StepStats(self._ops_seen(), copies.d2h_bytes if copies else 0, copies.h2d_bytes if copies else 0,
                         self.recomputed, copies.wait_s if copies else 0.0, self.on_demand, self.by_hook_events,
                         self._hook_calls())

    # -- the ops ----------------------------------------------------------------------------
    def _known(self, func) -> tuple[str, tuple[int | str, ...]]:
        """An op's family ('' for ops the trace does not count) and where it writes in place."""
        return _op_kind(func)

    def _counted(self, family: str) -> int:
        """The next op's index; it must be the plan's op there (NOTE [offload runtime] 1)."""
        index = self.index
        self.index += 1
        if index < len(self.expected) and family != self.expected[index]:
            self._mismatch(index, family)
        return index

    def _call(self, index: int, func, args: tuple, kwargs: dict):
        """Run op ``index``, recording it for the replays that re-run it (NOTE [offload runtime] 6)."""
        recording = self.layout.recording.get(index)
        if recording is None:
            return func(*args, **kwargs)
        replays = [cast(Replay, self.replays[r]) for r in recording]  # a re-run records no ops
        return recorded_call(replays, func, args, kwargs, self._device)

    def _mismatch(self, index: int, family: str) -> None:
        expected = self.expected[index]
        raise other_step(
            f"this step is not the one the plan was made for: its op {index} is {family}, where the plan's step has "
            f"{expected}; trace this step and plan again",
            "the model, its mode (train or eval), the loss, the optimizer or the input changed since the plan was "
            "made: plan for this step with ul.plan(ul.trace(...), ...)",
            "a model wrapped in DDP or FSDP2 reaches the traced step after two steps (FSDP's lazy initialization in "
            "the first, DDP's bucket rebuild in the second): run those without the runtime",
            "if none of these changed, the trace's fake kernels took another path than this device's real ones (a "
            "view where the trace saw a copy): plan from ul.trace(..., fake=False) on a real batch here instead")

    def _meet(self, slot: Slot, tensor: torch.Tensor, producer: int,
              storage: torch.UntypedStorage | None = None) -> None:
        """The planned storage is ``tensor``'s (``storage``, where the caller has it): follow it from here on."""
        slot.key = id(storage if storage is not None else tensor.untyped_storage())
        if self.copies is None:
            self.copies = Copies(tensor.device)
        elif tensor.device != self.copies.device:  # a fused attention kernel's dropout seed stays on the host
            raise PlanMismatch(f"the step saved the plan's tensor made by op {producer} on {tensor.device}, where the "
                               f"plan's other tensors are on {self.copies.device}: it would come back on the wrong "
                               "device; plan again from a trace of this step (ul.plan(ul.trace(...), ...))")
        if isinstance(slot.action, Offload):
            slot.device_data = bytes_of(tensor)
        else:
            for recording in self.layout.recording.get(producer, ()):
                replay = self.replays[recording]
                assert isinstance(replay, Replay)  # a re-run records no ops
                if slot.tensor in replay.recompute.tensors:
                    replay.restore_from(slot.tensor, slot.key)
                    slot.replay = replay

    # -- actions --------------------------------------------------------------------------
    def _offload(self, slot: Slot) -> None:
        if slot.device_data is None:
            return
        assert self.copies is not None
        with torch._C._DisableTorchDispatch():  # NOTE [offload runtime] 8: not an op of the step
            pool = self.runtime.host_pool(self.copies.device)
            slot.host_offset, slot.host = pool.take(slot.device_data.numel())
            slot.offload_done = self.copies.to_host(slot.device_data, slot.host)

    def _release(self, slot: Slot) -> None:
        """The release point (NOTE [offload runtime] 3): compute waits for the copy, the device tensor goes."""
        last_look(slot)
        if slot.device_data is None or slot.restored is not None:
            return
        assert self.copies is not None
        self.copies.use(slot.offload_done)
        slot.device_data = None

    def _settle(self) -> None:
        """Return the host slices of completed prefetches (NOTE [offload runtime] 4)."""
        assert self.copies is not None
        while self.copying_in and self.copies.done(self.copying_in[0].prefetch_done):
            self._give_back(self.copying_in.popleft())

    def _prefetch(self, slot: Slot) -> None:
        """NOTE [offload runtime] 4: a device buffer on the compute stream, filled on the prefetch stream."""
        if slot.host is None or slot.restored is not None:
            return
        self._settle()
        if slot.device_data is not None:  # at or before its release point: it never left
            slot.restored, slot.device_data = slot.device_data, None
            self._give_back(slot)
            return
        assert self.copies is not None
        with torch._C._DisableTorchDispatch():
            slot.restored, slot.prefetch_done = self.copies.to_device(slot.host)
        self.copying_in.append(slot)
        self._adopt(slot.restored)

    def _replay(self, replay: Replay | ModuleRerun) -> None:
        """NOTE [offload runtime] 6: re-run the recorded forward ops before backward unpacks; an observer that counts
        live bytes learns the peak of what a replay made (it sees none of its ops)."""
        during = getattr(self.runtime.observer, "during", None)
        made = MadeBytes() if during is not None else None
        restored = replay.run(made)
        if during is not None and made is not None:
            during(made.above_now())  # the sources it held went as it ended: its peak was above what is alive now
            made.close()
        for tensor, value in restored.items():
            slot = self.slots[tensor]
            slot.restored = slot.rebuilt = value  # its storage, and the saved tensor as the replay made it
            self._adopt(value)
            self.recomputed += 1

    def _adopt(self, tensor: torch.Tensor) -> None:
        if self.runtime.observer is not None:
            self.runtime.observer.adopt(tensor)

    # -- autograd hooks ---------------------------------------------------------------------
    def _pack(self, tensor: torch.Tensor) -> Handle | Kept:
        """NOTE [offload runtime] 2: a handle for a planned storage, the tensor and its version otherwise."""
        raise NotImplementedError

    def _handle(self, slot: Slot, tensor: torch.Tensor) -> Handle:
        # NOTE [hook points] 7: a re-run call's tensors go as forward lets them go
        handle = Handle(slot, tensor, held=not isinstance(slot.replay, ModuleRerun))
        watcher = weakref.ref(handle, partial(self._handle_gone, slot))
        slot.saved.append(watcher)
        slot.handles += 1
        slot.watchers.append(watcher)
        return handle

    def _meet_packed(self, slot: Slot, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        site = self.layout.site_of[slot.tensor]
        if storage.nbytes() != site.nbytes:
            raise PlanMismatch(f"the step saved a {storage.nbytes()}-byte storage where the plan expects its "
                               f"{site.nbytes}-byte tensor (made by op {site.producer}): the step differs from the one "
                               "the plan was made for; plan again for this model and batch")
        self._meet(slot, tensor, site.producer, storage)

    def _at_boundary(self, boundary: int) -> None:
        """After op ``boundary - 1`` and before op ``boundary`` (NOTE [hook points]): what the plan does there."""
        self._after_op(boundary - 1)
        self._before_op(boundary)

    def _after_op(self, index: int) -> None:
        layout = self.layout
        for tensor in layout.offload_after.get(index, ()):
            self._offload(self.slots[tensor])
        for recompute in layout.replay_at.get(index, ()):
            self._replay(self.replays[recompute])

    def _before_op(self, index: int) -> None:
        layout = self.layout
        for tensor in layout.prefetch_at.get(index, ()):
            self._prefetch(self.slots[tensor])
        for tensor in layout.wait_at.get(index, ()):  # vDNN's per-layer sync
            if self.copies is not None:
                self.copies.use(self.slots[tensor].offload_done)
        for tensor in layout.release_at.get(index, ()):
            self._release(self.slots[tensor])
        for tensor in layout.let_go.get(index, ()):
            last_look(self.slots[tensor])

    def _unpack(self, packed):
        """NOTE [offload runtime] 5: compute waits on the prefetch; the saved view over the restored storage."""
        if isinstance(packed, Kept):
            if packed.tensor._version != packed.version:
                modified_in_place(packed.tensor.dtype, packed.tensor.shape)
            return packed.tensor
        slot = packed.slot
        if packed.stale:
            modified_in_place(packed.dtype, packed.shape)
        if slot.restored is None:
            self._on_demand(slot)
        self.copies.use(slot.prefetch_done)
        rebuilt = slot.rebuilt
        if rebuilt is not None and rebuilt.dtype == packed.dtype and rebuilt.shape == packed.shape \
                and rebuilt.stride() == packed.stride and rebuilt.storage_offset() == packed.offset:
            return rebuilt  # the saved tensor as recomputed: no view to make
        with torch._C._DisableTorchDispatch():
            view = torch.empty(0, dtype=packed.dtype, device=slot.restored.device)
            view.set_(slot.restored.untyped_storage(), packed.offset, packed.shape, packed.stride)
        return view

    def _on_demand(self, slot: Slot) -> None:
        self.on_demand += 1
        if isinstance(slot.action, Recompute):
            assert slot.replay is not None  # set when its producer ran: a valid plan re-runs every producer
            self._replay(slot.replay)
            return
        self._prefetch(slot)
        assert self.copies is not None
        self.copies.finish(slot.prefetch_done)

    def _handle_gone(self, slot: Slot, _ref) -> None:
        """NOTE [offload runtime] 7: the last handle of a slot collected."""
        slot.handles -= 1
        if slot.handles <= 0 and slot.restored is not None:
            self._drop(slot)

    def _drop(self, slot: Slot) -> None:
        assert self.copies is not None
        token = slot.prefetch_done
        if self.copies.use(token):  # NOTE [offload runtime] 7: a copy may still use block and slice
            self.dropped_in_flight.append(token)  # NOTE [offload runtime] 9: waited for at the step's end
        slot.restored = slot.rebuilt = slot.device_data = slot.prefetch_done = slot.offload_done = None
        self._give_back(slot)

    def _give_back(self, slot: Slot) -> None:
        if slot.host is not None and self.runtime.pool is not None:
            assert slot.host_offset is not None  # taken with the host slice
            self.runtime.pool.give_back(slot.host_offset)
        slot.host = slot.host_offset = None

    @staticmethod
    def _device(args) -> torch.device:
        first = next(flat_tensors(args), None)
        return first.device if first is not None else torch.device("cpu")
