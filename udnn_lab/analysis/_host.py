"""Which storages of an FSDP2 rank that offloads its parameters live on the host, and the copies that cross.

NOTE [host storages]
  1. With ``CPUOffloadPolicy`` FSDP2 keeps each parameter's shard (``FSDPParam._sharded_param_data``) in pinned
     host memory; gradients come back to the host and the optimizer steps there, so its state is made there too.
     Twice per step a storage crosses: ``FSDPParam.all_gather_inputs`` copies the shard to the device before the
     all-gather (``.to(self.device, non_blocking=True)``, then mixed precision's cast), and ``foreach_reduce``
     copies each parameter's view of the reduce-scatter output to the host (``.to(torch.device("cpu"))``).
  2. A trace whose CPU kernels stand in for the device's runs FSDP2 on a CPU mesh (NOTE [one rank of N]), where
     both copies are no-ops that no dispatch mode sees (and autograd runs backward without the caller's torch
     function modes, so a ``Tensor.to`` cannot be caught there either). ``HostCopies`` makes them where every
     mode sees them. Outside the optimizer step nothing but that copy reads a shard, so an op reading a shard
     (the all-gather's copy-in, or mixed precision's cast) reads its device copy, made by an ``aten._to_copy``
     just before it and dropped when FSDP2 drops it (right after the cast; after the all-gather for a copy-in,
     whose inputs ``foreach_all_gather`` holds until it has issued the all-gather). FSDP2 makes a copy-in's
     copies just before it allocates the all-gather's buffer, not after: the same bytes are live at the
     copy-in. A gradient is copied by a post-accumulate-grad hook on each sharded parameter, which
     ``foreach_reduce`` calls right after it sets the gradient, the point its own copy would have been made:
     the gradient's local tensor, a view of the reduce-scatter's output (or of its cast to the parameters'
     dtype; a shard group of one rank copies the reduce-scatter's input into that output instead), is replaced
     by its copy on the host, and the output goes when ``foreach_reduce`` lets go of it. (Copying in place of
     the ``as_strided`` view would not do: autograd marks what a view op returns as a view of its input, and
     that keeps the output alive.) When a gradient accumulates (micro-batches), its ``add_`` reads the view's
     copy on the host.
  3. The recorder knows each storage's side: the shards and the optimizer's state are on the host when the
     step starts; a copy lives where ``HostCopies`` says; any other op's new storages live on the host when
     everything it reads does, and on the device otherwise (an op runs where its operands are), except that the
     optimizer step, which runs on the host, allocates its operand-less scalars there too. A CPU scalar the
     optimizer reads beside device tensors (a GradScaler's scale) is counted on the device: a few bytes.
  4. Fake tensors cannot be pinned (fake mode has no kernel for it): ``PinnedCopies`` runs a pin as the copy
     it is, so FSDP2 runs its pinning code; pinning changes which host memory holds the bytes, not how many.
  5. A trace counted on the CPU itself leaves FSDP2 as it is: there host and device are one memory and FSDP2's
     copies are no-ops for real.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, replace

import torch
from torch import nn
from torch.distributed.fsdp._fully_shard import _fsdp_collectives  # defines the fsdp ops  # noqa: F401
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map_only

from udnn_lab.analysis._fake.memo import flat_tensors
from udnn_lab.analysis._recorder import records_op
from udnn_lab.analysis._sharded import fsdp_params
from udnn_lab.graph.step_graph import Graph
from udnn_lab.units import format_bytes

_PIN = torch.ops.aten._pin_memory.default
_CAST = torch.ops.aten._to_copy.default  # a copy across devices, or to another dtype
_ADD_ = torch.ops.aten.add_.Tensor
_COPY_ = torch.ops.aten.copy_.default
_CHUNK_CAT = torch.ops.fsdp.chunk_cat.default
_COPY_IN = torch.ops.fsdp.all_gather_copy_in.default
_REDUCE_SCATTERS = (torch.ops.c10d._reduce_scatter_base_.default,
                    torch.ops._c10d_functional.reduce_scatter_tensor.default)


@dataclass(frozen=True)
class OffloadedShard:
    """A parameter shard FSDP2 keeps on the host."""

    tensor: torch.Tensor  # FSDPParam._sharded_param_data (the local shard is a view of it)
    name: str  # the parameter's name


def offloaded_shards(model: nn.Module) -> list[OffloadedShard]:
    """The host shards of every FSDP2 unit in ``model`` that offloads its parameters (none otherwise)."""
    found = []
    for param in fsdp_params(model):
        if not param.offload_to_cpu:
            continue
        if hasattr(param._sharded_local_tensor, "fsdp_pre_all_gather"):
            raise ValueError(
                f"parameter {param._param_fqn!r} is a {type(param._sharded_local_tensor).__name__}, which "
                "FSDP2 all-gathers through its own fsdp_pre_all_gather: with offload_params its copies to "
                "the device are not traced. Trace it without offload_params")
        found.append(OffloadedShard(param._sharded_param_data, param._param_fqn))
    return found


class HostCopies(TorchDispatchMode):
    """FSDP2's offload copies, made where the step would make them (NOTE [host storages] 2).

    Entered inside the recorder (as a runtime is), so that the recorder records the copies as ops; its
    ``observer`` is that recorder, told of each copy's side and name. ``shards``: the host shards' storages by
    id, with their parameters' names.
    """

    def __init__(self, shards: dict[int, str]) -> None:
        super().__init__()
        self.shards = shards
        self.observer = None  # the StepRecorder (record_step sets it)
        self.reduced: set[int] = set()  # ids of reduce-scatter outputs and their casts, while they live
        self.scattered: set[int] = set()  # ids of reduce-scatter inputs, while they live
        self.copies: dict[int, str] = {}  # id of a device copy's storage -> its name, while it lives
        self._held: list[torch.Tensor] = []  # a copy-in's device copies, until the all-gather has run
        self._hold_for = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self._hold_for and records_op(func):
            self._hold_for -= 1
            if not self._hold_for:
                self._held = []
        optimizer = self.observer is not None and self.observer.phase == "optimizer"
        copies: list[torch.Tensor] = []
        reads_shard = any(_storage_id(t) in self.shards for t in flat_tensors((args, kwargs)))
        if reads_shard and not optimizer and records_op(func):
            args, kwargs = tree_map_only(torch.Tensor, lambda t: self._to_device(t, copies), (args, kwargs))
        if func is _ADD_ and not optimizer and _storage_id(args[1]) in self.reduced and self.observer is not None \
                and self.observer.is_on_host(args[0]):  # a gradient accumulating on the host
            args = (args[0], self._to_host(args[1]), *args[2:])
        out = func(*args, **kwargs)
        if func is _CAST and not optimizer and _storage_id(args[0]) in self.copies:  # mixed precision's cast
            self._place(out, False, f"{self.copies[_storage_id(args[0])]}, {str(out.dtype).removeprefix('torch.')}")
        elif func in _REDUCE_SCATTERS:
            self._reduced(args[0])
        elif func is _CHUNK_CAT:  # the reduce-scatter's input, which a shard group of one rank copies out instead
            self._reduced(kwargs["out"], self.scattered)
        elif func is _COPY_ and _storage_id(args[1]) in self.scattered:
            self._reduced(args[0])
        elif func is _CAST and "dtype" in kwargs and _storage_id(args[0]) in self.reduced:
            self._reduced(out)  # the reduced gradients cast to the parameters' dtype
        if copies and func is _COPY_IN:
            self._held, self._hold_for = copies, 2
        return out

    def _to_device(self, tensor: torch.Tensor, copies: list[torch.Tensor]) -> torch.Tensor:
        key = _storage_id(tensor)
        name = self.shards.get(key) if key is not None else None
        if name is None:
            return tensor
        copy = _CAST(tensor)
        copies.append(copy)
        self._place(copy, False, f"{name} (device copy)")
        return copy

    def gradient_to_host(self, param: torch.Tensor) -> None:
        """A post-accumulate-grad hook: the gradient FSDP2 just set, from the reduce-scatter's output, goes to the
        host (NOTE [host storages] 2)."""
        local = param.grad._local_tensor  # type: ignore[union-attr]  # a DTensor's tensor on this rank
        if _storage_id(local) in self.reduced:
            param.grad._local_tensor = self._to_host(local)  # type: ignore[union-attr]  # as FSDP2 replaces it

    def _to_host(self, tensor: torch.Tensor) -> torch.Tensor:
        copy = _CAST(tensor)
        self._place(copy, True, None)
        return copy

    def _reduced(self, tensor: torch.Tensor, into: set[int] | None = None) -> None:
        storage = tensor.untyped_storage()
        key = id(storage)
        found = self.reduced if into is None else into
        found.add(key)
        weakref.finalize(storage, found.discard, key)  # ids are reused once a storage is gone

    def _place(self, tensor: torch.Tensor, on_host: bool, name: str | None) -> None:
        if name is not None:
            storage = tensor.untyped_storage()
            key = id(storage)
            self.copies[key] = name
            weakref.finalize(storage, self.copies.pop, key, None)
        if self.observer is not None:
            self.observer.place(tensor, on_host, None if on_host else "communication", name)


def _storage_id(value: object) -> int | None:
    """The id of a tensor's storage; None for anything else (an op's scalar argument)."""
    if not isinstance(value, torch.Tensor):
        return None
    try:
        return id(value.untyped_storage())
    except (RuntimeError, NotImplementedError):
        return None


class PinnedCopies(TorchDispatchMode):
    """Pinning a fake tensor copies it (NOTE [host storages] 4)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is _PIN:
            return torch.ops.aten.clone.default(args[0])
        return func(*args, **(kwargs or {}))


HOST_NOTE_START = "parameters offloaded (FSDP2's CPUOffloadPolicy)"


def with_host_note(graph: Graph) -> Graph:
    """``graph`` with a note of what the rank keeps in host memory (NOTE [host storages])."""
    host = graph.breakdown()["host_bytes"]
    note = (f"{HOST_NOTE_START}: this rank's host memory holds "
            f"{format_bytes(host['parameter'])} of sharded parameters, {format_bytes(host['parameter_gradient'])} "
            f"of gradients and {format_bytes(host['optimizer_state'])} of optimizer state, "
            f"{format_bytes(graph.host_peak_bytes)} at most with the optimizer step's scratch (the breakdown's "
            "host_bytes); the optimizer steps there. The device holds each block's copies of its shards for the "
            "all-gather, and each reduced gradient shard until it is copied to the host")
    return replace(graph, notes=(*graph.notes, note))
