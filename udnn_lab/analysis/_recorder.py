"""Record one training step at the level of aten ops: ops, storages, their lives.

The same recorder serves ``trace`` (fake tensors: nothing is allocated) and
``measure`` (real tensors: the live bytes it reports are the storages that exist).

NOTE [storage lifetimes]
  1. A storage is identified by its Python ``UntypedStorage`` object. PyTorch keeps
     that object alive for as long as the C++ storage lives (PyObject preservation),
     so ``id()`` of it is stable while it lives, and a weakref callback on it fires
     exactly when the storage is released.
  2. The recorder holds weakrefs and ints only, never a tensor or a storage, so it
     does not delay any release it observes.
  3. A release observed while op ``i`` is the latest recorded op is attributed to
     "right after op ``i``": it happened before op ``i + 1`` started.
  4. The callback runs on the thread that lets go last: in a real run with several
     ranks, that can be a collective backend's worker thread (gloo's, NCCL's watchdog)
     finishing with a buffer after the step has; the release is then attributed to the
     op recorded latest at that moment, which is when the memory came back.

NOTE [host reads in the optimizer step]
  1. Some optimizer steps read a tensor's value on the host: the GradScaler's inf check
     (``found_inf.item()``, which decides whether the optimizer steps at all) and Adafactor's
     parameter and update norms (which only scale its update). Fake tensors have no values.
  2. So a fake step reads zero there: the steady step, in which the GradScaler finds no inf
     and the optimizer steps (a step that overflows is skipped, and is not the one traced);
     Adafactor's norms then give its smallest step size, which changes no op and no size.
  3. Only in the optimizer phase: a value read in forward or backward can decide which ops
     run, and the trace stops there (FakeTensorUnsupported).

NOTE [wrapper tensors]
  A tensor subclass that wraps others (DTensor: FSDP2's sharded parameters, their gradients and
  optimizer state) owns no storage of its own. The recorder lets such a subclass run its own
  dispatch first (it answers NotImplemented), so it sees the ops the subclass runs on the plain
  tensors inside, which own the storages; a wrapper registered by role stands for its first inner
  tensor (a DTensor for its local shard).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import cache, partial
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.distributed.distributed_c10d import GroupName, _resolve_process_group
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass_type
from torch.utils._pytree import tree_flatten

from udnn_lab.analysis._fake.fast_paths import FakeFastPaths
from udnn_lab.analysis._fake.tensors import HOST_READ, zero_of
from udnn_lab.analysis._op_work import OpWork
from udnn_lab.analysis._sharded import ResizedStorage
from udnn_lab.analysis._view_writes import ViewWrites
from udnn_lab.graph.step_records import HookEvent
from udnn_lab.vocabulary import AUTOGRAD_SCOPE, COLLECTIVE_NAMESPACES, OPTIMIZER_SCOPE, Category, traced_op

_NO_SEQUENCE = 2**64 - 1  # sequence number of AccumulateGrad nodes
# Not recorded: metadata queries (prim.device), profiler markers, and detach, which never
# allocates and whose placement moves when saved-tensor hooks are installed (so a traced
# step and a plain eager step would otherwise disagree on op indices).
_SKIP, _RECORD, _COLLECTIVE = "skip", "record", "collective"


@cache
def records_op(func) -> bool:
    """Whether ops of this kind are recorded: every tool that aligns to a Graph skips the same ones."""
    return traced_op(func)


@dataclass(slots=True)
class StorageRecord:
    """Mutable while recording; frozen into a TensorInfo afterwards."""

    sid: int
    nbytes: int
    dtype: str
    shape: tuple[int, ...]
    device: str
    producer: int | None
    alloc_step: int
    fake: bool = False  # a fake tensor's storage (a real one may sit beside it, e.g. a step counter)
    communicated: bool = False  # a collective (all-reduce, all-gather, ...) read or wrote it
    on_host: bool = False  # in host memory while the step's kernels stand in for the device's (NOTE [host storages])
    role: Category | None = None  # preset category: parameter, buffer, input, optimizer_state, ...
    name: str | None = None
    free_step: int | None = None
    consumers: list[int] = field(default_factory=list)
    saved_nodes: list[int] = field(default_factory=list)  # autograd sequence numbers


@dataclass(slots=True)
class OpRecord:
    index: int
    phase: str
    module: str
    name: str
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    allocated: tuple[int, ...]
    forward_op: int | None
    output_shapes: tuple[tuple[int, ...], ...]
    flops: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    released: list[int] = field(default_factory=list)
    ranks: int = 1  # a collective's process group size
    rank_stride: int = 1  # distance between its consecutive global ranks


@dataclass
class CallRecord:
    path: str
    type: str
    first_op: int
    last_op: int = -1
    outputs: tuple[int, ...] = ()


class StepRecorder(TorchDispatchMode):
    """A dispatch mode that records ops and storage lives (see NOTE [storage lifetimes])."""

    def __init__(self, after_op: Callable[[], None] | None = None, fake_mode: FakeTensorMode | None = None,
                 fast_paths: bool = True) -> None:
        """``after_op`` is called after each recorded op, e.g. to read CUDA allocator counters.

        ``fake_mode``: the step runs on fake tensors of this mode, and ops run as NOTE [fake
        fast paths] (_fake/fast_paths.py) says; ``fast_paths=False`` leaves them to fake mode.
        """
        super().__init__()
        self.after_op = after_op
        self._fake = FakeFastPaths(fake_mode, fast_paths) if fake_mode is not None else None
        self.known: Any = None  # a fake trace's KnownValues: it answers reads of what it knows (NOTE [known values])
        self.storages: list[StorageRecord] = []
        self.ops: list[OpRecord] = []
        self.calls: list[CallRecord] = []
        self.phase = "forward"
        self.scope: str | None = None  # overrides the module path (loss, optimizer)
        self.recording = False
        self.module_stack: list[tuple[str, str, list[tuple[int, ...]]]] = []  # path, type, input shapes
        self._open_calls: list[CallRecord] = []
        self._live: dict[int, int] = {}  # id(storage) -> sid, live storages only
        self._refs: dict[int, weakref.ref] = {}
        self._work = OpWork()
        self._names: dict = {}  # op -> its name
        self._kinds: dict = {}  # op -> _SKIP, _RECORD or _COLLECTIVE
        self._wrappers: dict[type, bool] = {}  # tensor type -> wraps other tensors (NOTE [wrapper tensors])
        self._resizable: dict[int, list] = {}  # storage id -> [weakref to it, bytes last seen, ResizedStorage]
        self.resized: set[int] | None = None  # ids of storages resized since the last poll (None: not known)
        self._refilled: list[int] = []  # sids refilled before the op about to be recorded
        self._sequence_to_op: dict[int, int] = {}
        self._last_sequence = torch._C._autograd._get_sequence_nr()
        self._param_paths: dict[int, str] = {}  # id(parameter) -> name, for AccumulateGrad nodes
        self._module_paths: dict[int, str] = {}  # id(module) -> its path, while watching a model
        self.hook_events: list[HookEvent] = []  # in the order the hooks were called
        self.graded: frozenset[str] | None = None  # parameters holding a gradient at the step's end
        self.view_writes = ViewWrites()  # NOTE [view replay] 4
        self.tracks_host = False  # some storages live on the host: follow each one's side (NOTE [host storages] 3)
        # a real step on a CPU: (op, live bytes seen with what recomputations before it made, storages known then)
        # for each recomputation's run (NOTE [offload runtime] 6); None: not counted
        self.replayed: list[tuple[int, int, int]] | None = None

    # -- storages ------------------------------------------------------------------------
    def sid_of(self, tensor: torch.Tensor, produced: bool = False) -> int | None:
        """The storage id of ``tensor``, registering its storage if unseen.

        ``produced``: an unseen storage is an output of the op being recorded (else it
        came from outside the dispatcher, e.g. a constant, and has no producer).
        """
        tensor = _innermost(tensor)
        try:
            storage = tensor.untyped_storage()
        except (RuntimeError, NotImplementedError):
            return None  # sparse and other storage-less tensors are not tracked
        key = id(storage)
        sid = self._live.get(key)
        if sid is None:
            sid = self._new_storage(storage, tensor, key, produced)
        return sid

    def _new_storage(self, storage, tensor: torch.Tensor, key: int, produced: bool) -> int:
        sid = len(self.storages)
        step = len(self.ops) if (self.recording and produced) else -1  # unseen inputs existed before
        self.storages.append(StorageRecord(
            sid=sid, nbytes=storage.nbytes(), dtype=str(tensor.dtype).removeprefix("torch."),
            shape=tuple(tensor.shape), device=tensor.device.type,
            producer=step if produced and step >= 0 else None, alloc_step=step, fake=isinstance(tensor, FakeTensor),
        ))
        self._live[key] = sid
        self._refs[key] = weakref.ref(storage, partial(self._released, key, sid))
        return sid

    def _released(self, key: int, sid: int, _ref) -> None:
        if self._live.get(key) == sid:
            del self._live[key]
            del self._refs[key]
        if self.recording:
            step = len(self.ops) - 1  # NOTE [storage lifetimes] 3
            self.storages[sid].free_step = step
            if step >= 0:
                self.ops[step].released.append(sid)

    def register(self, tensor: torch.Tensor, role: Category, name: str) -> int | None:
        """Mark a tensor that exists before the step (parameter, input, ...) or ends as a role."""
        sid = self.sid_of(tensor)
        if sid is not None:
            record = self.storages[sid]
            if record.role is None or role in ("parameter_gradient", "optimizer_state"):
                record.role, record.name = role, name
        return sid

    def starts_on_host(self, tensor: torch.Tensor) -> None:
        """A tensor that exists before the step and lives on the host (NOTE [host storages] 3); call before it."""
        sid = self.sid_of(tensor)
        if sid is not None:
            self.storages[sid].on_host = True

    def is_on_host(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor``'s storage is one the recorder knows on the host (NOTE [host storages] 3)."""
        sid = self._live.get(id(_innermost(tensor).untyped_storage()))
        return sid is not None and self.storages[sid].on_host

    def place(self, tensor: torch.Tensor, on_host: bool, role: Category | None = None,
              name: str | None = None) -> None:
        """The side (and role) of a copy the op just recorded made, whatever its inputs (NOTE [host storages] 2)."""
        if not self.recording:
            return
        sid = self.sid_of(tensor, produced=True)
        if sid is not None:
            record = self.storages[sid]
            record.on_host = on_host
            if role is not None:
                record.role, record.name = role, name

    def adopt(self, tensor: torch.Tensor) -> None:
        """A storage allocated at the current op by something other than an op (an offload runtime's prefetch)."""
        if self.recording:
            self.sid_of(tensor, produced=True)

    def during(self, made_bytes: int) -> None:
        """An offload runtime's recomputation before the op about to be recorded, out of the recorder's sight, peaked
        ``made_bytes`` above what is alive now (NOTE [offload runtime] 6): with what is live now, kept where
        ``replayed`` is (a CPU has no allocator to ask). A storage from before the step met only later (the
        optimizer's state) is added when the step is frozen."""
        if self.recording and self.replayed is not None:
            live = sum(self.storages[sid].nbytes for sid in self._live.values() if not self.storages[sid].on_host)
            self.replayed.append((len(self.ops), live + made_bytes, len(self.storages)))

    def watch_resizes(self, watched: list[ResizedStorage]) -> None:
        """Follow storages that are emptied and refilled in place (NOTE [resized storages]); call before the step."""
        self._resizable = {}
        for item in watched:
            storage = _innermost(item.tensor).untyped_storage()
            self._resizable[id(storage)] = [weakref.ref(storage), storage.nbytes(), item]
            if storage.nbytes():
                self.register(item.tensor, "parameter", item.name)

    def poll_resizes(self, every: bool = False) -> None:
        """Release the watched storages found emptied, and count those found refilled as new (NOTE [resized
        storages] 2); those ``resized`` says were resized, unless it is not known or ``every``."""
        if every or self.resized is None:
            entries = list(self._resizable.values())
        else:
            entries = [entry for key, entry in self._resizable.items() if key in self.resized]  # in watched order
            self.resized.clear()
        for entry in entries:
            storage = entry[0]()
            if storage is None or storage.nbytes() == entry[1]:
                continue
            entry[1] = size = storage.nbytes()
            key = id(storage)
            if key in self._live:
                self._released(key, self._live[key], None)
            if size:
                item = entry[2]
                sid = self._new_storage(storage, _innermost(item.tensor), key, produced=True)
                self.storages[sid].role, self.storages[sid].name = "parameter", item.name
                self._refilled.append(sid)

    def name_parameters(self, named: Mapping[str, torch.Tensor]) -> None:
        self._param_paths = {id(p): name for name, p in named.items()}

    # -- dispatch ------------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(self._wraps(t) for t in types):
            return NotImplemented  # NOTE [wrapper tensors]
        kwargs = kwargs or {}
        kind = self._kinds.get(func)
        if kind is None:
            kind = self._kinds[func] = self._classify(func)
        if self._resizable and kind is not _SKIP and self.recording and (self.resized is None or self.resized):
            self.poll_resizes()
        if self.recording:
            self.view_writes.follow(func, args, kwargs)
        out = self.run_op(func, args, kwargs)
        if kind is not _SKIP and self.recording:
            self._record(func, args, kwargs, out)
        return out

    def run_op(self, func, args: tuple, kwargs: dict):
        """Run an op as this recorder's step runs it: fake fast paths and probes included."""
        if self._fake is None:
            return func(*args, **kwargs)
        if func is HOST_READ and self.known is not None and self.known.knows(args[0]):
            return self.known.read(args[0])  # NOTE [known values] 4
        if func is HOST_READ and self.phase == "optimizer" and isinstance(args[0], FakeTensor):
            return zero_of(args[0].dtype)  # NOTE [host reads in the optimizer step] 2
        out = self._fake.run(func, args, kwargs)
        if self.known is not None:
            self.known.follow(func, args, kwargs, out)
        return out

    def _wraps(self, kind: type) -> bool:
        wraps = self._wrappers.get(kind)
        if wraps is None:
            wraps = self._wrappers[kind] = is_traceable_wrapper_subclass_type(kind)
        return wraps

    def _classify(self, func) -> str:
        self._names[func] = str(func)
        if not records_op(func):
            return _SKIP
        return _COLLECTIVE if func.namespace in COLLECTIVE_NAMESPACES else _RECORD

    def _record(self, func, args, kwargs, out) -> None:
        index = len(self.ops)
        storages, sid_of = self.storages, self.sid_of
        inputs = []
        for t in _tensors(args, kwargs):
            sid = sid_of(t)
            if sid is not None and sid not in inputs:
                inputs.append(sid)
                storages[sid].consumers.append(index)
        outputs, allocated, shapes = [], [], []
        for t in (out,) if isinstance(out, torch.Tensor) else _tensors((out,), None):
            sid = sid_of(t, True)
            if sid is None or sid in outputs:
                continue
            outputs.append(sid)
            shapes.append(tuple(t.shape))
            if storages[sid].producer == index:
                allocated.append(sid)
                if self.tracks_host:  # NOTE [host storages] 3
                    storages[sid].on_host = all(storages[i].on_host for i in inputs) if inputs \
                        else self.phase == "optimizer"
        if self._refilled:  # NOTE [resized storages] 2: refilled for this op
            allocated += [sid for sid in self._refilled if sid not in allocated]
            self._refilled.clear()
        module, forward_op = self._where(index)
        flops, read, written = self._work.measure(func, args, kwargs, out)
        self.ops.append(OpRecord(index, self.phase, module, self._names[func], tuple(inputs), tuple(outputs),
                                 tuple(allocated), forward_op, tuple(shapes), flops, read, written))
        if self._kinds[func] is _COLLECTIVE:
            self.ops[-1].ranks, self.ops[-1].rank_stride = group_layout(func, args, kwargs)
            for sid in (*inputs, *outputs):
                storages[sid].communicated = True
        if self.after_op is not None:
            self.after_op()

    def _where(self, index: int) -> tuple[str, int | None]:
        """Module path and forward op of the op being recorded."""
        if self.phase == "forward":
            sequence = torch._C._autograd._get_sequence_nr()
            for s in range(self._last_sequence, sequence):
                self._sequence_to_op.setdefault(s, index)
            self._last_sequence = sequence
            if self.scope is not None:
                return self.scope, index
            return (self.module_stack[-1][0] if self.module_stack else ""), index
        if self.phase == "optimizer":
            return (self.scope or OPTIMIZER_SCOPE), None
        node = torch._C._current_autograd_node()
        if node is None:
            return (self.scope or AUTOGRAD_SCOPE), None
        sequence = node._sequence_nr()
        if sequence == _NO_SEQUENCE:  # AccumulateGrad: belongs to its parameter's module
            variable = getattr(node, "variable", None)
            path = self._param_paths.get(id(variable), "")
            return path.rpartition(".")[0], None
        forward_op = self._sequence_to_op.get(sequence)
        if forward_op is None:
            return AUTOGRAD_SCOPE, None
        return self.ops[forward_op].module, forward_op

    # -- saved tensors -------------------------------------------------------------------
    def pack(self, tensor: torch.Tensor) -> torch.Tensor | tuple[int, torch.Tensor]:
        """saved_tensors_hooks pack hook: note which storage autograd keeps for backward, and when."""
        if self.recording:
            sid = self.sid_of(tensor)
            if sid is not None:
                # The node that saves is already created, so it holds the previous number.
                self.storages[sid].saved_nodes.append(torch._C._autograd._get_sequence_nr() - 1)
            node = tensor.grad_fn
            self.hook_events.append(HookEvent("pack", len(self.ops), tensor=-1 if sid is None else sid,
                                              node=type(node).__name__ if node is not None else "",
                                              dtype=str(tensor.dtype), shape=tuple(tensor.shape)))
            return (len(self.hook_events) - 1, tensor)  # its unpack names this pack
        return tensor

    def unpack(self, packed: torch.Tensor | tuple[int, torch.Tensor]) -> torch.Tensor:
        """saved_tensors_hooks unpack hook: a backward node starts before op ``len(self.ops)``."""
        packed_at, tensor = packed if isinstance(packed, tuple) else (-1, packed)
        if self.recording:
            try:
                sid = self._live.get(id(tensor.untyped_storage()), -1)
            except (RuntimeError, NotImplementedError):
                sid = -1
            self.hook_events.append(HookEvent("unpack", len(self.ops), tensor=sid, packed_at=packed_at))
        return tensor

    def forward_op_of_node(self, sequence: int) -> int | None:
        return self._sequence_to_op.get(sequence)

    # -- modules -------------------------------------------------------------------------
    @contextmanager
    def logging_modules(self):
        """Log every module call of this thread as hook events (NOTE [hook points]), as a runtime will see them."""
        thread = threading.get_ident()

        def logged(kind: Literal["enter", "exit"], module: torch.nn.Module, arguments: Any = ()) -> None:
            if self.recording and threading.get_ident() == thread:
                top = torch._C._autograd._top_saved_tensors_default_hooks(False)
                own = top is not None and top[0] == self.pack  # no hooks pushed inside the step in force
                self.hook_events.append(HookEvent(kind, len(self.ops), node=type(module).__name__, own_hooks=own,
                                                  training=module.training, plain_arguments=plain_values(arguments),
                                                  path=self._module_paths.get(id(module))))

        def entered(module, args) -> None:
            logged("enter", module)

        def exited(module, args, kwargs, output) -> None:
            logged("exit", module, (args, kwargs))

        handles = (register_module_forward_pre_hook(entered), register_module_forward_hook(exited, with_kwargs=True))
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    @contextmanager
    def watching(self, model: torch.nn.Module):
        """Track the module path of every op while ``model`` runs (hooks removed on exit)."""
        handles = []
        seen = self._module_paths
        for path, module in model.named_modules(remove_duplicate=False):
            if id(module) in seen:
                continue
            seen[id(module)] = path  # its first path, as named_modules and get_submodule name it
            handles.append(module.register_forward_pre_hook(partial(self._enter, path), with_kwargs=True))
            handles.append(module.register_forward_hook(partial(self._exit, path)))
        try:
            yield
        finally:
            seen.clear()
            for handle in handles:
                handle.remove()

    def _enter(self, path: str, module, args, kwargs) -> None:
        shapes = [tuple(t.shape) for t in _tensors(args, kwargs)]  # a transformers layer takes keywords alone
        self.module_stack.append((path, type(module).__name__, shapes))
        if self.recording and self.phase == "forward":
            self._open_calls.append(CallRecord(path, type(module).__name__, len(self.ops)))

    def _exit(self, path: str, module, args, output) -> None:
        if self.module_stack:
            self.module_stack.pop()
        if self.recording and self.phase == "forward" and self._open_calls:
            call = self._open_calls.pop()
            call.last_op = len(self.ops) - 1
            call.outputs = tuple(sid for t in _tensors((output,), None) if (sid := self.sid_of(t)) is not None)
            self.calls.append(call)


PLAIN_TYPES = (torch.Tensor, type(None), bool, int, float, complex, str, torch.dtype, torch.device, torch.Size, slice)


def plain_values(arguments: Any) -> bool:
    """Whether ``arguments`` hold only tensors and plain values (in tuples, lists and dicts): nothing a module's
    forward could change in place other than a tensor, like a cache object (NOTE [hook points] 7)."""
    return all(isinstance(leaf, PLAIN_TYPES) for leaf in tree_flatten(arguments)[0])


def process_group(func, args: tuple, kwargs: dict) -> dist.ProcessGroup | None:
    """A collective's process group: c10d ops take the group (boxed), functional collectives its registered name;
    None for ops without one (wait_tensor)."""
    named = dict(zip((a.name for a in func._schema.arguments), args)) | kwargs
    group = named.get("process_group")
    if isinstance(group, torch.ScriptObject):
        return dist.ProcessGroup.unbox(group)
    if isinstance(group, dist.ProcessGroup):
        return group
    name = named.get("group_name")
    return _resolve_process_group(GroupName(name)) if isinstance(name, str) else None


def group_layout(func, args: tuple, kwargs: dict) -> tuple[int, int]:
    """(ranks in a collective's group, distance between its consecutive global ranks); (1, 1) without a group.

    The distance is 1 for a group of neighbouring ranks (FSDP's, DDP's world, HSDP's shard group) and the shard
    group's size for HSDP's replicate group; an unevenly spaced group gets its widest gap."""
    group = process_group(func, args, kwargs)
    if group is None:
        return 1, 1
    ranks = sorted(dist.get_process_group_ranks(group))
    return len(ranks), max((b - a for a, b in zip(ranks, ranks[1:])), default=1)


def _innermost(tensor: torch.Tensor) -> torch.Tensor:
    """The plain tensor a wrapper subclass holds first (a DTensor's local shard); a plain tensor itself."""
    while is_traceable_wrapper_subclass_type(type(tensor)):
        attributes, _ = tensor.__tensor_flatten__()  # type: ignore[attr-defined]
        tensor = getattr(tensor, attributes[0])
    return tensor


def _tensors(args, kwargs):
    """Tensors among op arguments: top level, and inside lists, tuples and dicts."""
    for value in args:
        if isinstance(value, torch.Tensor):
            yield value
        elif isinstance(value, (list, tuple)):
            yield from _tensors(value, None)
        elif isinstance(value, dict):
            yield from _tensors(value.values(), None)
        elif hasattr(value, "_fields") or hasattr(value, "__dataclass_fields__"):
            yield from _tensors(_fields_of(value), None)
    if kwargs:
        yield from _tensors(kwargs.values(), None)


def _fields_of(value):
    if hasattr(value, "_fields"):
        return tuple(value)
    return tuple(getattr(value, name) for name in value.__dataclass_fields__)


__all__ = ["StepRecorder", "StorageRecord", "OpRecord", "CallRecord", "OPTIMIZER_SCOPE"]
