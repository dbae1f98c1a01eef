"""Following a step op by op, under a dispatch mode (NOTE [offload runtime] 1): for a plan its hook calls cannot
carry (NOTE [hook points] 4)."""

from __future__ import annotations

import weakref
from collections import deque
from functools import partial

import torch

from udnn_lab.analysis.recording import flat_tensors
from udnn_lab.errors import PlanMismatch
from udnn_lab.runtime._slots import Handle, Kept, OpMode, Owner, Slot, alive
from udnn_lab.runtime._step import Step

# gloo's reduce-scatter returns this rank's chunk by these two ops in work.wait(); NCCL, and the trace, reduce
# in place (NOTE [offload runtime] 1)
_REDUCE_SCATTER, _GLOO_COPY_OUT_FAMILY = "_reduce_scatter_base_", "split"
_GLOO_COPY_OUT = ("aten.split.Tensor", "aten.copy_.default")


class OpByOpStep(Step):
    """Counts every op of the step and acts at the plan's op indices."""

    def __init__(self, runtime: Owner) -> None:
        super().__init__(runtime)
        self.backend_ops: deque[str] = deque()  # ops a collective's backend runs next that the step does not have
        self.watched = self.layout.acted_at
        self.last_planned_op = max(self.watched, default=-1)
        self.by_key: dict[int, Slot] = {}  # the planned storages met, by id, while they live
        self._mode = OpMode(self.on_op)  # every op of the step (NOTE [offload runtime] 1)

    def _begin(self) -> None:
        self._switch_hooks(True)
        self._mode.__enter__()

    def _end(self) -> None:
        self._mode.__exit__(None, None, None)
        self.by_key.clear()

    def _check_complete(self) -> None:
        if self.index < self.last_planned_op + 1:
            raise PlanMismatch(f"the step ran {self.index} ops but the plan acts up to op {self.last_planned_op} of a "
                               f"{self.plan.op_count}-op step: run forward and backward inside the runtime, "
                               "and plan again if the model, batch or optimizer changed")

    def _ops_seen(self) -> int | None:
        return self.index

    def on_op(self, func, args: tuple, kwargs: dict):
        """One op of the step, op by op (NOTE [offload runtime] 1)."""
        family, written_args = self._known(func)
        if not family:
            return func(*args, **kwargs)
        if self.backend_ops:  # NOTE [offload runtime] 1: gloo's copy-out after a reduce-scatter is not the step's
            if str(func) == self.backend_ops[0]:
                self.backend_ops.popleft()
                return func(*args, **kwargs)
            self.backend_ops.clear()
        index = self._counted(family)
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
        for site in self.layout.sites.get(index, ()):
            self._found(site, args, out)
        self._after_op(index)
        return out

    def _count_writes(self, written: tuple[int | str, ...], args: tuple, kwargs: dict) -> None:
        """An op wrote in place into a planned storage: a handle whose saved tensor's version moved is stale (5).

        Version counters are per tensor, not per storage (``unsafe_split``'s chunks each have their own), so
        the check reads the saved tensors' own counters, as autograd does, while they are alive.
        """
        for where in written:
            value = args[where] if isinstance(where, int) and where < len(args) else kwargs.get(str(where))
            for tensor in flat_tensors((value,)):
                slot = self.by_key.get(id(tensor.untyped_storage()))
                for handle in alive(slot.saved if slot is not None else ()):
                    handle.check()

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
        slot = self.slots[site.tensor]
        self._meet(slot, fresh[site.position], site.producer)
        assert slot.key is not None  # set by _meet
        self.by_key[slot.key] = slot
        slot.watchers.append(weakref.ref(fresh[site.position].untyped_storage(), partial(self._storage_gone, slot.key)))

    def _storage_gone(self, key: int, _ref) -> None:
        self.by_key.pop(key, None)

    def _pack(self, tensor: torch.Tensor) -> Handle | Kept:
        """NOTE [offload runtime] 2: the storage met at its producer (1) names the slot."""
        slot = self.by_key.get(id(tensor.untyped_storage()))
        return Kept(tensor, tensor._version) if slot is None else self._handle(slot, tensor)
