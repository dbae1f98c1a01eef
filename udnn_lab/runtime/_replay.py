"""Recompute by replay: record a Recompute's forward ops, re-run them before backward needs them.

This is the mechanism of torch.utils.checkpoint's non-reentrant mode (saved-tensor hooks
that rebuild what they dropped), at the level of aten ops so that any op range a plan
names can be rebuilt without touching the model's code. See NOTE [offload runtime] 6.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, TypeVar

import torch

from udnn_lab.errors import ReplayError
from udnn_lab.graph.plan_ir import Recompute
from udnn_lab.runtime._made_bytes import MadeBytes, out_of_sight
from udnn_lab.vocabulary import COLLECTIVE_NAMESPACES

# Ops that update running statistics in training although their schema does not say so.
Result = TypeVar("Result")

_UNDECLARED_WRITES = {"aten.native_batch_norm.default": (3, 4), "aten.cudnn_batch_norm.default": (3, 4),
                      "aten.miopen_batch_norm.default": (3, 4)}


@dataclass(slots=True)
class _Call:
    func: Callable[..., Any]
    args: tuple  # tensors made earlier in the replay appear as _Made markers
    kwargs: dict
    rng_state: RngState | None  # the generators before a random op
    versions: tuple[tuple[torch.Tensor, int], ...]  # sources and their version counters when recorded
    mutated: tuple[int, ...]  # positions of arguments the op writes (cloned at replay unless made here)
    grad_enabled: bool  # some kernels look at the grad mode (oneDNN's LSTM keeps its workspace only with it)
    outputs: int  # tensors it returned


class _Made(NamedTuple):  # a tuple: made for every output of every recorded op, and a dict key as it is
    call: int  # index of the recorded call whose output it is
    output: int  # index among that call's tensor outputs


class _MadeView(NamedTuple):
    """A view of an output's storage that no recorded op made (an op outside the recomputation, or one the trace
    does not count, made it): rebuilt over the replayed output by its sizes, strides and offset in that storage."""

    call: int
    output: int
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int


@dataclass
class Replay:
    """The recorded calls of one Recompute, and what their outputs were."""

    recompute: Recompute
    calls: list[_Call] = field(default_factory=list)
    # id(storage) -> (weak ref to an output on it, _Made) for each output: the outputs an argument that is none of
    # them may be a view of (an op the trace does not count made it)
    on_storage: dict[int, list[tuple]] = field(default_factory=dict)
    storages: dict[int, tuple] = field(default_factory=dict)  # id(storage) -> (storage ref, an output on it)
    restores: dict[int, _Made] = field(default_factory=dict)  # tensor id -> an output on its storage
    dtypes: dict[tuple[int, int], torch.dtype] = field(default_factory=dict)  # the outputs in storages -> dtype
    # id(output) -> (weak ref to it, _Made, id of its storage when that is from before the recomputation): the
    # next op's argument is most often the very tensor an earlier op returned, found here without _view
    outputs: dict[int, tuple] = field(default_factory=dict)
    viewed_outside: set[int] = field(default_factory=set)  # storages from before it that recorded ops viewed
    last_read: dict[tuple[int, int], int] = field(default_factory=dict)  # an output -> the last call reading it
    done: bool = False  # it ran: a replay runs once, and then holds nothing

    def refuse(self, func) -> None:
        """Raise before ``func`` runs if the recomputation would have to re-run it: a collective (NOTE [offload
        runtime] 6)."""
        if func.namespace in COLLECTIVE_NAMESPACES:  # every rank calls them together: one cannot re-run one alone
            raise ReplayError(f"the plan recomputes tensors by re-running {func}, a collective that every rank calls "
                              "together: one rank cannot re-run it alone in backward. Plan again so that the "
                              "recomputation starts after it (the one-rank graph's collectives are never re-run)")

    def record(self, func, args: tuple, kwargs: dict, out, rng_state, written: tuple[int, ...] = ()) -> None:
        """``written``: positions of arguments whose version counter the op bumped (some ops, like
        native_batch_norm's running statistics, write arguments their schema does not mark)."""
        index = len(self.calls)
        declared, statistics = _writes(func)
        mutated = tuple(sorted(set(written) | declared | statistics)) if written or declared or statistics else ()
        if mutated and any(i < len(args) and isinstance(args[i], torch.Tensor) and i not in statistics
                           and not self._makes(args[i]) for i in mutated):
            return  # it changed a tensor made before the recomputation, which keeps the result: not replayed
        # a view of a tensor from before the recomputation (t(weight), x[:, i]) is rebuilt by this op, but its
        # storage is not the recomputation's: reading that storage through another view is reading an input
        outside: set[int] = set()
        versions: list = []
        converted = self._convert(args, outside, versions, index, mutated)
        kw_converted = self._convert(tuple(kwargs.values()), outside, versions, index) if kwargs else ()
        results = _outputs(out)
        self.calls.append(_Call(func, converted, dict(zip(kwargs, kw_converted)), rng_state, tuple(versions),
                                mutated, torch.is_grad_enabled(), len(results)))
        for position, tensor in enumerate(results):
            storage = tensor.untyped_storage()
            key = id(storage)
            made = _Made(index, position)
            self.last_read[made] = index  # an output nothing reads goes right away
            if key in outside:
                self.viewed_outside.add(key)
            elif _live(self.storages.get(key), storage) is None:
                self.storages[key] = (weakref.ref(storage), made)
                self.dtypes[(index, position)] = tensor.dtype
            ref = weakref.ref(tensor)
            self.on_storage.setdefault(key, []).append((ref, made))
            self.outputs[id(tensor)] = (ref, made, key if key in outside else None)

    def _makes(self, tensor: torch.Tensor) -> bool:
        storage = tensor.untyped_storage()
        return _live(self.storages.get(id(storage)), storage) is not None

    def restore_from(self, tensor_id: int, storage_key: int) -> None:
        self.restores[tensor_id] = self.storages[storage_key][1]

    def _convert(self, values: tuple, outside: set[int], versions: list, reader: int,
                 skip: tuple[int, ...] = ()) -> tuple:
        """Arguments with made tensors as _Made markers (read by call ``reader``); the version of each other tensor
        read goes into ``versions`` and its storage into ``outside``.

        Arguments the op writes (``skip``) are cloned at replay: an op that also reads one it did
        not make (BN reads its running statistics only in eval mode) starts from its value after
        forward.
        """
        converted = []
        for position, value in enumerate(values):
            if isinstance(value, torch.Tensor):
                known = self.outputs.get(id(value))
                if known is not None and known[0]() is value:  # an earlier call's output itself
                    if known[2] is not None:  # a view this recomputation made of a tensor from before it
                        outside.add(known[2])
                    self.last_read[known[1]] = reader
                    converted.append(known[1])
                    continue
                storage = value.untyped_storage()
                key = id(storage)
                base = _live(self.storages.get(key), storage)
                if base is not None or key in self.viewed_outside:
                    made = self._same_view(key, value)
                    if made is not None:
                        if base is None:
                            outside.add(key)
                        self.last_read[made] = reader
                        converted.append(made)
                        continue
                if base is not None:  # its storage is the recomputation's, this view of it no recorded op's
                    self.last_read[base] = reader
                    converted.append(self._view_of(base, value))
                    continue
                outside.add(key)
                if position not in skip:
                    versions.append((value, value._version))
                converted.append(value.detach() if value.requires_grad else value)
            elif isinstance(value, (list, tuple)):
                converted.append(type(value)(self._convert(tuple(value), outside, versions, reader)))
            else:
                converted.append(value)
        return tuple(converted)

    def _calls_run(self, scratch: dict[int, list[tuple[int, int]]],
                   counted: MadeBytes | None) -> list[list[torch.Tensor | None]]:
        """Each call's outputs, run in order; those no later call reads, and that restore nothing, let go."""
        outputs: list[list[torch.Tensor | None]] = []
        grad_before = grad = torch.is_grad_enabled()
        try:
            with out_of_sight(counted):  # NOTE [offload runtime] 8
                for index, call in enumerate(self.calls):
                    # inputs from before it were detached when recorded: no autograd graph is built
                    args = tuple(_resolve(a, outputs) for a in call.args)
                    if call.mutated:
                        args = tuple(a.clone() if i in call.mutated and not _from_replay(call.args[i]) and
                                     isinstance(a, torch.Tensor) else a for i, a in enumerate(args))
                    kwargs = {k: _resolve(v, outputs) for k, v in call.kwargs.items()} if call.kwargs else {}
                    if call.grad_enabled != grad:
                        grad = call.grad_enabled
                        torch._C._set_grad_enabled(grad)
                    outputs.append(list(_outputs(_seeded(call, args, kwargs))))
                    for call_index, output in scratch.get(index, ()):  # an output nothing reads: its own call
                        outputs[call_index][output] = None
                    del args, kwargs  # what it read goes as the simulation says, the last call's inputs too
        finally:
            torch._C._set_grad_enabled(grad_before)
        return outputs

    def _same_view(self, key: int, value: torch.Tensor) -> _Made | None:
        """The output that is ``value``'s view of its storage (``key``), if one is alive."""
        view = _view(value)
        for ref, made in self.on_storage.get(key, ()):
            output = ref()
            if output is not None and _view(output) == view:
                return made
        return None

    def _view_of(self, base: _Made, value: torch.Tensor) -> _MadeView:
        dtype = self.dtypes[(base.call, base.output)]  # as_strided keeps the dtype: it must be the view's
        if dtype != value.dtype:
            raise ReplayError(f"a recomputed op reads a {value.dtype} view of a {dtype} tensor the recomputation makes "
                              f"({self.calls[base.call].func}), made by no op it records; plan this tensor as kept or "
                              "offloaded instead")
        return _MadeView(base.call, base.output, tuple(value.shape), tuple(value.stride()), int(value.storage_offset()))

    def run(self, counted: MadeBytes | None = None) -> dict[int, torch.Tensor]:
        """Re-run the calls once; return the restoring outputs by tensor id (nothing if it ran already).

        Nothing here is recorded or traced. An intermediate output goes as soon as no later call
        reads it (one no call reads, once it is made), and once done the replay lets go of
        what it recorded: its inputs are freed when nothing else holds them (NOTE [offload runtime]
        6). ``counted``, where given, counts the storages the calls make while they are alive: an
        observer of the step sees none of them.
        """
        if self.done:
            return {}
        for source, version in (v for call in self.calls for v in call.versions):
            if source._version != version:
                raise ReplayError("a tensor a recomputation reads was modified by an inplace operation after forward "
                                  "used it, so forward cannot be reproduced (if autograd saved it, eager PyTorch "
                                  "refuses this step too); else plan this tensor as kept or offloaded instead")
        kept = set(self.restores.values())
        scratch: dict[int, list[tuple[int, int]]] = {}  # call -> the outputs it is the last to read
        for made, reader in self.last_read.items():
            if made not in kept:
                scratch.setdefault(reader, []).append(made)
        outputs = self._calls_run(scratch, counted)
        restored = {}
        for tensor, made in self.restores.items():
            value = outputs[made.call][made.output]
            assert value is not None  # restoring outputs are kept above
            restored[tensor] = value
        self.done = True
        self.calls, self.on_storage, self.storages, self.dtypes, self.outputs, self.last_read = [], {}, {}, {}, {}, {}
        self.viewed_outside = set()
        return restored


def _resolve(value, outputs):
    kind = type(value)
    if kind is _Made:
        return outputs[value.call][value.output]
    if kind is _MadeView:  # the replayed storage laid out as the original (same op, same layout)
        return outputs[value.call][value.output].as_strided(value.size, value.stride, value.offset)
    if isinstance(value, (list, tuple)):
        return type(value)(_resolve(v, outputs) for v in value)
    return value

def per_op_kind(function: Callable[[Any], Result]) -> Callable[[Any], Result]:
    """Cache ``function(op)`` per op kind (an OpOverload), by the op's id: an OpOverload's own __hash__ is Python,
    and the runtime asks for every op it sees. The op is held with its result, so its id is never reused."""
    results: dict[int, tuple[Any, Result]] = {}

    def cached(func) -> Result:
        known = results.get(id(func))
        if known is None or known[0] is not func:
            known = results[id(func)] = (func, function(func))
        return known[1]

    return cached


@per_op_kind
def _writes(func) -> tuple[frozenset[int], frozenset[int]]:
    """(positions its schema says it writes, positions it writes undeclared)."""
    declared = frozenset(i for i, a in enumerate(func._schema.arguments)
                         if a.alias_info is not None and a.alias_info.is_write)
    return declared, frozenset(_UNDECLARED_WRITES.get(str(func), ()))


def _live(entry, storage):
    """The _Made of an entry if its storage is ``storage`` (ids are reused once a storage dies)."""
    if entry is None or entry[0]() is not storage:
        return None
    return entry[1]


def _view(tensor: torch.Tensor) -> tuple:
    return id(tensor.untyped_storage()), tuple(tensor.shape), tuple(tensor.stride()), tensor.storage_offset(), \
        tensor.dtype


def _from_replay(value) -> bool:
    return type(value) is _Made or type(value) is _MadeView


@dataclass(frozen=True)
class RngState:
    """The generators a random op draws from, as they were before it ran in forward."""

    cpu: torch.Tensor
    cuda: torch.Tensor | None  # the op's CUDA device's default generator
    device: torch.device
    own: torch.Generator | None = None  # a generator passed to the op (generator=...)
    own_state: torch.Tensor | None = None


def _seeded(call: _Call, args: tuple, kwargs: dict):
    """Run the call with every generator it draws from as it was in forward, then put them back."""
    state = call.rng_state
    if state is None:
        return call.func(*args, **kwargs)
    cpu_now = torch.get_rng_state()
    cuda_now = torch.cuda.get_rng_state(state.device) if state.cuda is not None else None
    own_now = state.own.get_state() if state.own is not None else None
    torch.set_rng_state(state.cpu)
    if state.cuda is not None:
        torch.cuda.set_rng_state(state.cuda, state.device)
    if state.own is not None and state.own_state is not None:
        state.own.set_state(state.own_state)
    try:
        return call.func(*args, **kwargs)
    finally:
        torch.set_rng_state(cpu_now)
        if cuda_now is not None:
            torch.cuda.set_rng_state(cuda_now, state.device)
        if state.own is not None and own_now is not None:
            state.own.set_state(own_now)


def recorded_call(replays: Sequence[Replay], func, args: tuple, kwargs: dict,
                  device_of: Callable[[tuple], torch.device]):
    """Run ``func`` and record it into each of ``replays``: the generators it draws from before it runs, and the
    arguments whose version counter it bumped (NOTE [offload runtime] 6). The host probes record through this
    too, so that what they measure is what the runtime does per op."""
    for replay in replays:
        replay.refuse(func)
    state = rng_state(func, device_of(args), kwargs) if draws_random(func) else None
    versions = [a._version if isinstance(a, torch.Tensor) else None for a in args]
    out = func(*args, **kwargs)
    written = tuple(i for i, (a, v) in enumerate(zip(args, versions)) if v is not None and a._version != v)
    for replay in replays:
        replay.record(func, args, kwargs, out, state, written)
    return out


@per_op_kind
def draws_random(func) -> bool:
    return torch.Tag.nondeterministic_seeded in func.tags


def rng_state(func, device: torch.device, kwargs: dict) -> RngState | None:
    """The generators to replay a random op with (None for a deterministic op), a user's own included."""
    if not draws_random(func):
        return None
    own = kwargs.get("generator")
    own = own if isinstance(own, torch.Generator) else None
    return RngState(torch.get_rng_state(), torch.cuda.get_rng_state(device) if device.type == "cuda" else None,
                    device, own, own.get_state() if own is not None else None)


def _outputs(out):
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (list, tuple)):
        return [t for t in out if isinstance(t, torch.Tensor)]
    return []
