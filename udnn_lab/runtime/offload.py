"""The offload runtime: carries out a Plan around a training step. It chooses nothing.

NOTE [offload runtime]
  1. Identity. Where the plan carries the step's saved-tensor events (NOTE [hook points]:
     every action on a hook point, every recomputation in a recording window), the runtime
     counts module calls, and autograd's pack and unpack calls inside its windows (NOTE [hook
     points] 5): each must be the traced one (a module by its class and mode, a pack by its
     tensor's autograd node, dtype and shape), so a step that differs (another activation,
     loss or mode) raises PlanMismatch at the first call that differs; a planned tensor is
     the storage packed at its first traced pack (its size is checked); the plan acts at the
     call that stands for its boundary. The step pays for the module hooks and the
     saved-tensor hooks of the windows, and, where the plan recomputes, for a dispatch mode in
     its recording windows only (NOTE [hook points] 6): it counts ops from the boundary it
     opens at, checks their families, records the ops a Recompute re-runs, and lets a
     recomputed tensor go where no hook call stands for that op. Otherwise a dispatch mode
     counts all the step's ops by the recorder's rules (records_op), so op indices are the plan's, and each op's family
     (op_family) must be the plan's op at that index; when op ``site.producer`` returns,
     its ``site.position``-th new output storage is the planned tensor. One backend's ops are
     not the step's: gloo's reduce-scatter copies its result out of a buffer of its own (a
     ``split`` and a ``copy_`` right after the collective, on this thread, in ``work.wait()``),
     where NCCL, and so the one-rank trace (NOTE [one rank of N]), reduce in place; those two
     run uncounted.
  2. Saving. Autograd's pack hook returns a handle for a planned storage (one slot per
     storage however many ops save it, in whatever views) and the tensor itself, with its
     version, otherwise: parameters, buffers and unplanned tensors are never touched.
  3. Offload and release. After op ``after_op`` the storage is copied into a slice of the
     host pool: on CUDA on the offload stream, which first waits on the compute stream. The
     runtime holds the device tensor until the offload's release point (``release_op``:
     where the simulation freed it; ``ul.plan`` writes it into the plan). There the compute
     stream waits for the copy's event and the runtime lets the tensor go. The caching
     allocator then hands the block only to later compute-stream work, which runs after the
     copy: memory leaves the device at the op the simulation said, however far the host
     runs ahead of the GPU, and a slow copy costs a stall, never memory. A prefetch at or
     before the release point keeps the device tensor (it never left).
  4. Prefetch. When compute reaches op ``prefetch_at``, a device buffer is allocated on
     the compute stream and filled from the host slice on the prefetch stream, which first
     waits on the compute stream (the block may be memory compute has just released). The
     host slice returns to the pool when that copy's event completes.
  5. Use. Unpacking makes the compute stream wait on the prefetch event (nothing once it
     has completed) and returns the saved view over the restored storage. A handle
     unpacked before its prefetch (a step that does not follow the plan) is fetched on
     demand, and the host wait is counted as a stall. A handle keeps autograd's version
     check (holding the saved alias until forward lets the tensor go, or an offload's
     release point): if the saved tensor was modified in place after it was saved,
     unpacking raises the error eager PyTorch raises; so does a tensor the plan leaves alone (autograd does
     not check versions of tensors that went through saved-tensor hooks). Op by op, every
     write into a planned storage is seen as it happens; followed by hooks, the version is
     read when the alias goes, which is after every forward write (NOTE [hook points] 3).
  6. Recompute. The ops of a Recompute are recorded in forward (dropped tensors by
     reference into the recording, never by a reference that would keep them alive), with
     the RNG state before a random op; when the op before ``at_op`` ends (autograd unpacks
     a node's saved tensors before the node's first op runs), or, followed by hooks, at the
     first unpack of ``at_op``'s boundary, they are replayed with that state, into clones of
     any buffer they write, so running statistics stay as eager leaves them (_replay.py). A
     collective is never recorded: every rank calls it together, so a plan whose
     recomputation would re-run one raises ReplayError before it runs.
  7. Release. A slot's restored storage is dropped when the last handle of it is
     collected: autograd frees saved variables as their backward node finishes. A handle
     collected before its prefetch completed (never unpacked) first waits for that copy, so
     neither the block nor the host slice is reused while the copy still uses it.
  8. Unseen. The runtime's own tensor work (pool slices, copies, views over restored
     storage, replays) runs with Python dispatch disabled: it is not an op of the step, and
     a recorder watching the step counts the same ops as without the runtime.
  9. Exit. Leaving the context, normally or by an exception or KeyboardInterrupt, removes
     the mode and the hooks, waits for copies in flight, drops every reference held (the
     recorded replays too: the step object is in a reference cycle, and memory must not
     wait for the garbage collector) and returns the pool's slices; the pool itself stays
     for the next step (``OffloadRuntime.release`` gives it back).
"""

from __future__ import annotations

import threading
import weakref
from collections import deque
from dataclasses import dataclass
from functools import partial
from typing import Literal, Protocol

import torch
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode

from udnn_lab.analysis.recording import flat_tensors, records_op
from udnn_lab.analysis.step import view_replay
from udnn_lab.errors import PlanMismatch
from udnn_lab.graph.plan_ir import Offload, Plan, Recompute, TensorSite, check_plan, other_step
from udnn_lab.graph.step_graph import op_family
from udnn_lab.runtime._copies import Copies
from udnn_lab.runtime._hook_schedule import HookSchedule
from udnn_lab.runtime._replay import Replay, rng_state
from udnn_lab.runtime.pinned_pool import HostPool


@dataclass(frozen=True)
class StepStats:
    """What one step under the runtime moved and waited for."""

    ops: int | None  # ops the step ran; None when it was followed by its saved-tensor events (not counted)
    d2h_bytes: int
    h2d_bytes: int
    recomputed: int  # tensors rebuilt by replay
    wait_s: float  # host time blocked on copies
    on_demand: int  # handles unpacked before their prefetch
    by_hook_events: bool = False  # followed autograd's saved-tensor hooks alone, with no dispatch mode


class _Slot:
    """One planned storage during one step."""

    __slots__ = ("tensor", "action", "device_data", "key", "host", "host_offset", "offload_done", "restored",
                 "prefetch_done", "handles", "replay", "watchers", "saved")

    def __init__(self, tensor: int, action: Offload | Recompute) -> None:
        self.tensor, self.action = tensor, action
        self.device_data: torch.Tensor | None = None  # uint8 view of the original storage, held until copied out
        self.key: int | None = None  # id() of the original storage, while it lives
        self.host: torch.Tensor | None = None
        self.host_offset: int | None = None
        self.offload_done: torch.cuda.Event | None = None
        self.restored: torch.Tensor | None = None
        self.prefetch_done: torch.cuda.Event | None = None
        self.handles = 0
        self.saved: list[weakref.ref[_Handle]] = []  # its handles, to check when the storage is written
        self.replay: Replay | None = None
        self.watchers: list[weakref.ref] = []  # weakrefs whose callbacks follow the storage and the handles


class _Handle:
    """What autograd keeps instead of a planned tensor: which slot, and the view to rebuild."""

    __slots__ = ("slot", "dtype", "shape", "stride", "offset", "saved", "weak", "version", "stale", "__weakref__")

    def __init__(self, slot: _Slot, tensor: torch.Tensor) -> None:
        self.slot = slot
        self.dtype, self.shape, self.stride, self.offset = tensor.dtype, tuple(tensor.shape), tensor.stride(), \
            tensor.storage_offset()
        # autograd's version check, which a handle would lose (NOTE [offload runtime] 5). Autograd often packs
        # a fresh alias that shares the version counter: it is held until forward lets the tensor go (an
        # offload's until its release point, which is no earlier), when it costs no memory, then weakly.
        self.version, self.stale = tensor._version, False
        self.saved: torch.Tensor | None = tensor
        self.weak = weakref.ref(tensor)

    def saved_tensor(self) -> torch.Tensor | None:
        return self.saved if self.saved is not None else self.weak()

    def check(self) -> None:
        """Mark the handle stale if its saved tensor was written in place since it was saved."""
        saved = self.saved_tensor()
        if saved is not None and saved._version != self.version:
            self.stale = True


class _Kept:
    """A tensor the plan leaves alone, with its version when saved: autograd skips that check under hooks."""

    __slots__ = ("tensor", "version")

    def __init__(self, tensor: torch.Tensor, version: int) -> None:
        self.tensor, self.version = tensor, version


def _modified_in_place(dtype: torch.dtype, shape) -> None:
    raise RuntimeError(
        "one of the variables needed for gradient computation has been modified by an inplace operation: "
        f"a saved {dtype} tensor of shape {list(shape)} was written after it was saved (eager PyTorch refuses "
        "this step too: the step, not the plan, is wrong)")


class _Observer(Protocol):
    def adopt(self, tensor: torch.Tensor) -> None: ...


class OffloadRuntime:
    """``with OffloadRuntime(plan): loss_fn(model(x)).backward()`` carries the plan out.

    Made without a plan (or with ``enabled=False``) it does nothing, so a training loop
    reads the same either way. The host pool is allocated on first use and kept across
    steps; ``host_cap_bytes`` bounds it (default: half the host memory available).
    """

    def __init__(self, plan: Plan | None = None, *, enabled: bool = True, host_cap_bytes: int | None = None,
                 pool_bytes: int | None = None) -> None:
        self.plan = check_plan(plan)
        # a plan that moves nothing still follows the step by its hooks, where it carries them, to refuse another
        self.enabled = enabled and plan is not None and bool(plan.offloads or plan.recomputes or plan.hook_events)
        self.host_cap_bytes = host_cap_bytes
        self.pool_bytes = pool_bytes
        self.pool: HostPool | None = None
        self.observer: _Observer | None = None  # e.g. measure()'s recorder: told of storages the runtime allocates
        self.last_step: StepStats | None = None
        self._step: _Step | None = None
        self._schedule: HookSchedule | None = None  # built once: the plan's hook calls do not change

    def __enter__(self) -> OffloadRuntime:
        if self.enabled:
            self._step = _Step(self)
            self._step.start()
        return self

    def __exit__(self, exc_type, exc, traceback) -> Literal[False]:
        if self._step is not None:
            step, self._step = self._step, None
            self.last_step = step.finish(completed=exc_type is None)
        return False

    def release(self) -> None:
        """Give the host pool's memory back (pinned memory is scarce); the next step allocates it again."""
        if self._step is not None:
            raise RuntimeError("release() inside a step: leave the `with runtime:` block first")
        if self.pool is not None:
            pool, self.pool = self.pool, None
            pool.release()

    @property
    def follows(self) -> str:
        """How the runtime follows the step, in words: nothing to do, op by op, or by hooks (in how many windows)."""
        if not self.enabled:
            return "nothing (no plan to carry out)"
        schedule = self.hook_schedule()
        if schedule is None:
            return "op by op (a dispatch mode)"
        return f"by module and saved-tensor hooks ({schedule.windows})"

    def hook_schedule(self) -> HookSchedule | None:
        """A fresh count of the step's hook calls, when the plan can be followed by them (NOTE [hook points])."""
        plan = self.plan
        if self._schedule is None and plan is not None and plan.hook_events:
            recomputed = {t for r in plan.recomputes for t in r.tensors}
            points = {event.boundary for event in plan.hook_events}
            # forward lets a recomputed tensor go at a hook point, or in a recording window (NOTE [hook points] 6)
            let_go = {s.held_until + 1 for s in plan.sites if s.tensor in recomputed} & points
            acting = {o.after_op + 1 for o in plan.offloads} | {o.prefetch_at for o in plan.offloads} \
                | {o.release_op for o in plan.offloads} \
                | {o.wait_before for o in plan.offloads if o.wait_before is not None} \
                | {r.at_op for r in plan.recomputes} | let_go
            if (plan.recording or not plan.recomputes) and HookSchedule.covers(plan.hook_events, acting):
                self._schedule = HookSchedule(plan.hook_events, acting, plan.op_families,
                                              {o.tensor for o in plan.offloads} | recomputed, plan.recording)
        if self._schedule is not None:
            self._schedule.seen = 0
        return self._schedule

    def host_pool(self, device: torch.device) -> HostPool:
        if self.pool is None:
            needed = self.pool_bytes
            if not needed:
                assert self.plan is not None  # only steps ask for the pool, and only a runtime with a plan makes them
                needed = self.plan.host_pool_bytes
            self.pool = HostPool(needed, pinned=device.type == "cuda", cap_bytes=self.host_cap_bytes)
        return self.pool




class _Step:
    """The hooks, and the dispatch mode where one is needed, of one step (NOTE [offload runtime])."""

    def __init__(self, runtime: OffloadRuntime) -> None:
        self.runtime, plan = runtime, runtime.plan
        assert plan is not None  # a runtime makes steps only when enabled, and it is enabled only with a plan
        self.plan = plan
        self.index = 0
        self.copies: Copies | None = None  # made when the first planned tensor is found: before any action
        self.slots = {a.tensor: _Slot(a.tensor, a) for a in plan.offloads}
        for recompute in plan.recomputes:
            for tensor in recompute.tensors:
                self.slots[tensor] = _Slot(tensor, recompute)
        self.site_of = {site.tensor: site for site in plan.sites}
        self.sites: dict[int, list[TensorSite]] = {}
        self.let_go: dict[int, list[_Slot]] = {}  # recomputed tensors: forward lets them go before this op
        for site in plan.sites:
            if site.tensor in self.slots:  # a plan edited after located() may list sites it no longer acts on
                self.sites.setdefault(site.producer, []).append(site)
                if isinstance(self.slots[site.tensor].action, Recompute):
                    self.let_go.setdefault(site.held_until + 1, []).append(self.slots[site.tensor])
        self.by_key: dict[int, _Slot] = {}
        self.offload_after = _group(plan.offloads, "after_op")
        self.prefetch_at = _group(plan.offloads, "prefetch_at")
        self.release_at = _group(plan.offloads, "release_op")
        self.wait_at = _group([o for o in plan.offloads if o.wait_before is not None], "wait_before")
        self.replay_at: dict[int, list[Replay]] = {}
        self.recording: dict[int, list[Replay]] = {}
        for recompute in plan.recomputes:
            replay = Replay(recompute)
            # autograd unpacks a node's saved tensors before the node's first op: replay after the op before
            self.replay_at.setdefault(recompute.at_op - 1, []).append(replay)
            for op in recompute.ops:
                self.recording.setdefault(op, []).append(replay)
        self.watched = set(self.sites) | set(self.offload_after) | set(self.prefetch_at) | set(self.replay_at) \
            | set(self.recording) | set(self.release_at) | set(self.wait_at) | set(self.let_go)
        self.last_planned_op = max(self.watched, default=-1)
        self.families: dict = {}  # func -> its op_family, or "" for ops the trace does not count
        self.expected = plan.op_families  # NOTE [offload runtime] 1: the step must be the plan's step
        self.copying_in: deque[_Slot] = deque()  # prefetches in flight
        self.backend_ops: deque[str] = deque()  # ops a collective's backend runs next that the step does not have
        self.recomputed = self.on_demand = 0
        # NOTE [offload runtime] 1: by saved-tensor events where the plan carries them, else op by op
        self.events = runtime.hook_schedule()
        self._mode = _OpByOp(self) if self.events is None else None
        self._recorder = _Recording(self) if self.events is not None and plan.recomputes else None
        self._recording = False  # the recorder is on (NOTE [hook points] 6)
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks_on = False
        self._top_at_start: tuple | None = None  # autograd's innermost saved-tensor hooks when the step started
        self._module_hooks: tuple = ()
        self._views = view_replay()

    # -- lifetime ----------------------------------------------------------------------------
    def start(self) -> None:
        self._views.__enter__()  # NOTE [view replay] 2: the ops the trace saw
        self._top_at_start = torch._C._autograd._top_saved_tensors_default_hooks(False)
        try:
            if self._mode is not None:
                self._switch_hooks(True)
                self._mode.__enter__()
            else:
                assert self.events is not None  # no mode: the step is followed by its hook calls
                if self.events.whole_step:
                    self._switch_hooks(True)
                thread = threading.get_ident()  # module hooks are global: follow this thread's step only
                self._module_hooks = (
                    register_module_forward_pre_hook(lambda m, a: self._module_event(thread, "enter", m)),
                    register_module_forward_hook(lambda m, a, o: self._module_event(thread, "exit", m)))
        except BaseException:
            self._switch_hooks(False)
            self._views.__exit__(None, None, None)
            raise

    def _module_event(self, thread: int, kind: str, module: torch.nn.Module) -> None:
        if threading.get_ident() == thread and self.events is not None:
            boundary, switch, recording = self.events.module_called(kind, module)
            if recording is not None and recording < 0:
                self._switch_recording(None)
            if switch < 0:
                self._switch_hooks(False)
            if boundary is not None:
                self._at_boundary(boundary)
            if switch > 0:
                self._switch_hooks(True)
            if recording is not None and recording >= 0:
                self._switch_recording(recording)

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
            if self._mode is not None:
                self._mode.__exit__(None, None, None)
            if self._recording:  # an error inside a recording window
                self._switch_recording(None)
            for handle in self._module_hooks:
                handle.remove()
        finally:
            if self._hooks_on:  # NOTE [hook points] 5: on at the end of the step, or left on by an error
                self._hooks.__exit__(None, None, None)
                self._hooks_on = False
            self._views.__exit__(None, None, None)
        copies = self.copies
        for slot in self.slots.values():
            if copies is not None:
                copies.finish(slot.offload_done)
                copies.finish(slot.prefetch_done)
            slot.restored = slot.device_data = slot.prefetch_done = slot.offload_done = slot.host = None
            slot.watchers.clear()
            slot.saved.clear()
        self.copying_in.clear()
        self.by_key.clear()
        # The hooks and weakref callbacks make this object a reference cycle that only the
        # garbage collector frees: hold no tensor past the step (NOTE [offload runtime] 9).
        for slot in self.slots.values():
            slot.replay = None
        self.replay_at.clear()
        self.recording.clear()
        if self.runtime.pool is not None:
            self.runtime.pool.reset()
        if completed and self.events is not None:
            self.events.check_complete()
        elif completed and self.index < self.last_planned_op + 1:
            raise PlanMismatch(f"the step ran {self.index} ops but the plan acts up to op {self.last_planned_op} of a "
                               f"{self.plan.op_count}-op step: run forward and backward inside the runtime, "
                               "and plan again if the model, batch or optimizer changed")
        return StepStats(self.index if self.events is None else None, copies.d2h_bytes if copies else 0,
                         copies.h2d_bytes if copies else 0, self.recomputed, copies.wait_s if copies else 0.0,
                         self.on_demand, self.events is not None)

    # -- the op stream ------------------------------------------------------------------
    def on_op(self, func, args: tuple, kwargs: dict):
        """One op of the step, op by op (NOTE [offload runtime] 1)."""
        known = self.families.get(func)
        if known is None:
            known = self.families[func] = (op_family(str(func)) if records_op(func) else "", _written(func))
        family, written_args = known
        if not family:
            return func(*args, **kwargs)
        if self.backend_ops:  # NOTE [offload runtime] 1: gloo's copy-out after a reduce-scatter is not the step's
            if str(func) == self.backend_ops[0]:
                self.backend_ops.popleft()
                return func(*args, **kwargs)
            self.backend_ops.clear()
        index = self.index
        self.index += 1
        if index < len(self.expected) and family != self.expected[index]:
            self._mismatch(index, family)
        if family == _REDUCE_SCATTER and self.expected[index + 1:index + 2] != (_GLOO_COPY_OUT_FAMILY,):
            self.backend_ops.extend(_GLOO_COPY_OUT)
        if index in self.watched:
            return self._act(index, func, args, kwargs, written_args)
        out = func(*args, **kwargs)
        if written_args:
            self._count_writes(written_args, args, kwargs)
        return out

    def _act(self, index: int, func, args: tuple, kwargs: dict, written_args: tuple[int | str, ...]):
        """An op at which the plan acts: before it, after it, or by recording it for a replay."""
        self._before_op(index)
        out = self._call(index, func, args, kwargs)
        if written_args:
            self._count_writes(written_args, args, kwargs)
        for site in self.sites.get(index, ()):
            self._found(site, args, out)
        for offload in self.offload_after.get(index, ()):
            self._offload(self.slots[offload.tensor])
        for replay in self.replay_at.get(index, ()):
            self._replay(replay)
        return out

    def _call(self, index: int, func, args: tuple, kwargs: dict):
        """Run op ``index``, recording it for the replays that re-run it (NOTE [offload runtime] 6)."""
        recording = self.recording.get(index, ())
        if not recording:
            return func(*args, **kwargs)
        for replay in recording:
            replay.refuse(func)
        state = rng_state(func, self._device(args), kwargs)
        versions = [a._version if isinstance(a, torch.Tensor) else None for a in args]
        out = func(*args, **kwargs)
        written = tuple(i for i, (a, v) in enumerate(zip(args, versions)) if v is not None and a._version != v)
        for replay in recording:
            replay.record(func, args, kwargs, out, state, written)
        return out

    def on_recorded_op(self, func, args: tuple, kwargs: dict):
        """One op inside a recording window (NOTE [hook points] 6): counted, checked, recorded where planned."""
        known = self.families.get(func)
        if known is None:
            known = self.families[func] = (op_family(str(func)) if records_op(func) else "", _written(func))
        if not known[0]:
            return func(*args, **kwargs)
        index = self.index
        self.index += 1
        if index < len(self.expected) and known[0] != self.expected[index]:
            self._mismatch(index, known[0])
        for slot in self.let_go.get(index, ()):  # where no hook call stands for the op (NOTE [hook points] 6)
            _last_look(slot)
        return self._call(index, func, args, kwargs)

    def _count_writes(self, written: tuple[int | str, ...], args: tuple, kwargs: dict) -> None:
        """An op wrote in place into a planned storage: a handle whose saved tensor's version moved is stale (5).

        Version counters are per tensor, not per storage (``unsafe_split``'s chunks each have their own), so
        the check reads the saved tensors' own counters, as autograd does, while they are alive.
        """
        for where in written:
            value = args[where] if isinstance(where, int) and where < len(args) else kwargs.get(str(where))
            for tensor in flat_tensors((value,)):
                slot = self.by_key.get(id(tensor.untyped_storage()))
                for handle in _alive(slot.saved if slot is not None else ()):
                    handle.check()

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

    def _found(self, site, args, out) -> None:
        """The planned tensor is op ``site.producer``'s ``site.position``-th new storage (NOTE [offload runtime] 1)."""
        taken = {id(t.untyped_storage()) for t in flat_tensors(args)}
        fresh = []
        for tensor in flat_tensors((out,)):
            key = id(tensor.untyped_storage())
            if key not in taken:
                taken.add(key)
                fresh.append(tensor)
        if site.position >= len(fresh) or fresh[site.position].untyped_storage().nbytes() != site.nbytes:
            raise PlanMismatch(f"op {site.producer} did not make the {site.nbytes}-byte tensor the plan expects: the "
                               "step differs from the one the plan was made for; plan again for this model and batch")
        self._meet(self.slots[site.tensor], fresh[site.position], site.producer)

    def _meet(self, slot: _Slot, tensor: torch.Tensor, producer: int) -> None:
        """The planned storage is ``tensor``'s: follow it from here on."""
        slot.key = id(tensor.untyped_storage())
        self.by_key[slot.key] = slot
        if self.copies is None:
            self.copies = Copies(tensor.device)
        if isinstance(slot.action, Offload):
            slot.device_data = _bytes_of(tensor)
        else:
            for replay in self.recording.get(producer, ()):
                if slot.tensor in replay.recompute.tensors:
                    replay.restore_from(slot.tensor, slot.key)
                    slot.replay = replay
        slot.watchers.append(weakref.ref(tensor.untyped_storage(), partial(self._storage_gone, slot.key)))

    def _storage_gone(self, key: int, _ref) -> None:
        self.by_key.pop(key, None)

    # -- actions --------------------------------------------------------------------------
    def _offload(self, slot: _Slot) -> None:
        if slot.device_data is None:
            return
        assert self.copies is not None
        with torch._C._DisableTorchDispatch():  # NOTE [offload runtime] 8: not an op of the step
            pool = self.runtime.host_pool(self.copies.device)
            slot.host_offset, slot.host = pool.take(slot.device_data.numel())
            slot.offload_done = self.copies.to_host(slot.device_data, slot.host)

    def _release(self, slot: _Slot) -> None:
        """The release point (NOTE [offload runtime] 3): compute waits for the copy, the device tensor goes."""
        _last_look(slot)
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

    def _prefetch(self, slot: _Slot) -> None:
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

    def _replay(self, replay: Replay) -> None:
        """NOTE [offload runtime] 6: re-run the recorded forward ops before backward unpacks."""
        for tensor, value in replay.run().items():
            slot = self.slots[tensor]
            slot.restored = _bytes_of(value)
            self._adopt(slot.restored)
            self.recomputed += 1

    def _adopt(self, tensor: torch.Tensor) -> None:
        if self.runtime.observer is not None:
            self.runtime.observer.adopt(tensor)

    # -- autograd hooks ---------------------------------------------------------------------
    def _pack(self, tensor: torch.Tensor):
        """NOTE [offload runtime] 2: a handle for a planned storage, the tensor and its version otherwise."""
        if self.events is not None:  # NOTE [offload runtime] 1: the traced pack names the storage
            expected, boundary = self.events.packed(tensor)
            slot = self.slots.get(expected.tensor)
            if slot is not None and slot.key is None:
                self._meet_packed(slot, tensor)
            packed = _Kept(tensor, tensor._version) if slot is None else self._handle(slot, tensor)
            if boundary is not None:
                self._at_boundary(boundary)
            return packed
        slot = self.by_key.get(id(tensor.untyped_storage()))
        return _Kept(tensor, tensor._version) if slot is None else self._handle(slot, tensor)

    def _handle(self, slot: _Slot, tensor: torch.Tensor) -> _Handle:
        handle = _Handle(slot, tensor)
        slot.saved.append(weakref.ref(handle))
        slot.handles += 1
        slot.watchers.append(weakref.ref(handle, partial(self._handle_gone, slot)))
        return handle

    def _meet_packed(self, slot: _Slot, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        site = self.site_of[slot.tensor]
        if storage.nbytes() != site.nbytes:
            raise PlanMismatch(f"the step saved a {storage.nbytes()}-byte storage where the plan expects its "
                               f"{site.nbytes}-byte tensor (made by op {site.producer}): the step differs from the one "
                               "the plan was made for; plan again for this model and batch")
        self._meet(slot, tensor, site.producer)

    def _at_boundary(self, boundary: int) -> None:
        """After op ``boundary - 1`` and before op ``boundary`` (NOTE [hook points]): what the plan does there."""
        for offload in self.offload_after.get(boundary - 1, ()):
            self._offload(self.slots[offload.tensor])
        for replay in self.replay_at.get(boundary - 1, ()):
            self._replay(replay)
        self._before_op(boundary)

    def _before_op(self, index: int) -> None:
        for offload in self.prefetch_at.get(index, ()):
            self._prefetch(self.slots[offload.tensor])
        for offload in self.wait_at.get(index, ()):  # vDNN's per-layer sync
            if self.copies is not None:
                self.copies.use(self.slots[offload.tensor].offload_done)
        for offload in self.release_at.get(index, ()):
            self._release(self.slots[offload.tensor])
        for slot in self.let_go.get(index, ()):
            _last_look(slot)

    def _unpack(self, packed):
        """NOTE [offload runtime] 5: compute waits on the prefetch; the saved view over the restored storage."""
        if self.events is not None:
            boundary = self.events.unpacked()
            if boundary is not None:
                self._at_boundary(boundary)
        if isinstance(packed, _Kept):
            if packed.tensor._version != packed.version:
                _modified_in_place(packed.tensor.dtype, packed.tensor.shape)
            return packed.tensor
        slot = packed.slot
        if packed.stale:
            _modified_in_place(packed.dtype, packed.shape)
        if slot.restored is None:
            self._on_demand(slot)
        self.copies.use(slot.prefetch_done)
        with torch._C._DisableTorchDispatch():
            view = torch.empty(0, dtype=packed.dtype, device=slot.restored.device)
            view.set_(slot.restored.untyped_storage(), packed.offset, packed.shape, packed.stride)
        return view

    def _on_demand(self, slot: _Slot) -> None:
        self.on_demand += 1
        if isinstance(slot.action, Recompute):
            assert slot.replay is not None  # set when its producer ran: a valid plan re-runs every producer
            self._replay(slot.replay)
            return
        self._prefetch(slot)
        assert self.copies is not None
        self.copies.finish(slot.prefetch_done)

    def _handle_gone(self, slot: _Slot, _ref) -> None:
        """NOTE [offload runtime] 7: the last handle of a slot collected."""
        slot.handles -= 1
        if slot.handles <= 0 and slot.restored is not None:
            self._drop(slot)

    def _drop(self, slot: _Slot) -> None:
        assert self.copies is not None
        self.copies.finish(slot.prefetch_done)  # NOTE [offload runtime] 7: a copy may still use block and slice
        slot.restored = slot.device_data = slot.prefetch_done = slot.offload_done = None
        self._give_back(slot)

    def _give_back(self, slot: _Slot) -> None:
        if slot.host is not None and self.runtime.pool is not None:
            assert slot.host_offset is not None  # taken with the host slice
            self.runtime.pool.give_back(slot.host_offset)
        slot.host = slot.host_offset = None

    @staticmethod
    def _device(args) -> torch.device:
        first = next(flat_tensors(args), None)
        return first.device if first is not None else torch.device("cpu")


# gloo's reduce-scatter returns this rank's chunk by these two ops in work.wait(); NCCL, and the trace, reduce
# in place (NOTE [offload runtime] 1)
_REDUCE_SCATTER, _GLOO_COPY_OUT_FAMILY = "_reduce_scatter_base_", "split"
_GLOO_COPY_OUT = ("aten.split.Tensor", "aten.copy_.default")


class _OpByOp(TorchDispatchMode):
    """Follows a step op by op, for a plan the saved-tensor events cannot carry (NOTE [offload runtime] 1)."""

    def __init__(self, step: _Step) -> None:
        super().__init__()
        self.step = step

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return self.step.on_op(func, args, kwargs or {})


class _Recording(TorchDispatchMode):
    """Records a recomputation's forward ops, on only in its windows (NOTE [hook points] 6)."""

    def __init__(self, step: _Step) -> None:
        super().__init__()
        self.step = step

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return self.step.on_recorded_op(func, args, kwargs or {})


def _last_look(slot: _Slot) -> None:
    """Forward is done with the tensor: the last moment a write into it can be seen (5); the aliases go."""
    for handle in _alive(slot.saved):
        handle.check()
        handle.saved = None


def _alive(refs) -> list[_Handle]:
    return [handle for handle in (ref() for ref in refs) if handle is not None]


def _written(func) -> tuple[int | str, ...]:
    """Where an op writes in place: positions of written arguments (keyword-only ones by name)."""
    written: list[int | str] = []
    for position, argument in enumerate(func._schema.arguments):
        if argument.alias_info is not None and argument.alias_info.is_write:
            written.append(argument.name if argument.kwarg_only else position)
    return tuple(written)


def _group(actions, field_name: str) -> dict[int, list]:
    grouped: dict[int, list] = {}
    for action in actions:
        grouped.setdefault(getattr(action, field_name), []).append(action)
    return grouped


def _bytes_of(tensor: torch.Tensor) -> torch.Tensor:
    """A uint8 tensor over the whole storage of ``tensor`` (made without dispatch: not an op of the step)."""
    storage = tensor.untyped_storage()
    with torch._C._DisableTorchDispatch():
        return torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(storage)
