"""Recompute by replay: record a Recompute's forward ops, re-run them before backward needs them.

This is the mechanism of torch.utils.checkpoint's non-reentrant mode (saved-tensor hooks
that rebuild what they dropped), at the level of aten ops so that any op range a plan
names can be rebuilt without touching the model's code. See NOTE [offload runtime] 6.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from udnn_lab.errors import ReplayError
from udnn_lab.graph.plan_ir import Recompute
from udnn_lab.vocabulary import COLLECTIVE_NAMESPACES

# Ops that update running statistics in training although their schema does not say so.
_UNDECLARED_WRITES = {"aten.native_batch_norm.default": (3, 4), "aten.cudnn_batch_norm.default": (3, 4),
                      "aten.miopen_batch_norm.default": (3, 4)}


@dataclass
class _Call:
    func: Callable[..., Any]
    args: tuple  # tensors made earlier in the replay appear as _Made markers
    kwargs: dict
    rng_state: RngState | None  # the generators before a random op
    versions: tuple[tuple[torch.Tensor, int], ...]  # sources and their version counters when recorded
    mutated: tuple[int, ...]  # positions of arguments the op writes (cloned at replay unless made here)
    grad_enabled: bool  # some kernels look at the grad mode (oneDNN's LSTM keeps its workspace only with it)
    outputs: int  # tensors it returned


@dataclass(frozen=True)
class _Made:
    call: int  # index of the recorded call whose output it is
    output: int  # index among that call's tensor outputs


@dataclass(frozen=True)
class _MadeView(_Made):
    """A view of an output's storage that no recorded op made (an op outside the recomputation, or one the trace
    does not count, made it): rebuilt over the replayed output by its sizes, strides and offset in that storage."""

    size: tuple[int, ...] = ()
    stride: tuple[int, ...] = ()
    offset: int = 0


@dataclass
class Replay:
    """The recorded calls of one Recompute, and what their outputs were."""

    recompute: Recompute
    calls: list[_Call] = field(default_factory=list)
    made: dict[tuple, tuple] = field(default_factory=dict)  # an output's view (see _view) -> (storage ref, _Made)
    storages: dict[int, tuple] = field(default_factory=dict)  # id(storage) -> (storage ref, an output on it)
    restores: dict[int, _Made] = field(default_factory=dict)  # tensor id -> an output on its storage
    dtypes: dict[tuple[int, int], torch.dtype] = field(default_factory=dict)  # the outputs in storages -> dtype
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
        if any(i < len(args) and isinstance(args[i], torch.Tensor) and i not in statistics and not self._makes(args[i])
               for i in mutated):
            return  # it changed a tensor made before the recomputation, which keeps the result: not replayed
        # a view of a tensor from before the recomputation (t(weight), x[:, i]) is rebuilt by this op, but its
        # storage is not the recomputation's: reading that storage through another view is reading an input
        outside: set[int] = set()
        converted, versions = self._convert(args, outside, skip=mutated)
        kw_converted, kw_versions = self._convert(tuple(kwargs.values()), outside)
        self.calls.append(_Call(func, converted, dict(zip(kwargs, kw_converted)), rng_state, versions + kw_versions,
                                mutated, torch.is_grad_enabled(), len(_outputs(out))))
        for position, tensor in enumerate(_outputs(out)):
            storage = tensor.untyped_storage()
            if id(storage) not in outside and _live(self.storages.get(id(storage)), storage) is None:
                self.storages[id(storage)] = (weakref.ref(storage), _Made(index, position))
                self.dtypes[(index, position)] = tensor.dtype
            self.made[_view(tensor)] = (weakref.ref(storage), _Made(index, position))

    def _makes(self, tensor: torch.Tensor) -> bool:
        storage = tensor.untyped_storage()
        return _live(self.storages.get(id(storage)), storage) is not None

    def restore_from(self, tensor_id: int, storage_key: int) -> None:
        self.restores[tensor_id] = self.storages[storage_key][1]

    def _convert(self, values: tuple, outside: set[int], skip: tuple[int, ...] = ()):
        """Arguments with made tensors as _Made markers, and the version of each other tensor read; the storages
        of those others go into ``outside``.

        Arguments the op writes (``skip``) are cloned at replay: an op that also reads one it did
        not make (BN reads its running statistics only in eval mode) starts from its value after
        forward.
        """
        converted, versions = [], []
        for position, value in enumerate(values):
            if isinstance(value, torch.Tensor):
                storage = value.untyped_storage()
                made = _live(self.made.get(_view(value)), storage)
                base = _live(self.storages.get(id(storage)), storage)
                if made is not None:
                    if base is None:  # a view this recomputation made of a tensor from before it
                        outside.add(id(storage))
                    converted.append(made)
                    continue
                if base is not None:  # its storage is the recomputation's, this view of it no recorded op's
                    converted.append(self._view_of(base, value))
                    continue
                outside.add(id(storage))
                if position not in skip:
                    versions.append((value, value._version))
                converted.append(value)
            elif isinstance(value, (list, tuple)):
                inner, inner_versions = self._convert(tuple(value), outside)
                converted.append(type(value)(inner))
                versions.extend(inner_versions)
            else:
                converted.append(value)
        return tuple(converted), tuple(versions)

    def _view_of(self, base: _Made, value: torch.Tensor) -> _MadeView:
        dtype = self.dtypes[(base.call, base.output)]  # as_strided keeps the dtype: it must be the view's
        if dtype != value.dtype:
            raise ReplayError(f"a recomputed op reads a {value.dtype} view of a {dtype} tensor the recomputation makes "
                              f"({self.calls[base.call].func}), made by no op it records; plan this tensor as kept or "
                              "offloaded instead")
        return _MadeView(base.call, base.output, tuple(value.shape), tuple(value.stride()), int(value.storage_offset()))

    def run(self) -> dict[int, torch.Tensor]:
        """Re-run the calls once; return the restoring outputs by tensor id (nothing if it ran already).

        Nothing here is recorded or traced. An intermediate output goes as soon as no later call
        reads it, and once done the replay lets go of what it recorded: its inputs are freed when
        nothing else holds them (NOTE [offload runtime] 6).
        """
        if self.done:
            return {}
        for source, version in (v for call in self.calls for v in call.versions):
            if source._version != version:
                raise ReplayError("a tensor a recomputation reads was modified by an inplace operation after forward "
                                  "used it, so forward cannot be reproduced (if autograd saved it, eager PyTorch "
                                  "refuses this step too); else plan this tensor as kept or offloaded instead")
        outputs: list[list[torch.Tensor | None]] = []
        last_read = self._last_reads()
        kept = {(m.call, m.output) for m in self.restores.values()}
        with torch._C._DisableTorchDispatch():
            for index, call in enumerate(self.calls):
                args = tuple(_detached(self._resolve(a, outputs)) for a in call.args)
                if call.mutated:
                    args = tuple(a.clone() if i in call.mutated and not _from_replay(call.args[i]) and
                                 isinstance(a, torch.Tensor) else a for i, a in enumerate(args))
                kwargs = {k: _detached(self._resolve(v, outputs)) for k, v in call.kwargs.items()}
                with torch.set_grad_enabled(call.grad_enabled):  # detached inputs: no autograd graph is built
                    outputs.append(list(_outputs(_seeded(call, args, kwargs))))
                for done_with in last_read.get(index, ()):  # scratch no later call reads
                    if done_with not in kept:
                        outputs[done_with[0]][done_with[1]] = None
        restored = {}
        for tensor, made in self.restores.items():
            value = outputs[made.call][made.output]
            assert value is not None  # restoring outputs are kept above
            restored[tensor] = value
        self.done = True
        self.calls, self.made, self.storages, self.dtypes = [], {}, {}, {}
        return restored

    def _last_reads(self) -> dict[int, list[tuple[int, int]]]:
        """Call index -> the outputs (call, output) it is the last to read."""
        last: dict[tuple[int, int], int] = {}
        for index, call in enumerate(self.calls):
            for made in _made_in((call.args, tuple(call.kwargs.values()))):
                last[(made.call, made.output)] = index
        for index, call in enumerate(self.calls):  # outputs nothing reads go right away
            for position in range(call.outputs):
                last.setdefault((index, position), index)
        by_call: dict[int, list[tuple[int, int]]] = {}
        for made, index in last.items():
            by_call.setdefault(index, []).append(made)
        return by_call

    def _resolve(self, value, outputs):
        if isinstance(value, _MadeView):  # the replayed storage laid out as the original (same op, same layout)
            return outputs[value.call][value.output].as_strided(value.size, value.stride, value.offset)
        if isinstance(value, _Made):
            return outputs[value.call][value.output]
        if isinstance(value, (list, tuple)):
            return type(value)(self._resolve(v, outputs) for v in value)
        return value


_WRITES: dict = {}  # op -> (positions its schema says it writes, positions it writes undeclared)


def _writes(func) -> tuple[frozenset[int], frozenset[int]]:
    known = _WRITES.get(func)
    if known is None:
        declared = frozenset(i for i, a in enumerate(func._schema.arguments)
                             if a.alias_info is not None and a.alias_info.is_write)
        known = _WRITES[func] = (declared, frozenset(_UNDECLARED_WRITES.get(str(func), ())))
    return known


_SEEDED: dict = {}  # op -> whether it draws from a generator


def _made_in(values):
    """The _Made markers in nested tuples and lists."""
    for value in values:
        if isinstance(value, _Made):
            yield value
        elif isinstance(value, (list, tuple)):
            yield from _made_in(value)


def _live(entry, storage):
    """The _Made of an entry if its storage is ``storage`` (ids are reused once a storage dies)."""
    if entry is None or entry[0]() is not storage:
        return None
    return entry[1]


def _view(tensor: torch.Tensor) -> tuple:
    return id(tensor.untyped_storage()), tuple(tensor.shape), tuple(tensor.stride()), tensor.storage_offset(), \
        tensor.dtype


def _detached(value):
    if isinstance(value, torch.Tensor):
        return value.detach() if value.requires_grad else value
    if isinstance(value, (list, tuple)):
        return type(value)(_detached(v) for v in value)
    return value


def _from_replay(value) -> bool:
    return isinstance(value, _Made)


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


def rng_state(func, device: torch.device, kwargs: dict) -> RngState | None:
    """The generators to replay a random op with (None for a deterministic op), a user's own included."""
    seeded = _SEEDED.get(func)
    if seeded is None:
        seeded = _SEEDED[func] = torch.Tag.nondeterministic_seeded in func.tags
    if not seeded:
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
