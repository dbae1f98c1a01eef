"""Run one step under a StepRecorder, then freeze what it saw into a Graph."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from contextlib import nullcontext
from typing import Any, NoReturn, cast

import torch

from udnn_lab.analysis._fake.tensors import FAKE_LIMITS
from udnn_lab.analysis._local_shards import propagation_unrecorded
from udnn_lab.analysis._recorder import StepRecorder, StorageRecord
from udnn_lab.analysis._sharded import resized_storages, resizes_seen
from udnn_lab.analysis.step import input_tensors, run_step, scaler_state
from udnn_lab.collector import collector_paused
from udnn_lab.errors import ModelInputError, PlanMismatch
from udnn_lab.graph.step_graph import Graph, ModuleCall, OpInfo, TensorInfo
from udnn_lab.vocabulary import LOSS_SCOPE, Category, Phase
from udnn_lab.workload import DEFAULT_STEP, StepOptions

_CAST = "aten._to_copy.default"  # what autocast (and tensor.to(dtype)) runs to cast a tensor


def record_step(recorder: StepRecorder, model: torch.nn.Module, args: tuple, kwargs: dict, target: Any,
                loss_fn: Callable | None, optimizer: torch.optim.Optimizer | None, *, track_saved: bool,
                runtime=None, options: StepOptions = DEFAULT_STEP, scaler: torch.amp.GradScaler | None = None) -> None:
    """Run one training step with ``recorder`` watching; roles of pre-existing tensors are registered first.

    ``runtime``: an OffloadRuntime to run the step under (or FSDP2's offload copies, NOTE [host
    storages] 2); it is entered inside the recorder, so the recorder sees the step's ops as the
    runtime lets them run, and is told (as the runtime's ``observer``) of the storages it allocates.
    ``options`` and ``scaler``: as ``run_step`` takes them.
    """
    named = dict(model.named_parameters())
    recorder.name_parameters(named)
    for i, tensor in enumerate(input_tensors(args, kwargs)):
        recorder.register(tensor, "input", "input" if i == 0 else f"input.{i}")
    for i, tensor in enumerate(input_tensors((target,), {})):
        recorder.register(tensor, "input", "target" if i == 0 else f"target.{i}")
    for name, param in named.items():
        recorder.register(param, "parameter", name)
    for name, buffer in model.named_buffers():
        recorder.register(buffer, "buffer", name)
    for name, tensor in scaler_state(scaler).items():
        recorder.register(tensor, "optimizer_state", name)
    # the optimizer's own state is met at its step, where a fresh optimizer makes it (NOTE [optimizer state of a
    # traced step]): numbered there whether it existed before the step or not, so both steps are one graph
    recorder.watch_resizes(resized_storages(model))

    def mark(phase: str, scope: str | None) -> None:
        recorder.phase, recorder.scope = phase, scope

    saved_hooks = (torch.autograd.graph.saved_tensors_hooks(recorder.pack, recorder.unpack)
                   if track_saved else nullcontext())
    if runtime is not None:
        runtime.observer = recorder
    modules = recorder.logging_modules() if track_saved else nullcontext()
    # paused, the collector cannot release cyclic garbage at a random op of the step either
    with collector_paused(), recorder.watching(model), modules, recorder, saved_hooks, runtime or nullcontext(), \
            resizes_seen() as resized, propagation_unrecorded():  # NOTE [local shard steps] 7
        recorder.recording, recorder.resized = True, resized
        try:
            run_step(model, args, kwargs, loss_fn=loss_fn, target=target, optimizer=optimizer, options=options,
                     scaler=scaler, mark=mark)
            recorder.poll_resizes(every=True)  # what the step's end released (NOTE [resized storages] 2)
            grads = {name: param.grad for name, param in named.items() if param.grad is not None}
            for name, grad in grads.items():  # a gradient sharing another's storage (a slice of it) keeps its name
                recorder.register(grad, "parameter_gradient", f"grad:{name}")
            recorder.graded = frozenset(grads)
            _register_optimizer_state(recorder, optimizer, named, scaler)
        except Exception as err:
            raise_explained(err, recorder, args, kwargs)
        finally:
            recorder.recording, recorder.resized = False, None
            recorder.module_stack.clear()
            if runtime is not None:
                runtime.observer = None


def _register_optimizer_state(recorder: StepRecorder, optimizer, named: Mapping[str, torch.Tensor],
                              scaler: torch.amp.GradScaler | None) -> None:
    for name, tensor in scaler_state(scaler).items():
        recorder.register(tensor, "optimizer_state", name)
    if optimizer is None:
        return
    names = {id(p): name for name, p in named.items()}
    for param, state in optimizer.state.items():
        owner = names.get(id(param), "param")
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                recorder.register(value, "optimizer_state", f"{owner}.{key}")


def raise_explained(err: Exception, recorder: StepRecorder, args: tuple, kwargs: dict) -> NoReturn:
    """Raise ``err`` as explained_error says it (chained to it), or as it is when there is nothing to add."""
    explained = explained_error(err, recorder, args, kwargs)
    if explained is err:
        raise err
    raise explained from err


MIXED_DTENSOR = "got mixed torch.Tensor and DTensor"  # DTensor's error for a sharded parameter read as a plain one


def explained_error(err: Exception, recorder: StepRecorder, args: tuple, kwargs: dict) -> Exception:
    """Turn a failure inside the model or the loss into an error that names where it happened."""
    if isinstance(err, FAKE_LIMITS):
        return err  # trace() explains these: the model needs real values
    if isinstance(err, PlanMismatch):
        return err  # a runtime refusing a step that is not its plan's: it says where and what to do
    given = [tuple(t.shape) for t in input_tensors(args, kwargs)]
    if recorder.phase == "forward" and recorder.module_stack:
        path, kind, shapes = recorder.module_stack[-1]
        where = f"module {path!r} ({kind})" if path else f"the model ({kind})"
        if MIXED_DTENSOR in str(err):
            return ModelInputError(
                f"{where} reads a parameter of another FSDP2 unit outside that unit's forward ({_first_line(err)}): "
                "FSDP2 gathers a unit's parameters only around its own forward, so weights tied or shared across "
                "units (a decoder reading the encoder's weight) stay sharded where they are read. Leave the modules "
                "whose weights are read elsewhere to a unit whose forward does the reading (their common parent, "
                "or the root): FSDP(wrap=...) sharding only the other blocks")
        return ModelInputError(
            f"the example input does not fit the model: {where} got input shapes {shapes} and failed with: "
            f"{_first_line(err)}. The example input has shapes {given}; check its shape, dtype and device."
        )
    if recorder.phase == "forward" and recorder.scope == LOSS_SCOPE:
        return ModelInputError(f"loss_fn failed on the model's output: {_first_line(err)}. "
                               f"The example input has shapes {given}.")
    return err


def _first_line(err: Exception) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}"


def graph_from_recording(recorder: StepRecorder, model_name: str, device: str, *, fake: bool,
                         notes: list[str] | tuple[str, ...] = (), cpu_stands_for_device: bool = False,
                         holders: tuple[int, dict] | None = None) -> Graph:
    """Freeze the recorder's mutable records into a Graph.

    ``cpu_stands_for_device``: the step ran with CPU kernels in place of ``device``'s, so
    its fake CPU tensors are counted as ``device`` tensors (real ones stay on the host).
    ``holders``: ``forward_releases``' result (NOTE [forward holders]).
    """
    with collector_paused():
        return _freeze(recorder, model_name, device, fake, notes, cpu_stands_for_device, holders)


def _forward_releases(recorder: StepRecorder, phases: list[str], holders: tuple[int, dict] | None) -> dict | None:
    """Storage id -> TensorInfo's forward_release and held_past_forward; None when the second forward ran
    other ops than the trace (then nothing is said rather than something wrong).

    With gradient accumulation each micro-batch's forward is one run of forward ops, and each is the
    forward that ``holders`` counted."""
    if holders is None:
        return {}
    count, released = holders
    starts = [i for i, phase in enumerate(phases) if phase == "forward" and (i == 0 or phases[i - 1] != "forward")]
    ends = [i + 1 for i, phase in enumerate(phases) if phase == "forward" and phases[i + 1:i + 2] != ["forward"]]
    if any(end - start != count for start, end in zip(starts, ends)):
        return None
    found = {}
    for start in starts:
        for op in recorder.ops[start:start + count]:
            for position, sid in enumerate(op.allocated):
                if (op.index - start, position) in released:
                    after = released[op.index - start, position]
                    found[sid] = {"forward_release": None if after is None else start + after,
                                  "held_past_forward": after is None}
    return found


def _freeze(recorder: StepRecorder, model_name: str, device: str, fake: bool, notes, cpu_stands_for_device: bool,
            holders: tuple[int, dict] | None):
    phases = [op.phase for op in recorder.ops]
    ops = recorder.ops
    released = _forward_releases(recorder, phases, holders)
    if released is None:
        released = {}
        notes = (*notes, "the second forward pass ran other ops than the trace (NOTE [forward holders]): what holds "
                 "each tensor besides autograd is unknown, so plans assume forward lets go after its last use")
    tensors, unnamed, constants = [], 0, 0
    for record in recorder.storages:
        name = record.name
        if name is None and record.producer is None:
            name, constants = f"const{constants}", constants + 1
        elif name is None:
            name, unnamed = f"t{unnamed}", unnamed + 1
        saved_by = sorted({op for node in record.saved_nodes
                           if (op := recorder.forward_op_of_node(node)) is not None})
        forward_uses = [i for i in record.consumers if phases[i] == "forward"]
        if record.producer is not None and phases[record.producer] == "forward":
            forward_uses.append(record.producer)
        tensors.append(TensorInfo(
            id=record.sid, name=name, nbytes=record.nbytes, dtype=record.dtype, shape=record.shape,
            device=_device_of(record, device, cpu_stands_for_device),
            category=_category(record, recorder),
            producer=record.producer, consumers=tuple(record.consumers), saved=bool(record.saved_nodes),
            saved_by=tuple(saved_by), alloc_step=record.alloc_step, free_step=record.free_step,
            module=ops[record.producer].module if record.producer is not None else "",
            last_forward_use=max(forward_uses) if forward_uses else None,
            first_backward_use=next((i for i in record.consumers if phases[i] == "backward"), None),
            **released.get(record.sid, {}),
        ))
    # cast: mark('end') comes after the step's last op, so every op has a Phase
    frozen_ops = tuple(OpInfo(op.index, cast(Phase, op.phase), op.module, op.name, op.inputs, op.outputs,
                              op.allocated, tuple(op.released), op.forward_op, op.output_shapes, op.flops,
                              op.bytes_read, op.bytes_written, op.ranks, op.rank_stride)
                      for op in ops)
    calls = tuple(ModuleCall(c.path, c.type, c.first_op, c.last_op, c.outputs) for c in recorder.calls)
    # CPU kernels standing in for CUDA ones save other tensors than the device's (cuDNN's batch norm saves more)
    saved = () if cpu_stands_for_device else tuple(recorder.hook_events)
    return Graph(model_name=model_name, device=device, ops=frozen_ops, tensors=tuple(tensors), module_calls=calls,
                 fake=fake, torch_version=torch.__version__, notes=tuple(notes), hook_events=saved,
                 rebuilds_views=recorder.view_writes.found, graded_parameters=recorder.graded,
                 replayed_bytes=_replayed_bytes(recorder))


def _replayed_bytes(recorder: StepRecorder) -> tuple[tuple[int, int], ...]:
    """(op, the most live while recomputations before it ran) from the recorder's counts, with the storages from
    before the step that it met after each count (NOTE [offload runtime] 6)."""
    most: dict[int, int] = {}
    for op, live, known in recorder.replayed or ():
        unmet = sum(record.nbytes for record in recorder.storages[known:] if record.alloc_step == -1
                    and not record.on_host)
        most[op] = max(most.get(op, 0), live + unmet)
    return tuple(sorted(most.items()))


def _device_of(record: StorageRecord, device: str, cpu_stands_for_device: bool) -> str:
    if record.on_host:  # NOTE [host storages]
        return "cpu"
    return device if cpu_stands_for_device and record.fake else record.device


def _category(record: StorageRecord, recorder: StepRecorder) -> Category:
    if record.role is not None:
        return record.role
    if record.communicated:
        return "communication"
    if record.producer is None:
        return "buffer"  # a constant from outside the step (e.g. a tensor attribute that is not a buffer)
    producer = recorder.ops[record.producer]
    phase = producer.phase
    if phase == "forward" and producer.name == _CAST \
            and any(recorder.storages[i].role == "parameter" for i in producer.inputs):
        return "weight_cast"
    if phase == "forward":
        return "feature_map" if record.saved_nodes else "temporary"
    if phase == "backward":
        return "gradient_map"
    return "temporary"
