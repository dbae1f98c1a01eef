"""One rank of N in this process: a fake process group, and the two things DDP and FSDP2 need of it.

NOTE [one rank of N]
  1. A parallel trace runs the real DDP or FSDP2 code of one rank (0 by default) under fake tensors, in
     torch's fake process group (backend "fake", a FakeStore): each collective returns at once and moves
     nothing, so world size 1024 costs what 2 costs. DDP's ranks are alike; FSDP2's are but for uneven
     shards (a dimension that does not split evenly leaves the last ranks shorter ones), and rank 0
     holds the most.
  2. PyTorch's FSDPMemTracker recipe (fully_shard under FakeTensorMode) stops with
     DataDependentOutputException: aten._local_scalar_dense. The value is read by DeviceMesh, not by
     FSDP's step: fully_shard without a mesh makes the default one, and DeviceMesh.__init__ reads its
     rank map with ``.tolist()``, a tensor made under fake mode (so without values). The mesh is made
     here, before fake mode is entered, and handed to fully_shard.
  3. The fake group's works complete without a value, but DDP's reducer takes the all-reduced bucket
     from its work's future (its built-in all-reduce hook), and stops with "expected the hook result is
     either a Tensor or a TensorList found None". ``CompletedCollectives`` gives each collective's work a
     future holding the collective's tensors, as gloo's and NCCL's works have.
  4. DDP rebuilds its buckets once, in the order gradients came in the first backward, before the
     second forward; on the way rank 0 broadcasts the new bucket layout in two small int tensors it
     writes and reads on the host. ``rebuild_buckets`` runs that rebuild after the trace's warm-up step,
     the ops on those host tensors (no fake tensor among their arguments) running for real.
  5. A DDP or FSDP2 rank can also be traced inside the job that runs it (a trainer's callback on each rank): the
     process's own group stays as it is, and the fake group is a new group of all its ranks with the fake
     backend (a 1-D mesh: HSDP's 2-D one is traced outside a job). ``new_group`` must be called by every rank
     in the same order, which holds where each rank traces its step at the same point of the job. The trace
     is then of this process's rank in its world.
  6. With ``find_unused_parameters``, DDP's reducer keeps which parameters a step used in int32 tensors it
     makes as it is built, sets in its autograd hooks and reads (``item()``) as backward ends. The copy is
     built under ``HostIndices`` so that those tensors are real, and the step runs with ``HostIndices(
     made_from_nothing=False)`` above the recorder, so that ops on real int32 tensors alone run for real,
     unrecorded: host bookkeeping of 4 bytes a parameter (an optimizer's real step counters are float and
     still recorded). Every parameter the step reaches is marked used, as in a real
     rank; the fake group's all-reduce of the marks moves nothing, so a parameter used on another rank only
     is taken as unused here.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import _create_work_from_future
from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.nn.parallel import DistributedDataParallel
from torch.testing._internal.distributed.fake_pg import FakeStore  # registers "fake"; FakeStore on any torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes, is_traceable_wrapper_subclass_type
from torch.utils._pytree import tree_leaves

_INT_DTYPES = (torch.int32, torch.int64)


@contextmanager
def fake_process_group(world_size: int, rank: int = 0, mesh_shape: tuple[int, ...] | None = None,
                       mesh_dim_names: tuple[str, ...] | None = None,
                       in_a_job: bool = False) -> Iterator[DeviceMesh]:
    """This process as ``rank`` of ``world_size`` in a fake process group; yields its CPU mesh, 1-D unless
    ``mesh_shape`` says otherwise (NOTE [one rank of N] 2). The group is destroyed on exit, whatever happened.
    ``in_a_job``: in a process that has a process group, the fake one is made beside it (NOTE [one rank of N] 5)."""
    if dist.is_initialized():
        if not in_a_job or mesh_shape is not None:
            raise RuntimeError(
                "a parallel trace runs one rank of a fake process group of its own, and this process already has a "
                "process group: trace before torch.distributed.init_process_group, or in a process without one "
                "(a DDP or FSDP2 rank can be traced in its job, over a 1-D mesh)")
        job = (dist.get_world_size(), dist.get_rank())
        if job != (world_size, rank):
            raise RuntimeError(f"a trace inside a job is of this process's rank: it is rank {job[1]} of {job[0]}, "
                               f"the trace was asked for rank {rank} of {world_size}")
        group = dist.new_group(backend="fake")
        assert isinstance(group, dist.ProcessGroup)  # every rank is in it
        try:
            yield DeviceMesh.from_group(group, "cpu", mesh_dim_names=mesh_dim_names)
        finally:
            dist.destroy_process_group(group)
        return
    hook = sys.excepthook  # init_process_group wraps it to prefix "[rank0]: " and destroying the group leaves it
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield init_device_mesh("cpu", mesh_shape or (world_size,), mesh_dim_names=mesh_dim_names)
    finally:
        dist.destroy_process_group()
        sys.excepthook = hook


class CompletedCollectives(TorchDispatchMode):
    """Each collective's work holds a future with the collective's tensors (NOTE [one rank of N] 3)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(is_traceable_wrapper_subclass_type(t) for t in types):
            return NotImplemented  # a DTensor runs its own dispatch first (NOTE [wrapper tensors])
        out = func(*args, **(kwargs or {}))
        if func.namespace == "c10d" and isinstance(out, tuple) and len(out) == 2 \
                and isinstance(out[1], torch.ScriptObject):
            future = torch.futures.Future()
            future.set_result(out[0])
            return out[0], _create_work_from_future(future).boxed()
        return out


class HostIndices(TorchDispatchMode):
    """Ops on real tensors only, and (``made_from_nothing``) int tensors made from nothing, run for real (NOTE [one
    rank of N] 4, 6)."""

    def __init__(self, made_from_nothing: bool = True) -> None:
        super().__init__()
        self.made_from_nothing = made_from_nothing

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        made_on_host = self.made_from_nothing and not tensors and kwargs.get("dtype") in _INT_DTYPES
        real = bool(tensors) and not any(isinstance(t, FakeTensor) for t in tensors)
        if self.made_from_nothing and (made_on_host or real):
            with unset_fake_temporarily():  # the collectives' mode below still sees it (3)
                return func(*args, **kwargs)
        if real and all(t.dtype == torch.int32 for t in tensors):  # the used-parameter marks (6): unrecorded
            with _disable_current_modes():
                return func(*args, **kwargs)
        return func(*args, **kwargs)


def rebuild_buckets(model: torch.nn.Module) -> None:
    """DDP's one rebuild of its gradient buckets, as its second forward would start with it (NOTE [one rank of
    N] 4); nothing for another model."""
    if isinstance(model, DistributedDataParallel):
        with HostIndices():
            model.reducer._rebuild_buckets()
