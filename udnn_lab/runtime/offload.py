"""The offload runtime: carries out a Plan around a training step. It chooses nothing.

NOTE [offload runtime]
  1. Identity. Where the plan carries the step's saved-tensor events (NOTE [hook points]:
     every action on a hook point, every recomputation in a recording window), the runtime
     counts module calls (of the modules it hooks: NOTE [hook points] 8), and autograd's pack
     and unpack calls inside its windows (NOTE [hook points] 5): each must be the traced one
     (a module by its class and mode, a pack by its tensor's autograd node, dtype and shape;
     every traced module's mode is checked as the step starts), so a step that differs
     (another activation, loss or mode) raises PlanMismatch at the first call that differs; a
     planned tensor is the storage packed at its first traced pack (its size is checked); the
     plan acts at the call that stands for its boundary. The step pays for the module hooks and the
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
     recomputation would re-run one raises ReplayError before it runs. An intermediate a
     replay makes goes after the last replayed op that reads it (at once where none does);
     a replay, or a module's re-run, runs out of every dispatch mode's sight (8), so it tells
     an observer counting the step's live bytes how far its peak was above what is alive once
     it ended (``LiveBytes.during``): what it made, which a counter of its own saw
     (``MadeBytes``), and the inputs it held, which go as it ends.
  7. Release. A slot's restored storage is dropped when the last handle of it is
     collected: autograd frees saved variables as their backward node finishes. The compute
     stream first waits for its prefetch (as an unpack made it wait: a stream wait, never the
     host's), and the block and the host slice go back at once: the block to later compute
     work only, and the slice to a later offload, whose copy waits for compute; so neither
     is reused while the copy still uses it. The host never blocks in the step: a wait there
     would drain the GPU's queue at every offloaded tensor, and the GPU would then idle while
     the host issued the next ops. The step's end waits for such a copy still in flight (9).
  8. Unseen. The runtime's own tensor work (pool slices, copies, views over restored
     storage, replays) runs with Python dispatch disabled: it is not an op of the step, and
     a recorder watching the step counts the same ops as without the runtime. A replay under
     an observer that counts live bytes runs with the step's modes set aside and a counter of
     its own in their place (6).
  9. Exit. Leaving the context, normally or by an exception or KeyboardInterrupt, removes
     the mode and the hooks, waits for copies in flight, drops every reference held (the
     recorded replays too: the step object is in a reference cycle, and memory must not
     wait for the garbage collector) and returns the pool's slices; the pool itself stays
     for the next step (``OffloadRuntime.release`` gives it back).
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Literal

import torch

from udnn_lab.errors import PlanMismatch
from udnn_lab.graph.plan_ir import Plan, check_plan
from udnn_lab.runtime._by_hooks import HookStep
from udnn_lab.runtime._by_ops import OpByOpStep
from udnn_lab.runtime._hook_schedule import HookSchedule
from udnn_lab.runtime._rerun import rerun_calls
from udnn_lab.runtime._slots import Observer, StepStats
from udnn_lab.runtime._step import Step
from udnn_lab.runtime._step_layout import StepLayout
from udnn_lab.runtime.pinned_pool import HostPool

__all__ = ["OffloadRuntime", "PlanMismatch", "StepStats"]


class OffloadRuntime:
    """``with OffloadRuntime(plan, model=model): loss_fn(model(x)).backward()`` carries the plan out.

    ``model`` is the traced model: the runtime then hooks only the modules the plan acts at (NOTE [hook points]
    8), as the simulator prices it; without it (or for another model) it hooks every module call, which costs
    each module call a little host time more.

    Made without a plan (or with ``enabled=False``) it does nothing, so a training loop
    reads the same either way. The host pool is allocated on first use and kept across
    steps; ``host_cap_bytes`` bounds it (default: half the host memory available).
    """

    def __init__(self, plan: Plan | None = None, *, model: torch.nn.Module | None = None, enabled: bool = True,
                 host_cap_bytes: int | None = None, pool_bytes: int | None = None) -> None:
        self.plan = check_plan(plan)
        self.model = model  # the traced model: its modules the plan needs are hooked alone (NOTE [hook points] 8)
        # a plan that moves nothing still follows the step by its hooks, where it carries them, to refuse another
        self.enabled = enabled and plan is not None and bool(plan.offloads or plan.recomputes or plan.hook_events)
        self.host_cap_bytes = host_cap_bytes
        self.pool_bytes = pool_bytes
        self.pool: HostPool | None = None
        self.observer: Observer | None = None  # e.g. measure()'s recorder: told of storages the runtime allocates
        self.last_step: StepStats | None = None
        self._step: Step | None = None
        self._schedule: HookSchedule | None = None  # built once: the plan's hook calls do not change
        self._layouts: dict[frozenset[int], StepLayout] = {}  # by the recomputations that re-run a module call

    def __enter__(self) -> OffloadRuntime:
        if self.enabled:
            schedule = self.hook_schedule()  # NOTE [offload runtime] 1: by its hook calls where it can, else op by op
            self._step = HookStep(self, schedule) if schedule is not None else OpByOpStep(self)
            self._step.start()
        return self

    def __exit__(self, exc_type, exc, traceback) -> Literal[False]:
        if self._step is not None:
            step, self._step = self._step, None
            self.last_step = step.finish(completed=exc_type is None)
        return False

    def for_model(self, model: torch.nn.Module) -> OffloadRuntime:
        """This runtime (its host pool kept) for ``model``, e.g. a copy of the traced one: ``with
        runtime.for_model(model): ...``. Its modules the plan acts at are the ones hooked (NOTE [hook points] 8)."""
        if self._step is not None:
            raise RuntimeError("for_model() inside a step: leave the `with runtime:` block first")
        if model is not self.model:
            self.model, self._schedule = model, None
        return self

    def release(self) -> None:
        """Give the host pool's memory back (pinned memory is scarce); the next step allocates it again."""
        if self._step is not None:
            raise RuntimeError("release() inside a step: leave the `with runtime:` block first")
        if self.pool is not None:
            pool, self.pool = self.pool, None
            pool.release()

    @property
    def replays_views(self) -> bool:
        """Whether a step run with this runtime needs view replay (NOTE [view replay] 4): its plan's step rebuilds a
        view's history, or there is no plan to say (the runtime then turns it on for its steps itself)."""
        return self.plan is None or self.plan.replays_views

    @property
    def follows(self) -> str:
        """How the runtime follows the step, in words: nothing to do, op by op, or by hooks (re-running how many
        module calls, in how many windows)."""
        if not self.enabled:
            return "nothing (no plan to carry out)"
        schedule = self.hook_schedule()
        if schedule is None:
            return "op by op (a dispatch mode)"
        reruns = len(schedule.reruns)
        again = f"{reruns} module call{'' if reruns == 1 else 's'} re-run, " if reruns else ""
        modules = schedule.modules
        hooked = "every module hooked" if modules is None else \
            f"{len(modules)} module{'' if len(modules) == 1 else 's'} hooked"
        return f"by module and saved-tensor hooks ({again}{schedule.windows}, {hooked})"

    def hook_schedule(self) -> HookSchedule | None:
        """A fresh count of the step's hook calls, when the plan can be followed by them (NOTE [hook points])."""
        plan = self.plan
        if self._schedule is None and plan is not None and plan.hook_events:
            acting, planned = plan.hook_actions()
            if (plan.recording or plan.reruns or not plan.recomputes) and HookSchedule.covers(plan.hook_events, acting):
                # a plan that moves nothing is followed only to refuse another step: every module call is checked
                model = self.model if plan.offloads or plan.recomputes else None
                self._schedule = HookSchedule(plan.hook_events, acting, plan.op_families, planned, plan.recording,
                                              rerun_calls(plan), model)
        if self._schedule is not None:
            self._schedule.seen = 0
        return self._schedule

    def step_layout(self, reruns: Collection[int]) -> StepLayout:
        """Where the plan acts in its step, worked out once (``reruns``: the recomputations re-running a call)."""
        key = frozenset(reruns)
        layout = self._layouts.get(key)
        if layout is None:
            assert self.plan is not None  # only steps ask for it, and only a runtime with a plan makes them
            layout = self._layouts[key] = StepLayout.of(self.plan, key)
        return layout

    def host_pool(self, device: torch.device) -> HostPool:
        if self.pool is None:
            needed = self.pool_bytes
            if not needed:
                assert self.plan is not None  # only steps ask for the pool, and only a runtime with a plan makes them
                needed = self.plan.host_pool_bytes
            self.pool = HostPool(needed, pinned=device.type == "cuda", cap_bytes=self.host_cap_bytes)
        return self.pool
