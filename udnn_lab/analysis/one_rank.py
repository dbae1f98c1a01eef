"""One rank of a step spread over many: DDP or FSDP2 run for real on a fake copy of the model, in a fake
process group (NOTE [one rank of N] in _fake_group.py), recorded as any traced step is.

The user's model and optimizer are never touched: a deep copy is wrapped as ``spec.apply`` wraps a model for
a real run (DDP over fake parameters; FSDP2 on meta ones, then made fake, as its meta-device initialization
goes), an optimizer of the same class and settings is made over the wrapped parameters, one warm-up step
brings wrapper and optimizer to their steady state (FSDP's lazy init, DDP's bucket rebuild, optimizer state),
and the next step is recorded. The fake process group is destroyed on the way out, whatever happened; the
copy goes with it.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import replace

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.parallel import DistributedDataParallel
from torch.utils._python_dispatch import TorchDispatchMode

from udnn_lab.analysis._fake.tensors import fake_inputs, fake_replica, meta_replica
from udnn_lab.analysis._fake.values import KnownValues
from udnn_lab.analysis._fake_group import CompletedCollectives, HostIndices, fake_process_group, rebuild_buckets
from udnn_lab.analysis._holders import forward_releases
from udnn_lab.analysis._host import HostCopies, PinnedCopies, offloaded_shards, with_host_note
from udnn_lab.analysis._local_shards import LocalShardSteps, steps_on_shards
from udnn_lab.analysis._recorder import StepRecorder
from udnn_lab.analysis._recording import graph_from_recording, raise_explained, record_step
from udnn_lab.analysis._substitution import CudaStandIns
from udnn_lab.analysis.step import grad_scaler, run_step, same_optimizer, split_input
from udnn_lab.graph.step_graph import Graph
from udnn_lab.parallel import DDP, FSDP, Parallel, check_spec, describe
from udnn_lab.workload import Workload

STREAMS_NOTE = ("one rank's memory as its tensors hold it (memory_allocated): on CUDA, FSDP2 and DDP copy and "
                "communicate on streams of their own and keep each buffer referenced until the stream that uses it "
                "is done, as they do here; the collectives' backend (NCCL's watchdog) may let go of one a little later")


def trace_one_rank(work: Workload, parallel: Parallel, counted_as: str, fast_paths: bool) -> Graph:
    """The Graph of rank ``parallel.rank`` of ``parallel.world_size`` running ``work``'s step (the module's doc)."""
    spec = check_spec(parallel)
    device = torch.device("cpu")  # the fake group's mesh is a CPU one; counted as ``counted_as``
    substituted = counted_as != device.type
    offloads = isinstance(spec, FSDP) and spec.offload_params
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    hsdp = isinstance(spec, FSDP) and spec.replicate > 1  # a 2-D mesh; a job's own rank is traced over a 1-D one
    shape, names = (spec.mesh_shape, spec.mesh_dim_names) if isinstance(spec, FSDP) and hsdp else (None, None)
    with fake_process_group(spec.world_size, spec.rank, shape, names, in_a_job=True) as mesh, CompletedCollectives(), \
            PinnedCopies() if offloads else nullcontext():  # NOTE [host storages] 4
        model = _wrapped(work.model, spec, mesh, fake_mode, device)
        recorder = StepRecorder(fake_mode=fake_mode, fast_paths=fast_paths)
        optimizer = _optimizer_over(work, model, counted_as)
        if isinstance(spec, FSDP):  # NOTE [local shard steps]
            options = work.step_options
            optimizer = steps_on_shards(optimizer, options.scales_loss, options.clip_grad_norm is not None)
        example = fake_inputs(work.example_input, fake_mode, device)
        args, kwargs = split_input(example)
        target = fake_inputs(work.target, fake_mode, device)
        recorder.known = values = KnownValues()  # NOTE [known values]
        values.know((work.example_input, work.target), (example, target))
        options = work.step_options
        stand_ins = CudaStandIns(fake_mode, substituted, options)
        with fake_mode, stand_ins, values:
            scaler = grad_scaler(options, device)
            # above the recorder: ops on the reducer's real used-parameter marks run for real (NOTE [one rank of N] 6)
            marks = HostIndices(made_from_nothing=False) if isinstance(spec, DDP) and spec.find_unused_parameters \
                else None
            _warm_up(recorder, model, args, kwargs, target, work, optimizer, scaler, marks)
            if isinstance(spec, FSDP) and optimizer is not None and not isinstance(optimizer, LocalShardSteps):
                _warm_up(recorder, model, args, kwargs, target, work, optimizer, scaler)  # [local shard steps] 6
            # entered inside the recorder: FSDP2's offload copies (NOTE [host storages] 2), or the marks' mode
            under_recorder = _host_copies(recorder, model, optimizer) if offloads and substituted else marks
            record_step(recorder, model, args, kwargs, target, work.loss_fn, optimizer, track_saved=True,
                        options=options, scaler=scaler, runtime=under_recorder)
            holders = forward_releases(model, args, kwargs, target, work.loss_fn, recorder.run_op,  # [forward holders]
                                       options, scaler, runtime=under_recorder)
            notes = [describe(spec), STREAMS_NOTE, *stand_ins.notes()]
            graph = graph_from_recording(recorder, work.name, counted_as, fake=True, notes=notes,
                                         cpu_stands_for_device=substituted, holders=holders)
    return with_host_note(graph) if offloads and substituted else graph


def _host_copies(recorder: StepRecorder, model: torch.nn.Module,
                 optimizer: torch.optim.Optimizer | None) -> HostCopies:
    """The shards, and the optimizer's state of their parameters, start the step on the host; FSDP2's copies
    across are made as on the device (NOTE [host storages] 2, 3). Call after the warm-up: its lazy init makes
    the shards anew."""
    recorder.tracks_host = True
    shards = offloaded_shards(model)
    for shard in shards:
        recorder.starts_on_host(shard.tensor)
    for state in (optimizer.state.values() if optimizer is not None else ()):
        for value in state.values():
            if isinstance(value, torch.Tensor):
                recorder.starts_on_host(value)
    copies = HostCopies({id(shard.tensor.untyped_storage()): shard.name for shard in shards})
    for param in model.parameters():  # the sharded parameters, FSDP2's own
        param.register_post_accumulate_grad_hook(copies.gradient_to_host)
    return copies


def _wrapped(model: torch.nn.Module, spec: Parallel, mesh: DeviceMesh, fake_mode: FakeTensorMode,
             device: torch.device) -> torch.nn.Module:
    """A copy of ``model`` wrapped as ``spec`` says, its parameters and buffers fake tensors on ``device``."""
    if isinstance(spec, DDP):
        replica = fake_replica(model, fake_mode, device)
        with fake_mode, HostIndices():  # its buckets are made as it is built, after the parameters' kind
            # (the used-parameter marks of find_unused_parameters real: NOTE [one rank of N] 6)
            # no broadcast of rank 0's weights: in a fake group it moves nothing, and its check reads values
            return spec.apply(replica, process_group=mesh.get_group(), init_sync=False)
    # FSDP2's meta-device initialization: sharded on meta, where its world_size views of each parameter cost
    # nothing (fake ones take a fake dispatch each), then made fake; the mesh comes from outside fake mode
    # (NOTE [one rank of N] 2)
    sharded = spec.apply(meta_replica(model), mesh=mesh)
    with fake_mode:
        return sharded.to_empty(device=device)


def _optimizer_over(work: Workload, model: torch.nn.Module, counted_as: str) -> torch.optim.Optimizer | None:
    """The workload's optimizer class and settings over the wrapped model's parameters, group by group."""
    optimizer = work.optimizer
    if optimizer is None:
        return None
    inner = model.module if isinstance(model, DistributedDataParallel) else model
    wrapped = dict(inner.named_parameters(remove_duplicate=False))
    names = {id(p): name for name, p in work.model.named_parameters(remove_duplicate=False)}
    groups = []
    for group in optimizer.param_groups:
        unknown = [p for p in group["params"] if id(p) not in names]
        if unknown:
            raise ValueError(f"the optimizer holds {len(unknown)} tensor(s) that are not parameters of the model: "
                             "a parallel trace can only map the model's own parameters onto their shards")
        settings = {k: v for k, v in group.items() if k != "params"}
        # on CUDA PyTorch steps DTensor and plain parameters with foreach kernels; CPU stand-ins would loop
        if counted_as == "cuda" and settings.get("foreach", False) is None and not settings.get("fused") \
                and not settings.get("differentiable"):
            settings["foreach"] = True
        groups.append({**settings, "params": [wrapped[names[id(p)]] for p in group["params"]]})
    return same_optimizer(optimizer, groups)


def _warm_up(recorder: StepRecorder, model: torch.nn.Module, args: tuple, kwargs: dict, target, work: Workload,
             optimizer: torch.optim.Optimizer | None, scaler: torch.amp.GradScaler | None,
             above: TorchDispatchMode | None = None) -> None:
    """One step of one micro-batch, run as the recorded one runs (the recorder's fast paths, not recording), then
    DDP's rebuild, which a second micro-batch's forward would otherwise start with (NOTE [one rank of N] 4)."""

    def mark(phase: str, scope: str | None) -> None:
        recorder.phase, recorder.scope = phase, scope

    try:
        with recorder.watching(model), recorder, above or nullcontext():
            run_step(model, args, kwargs, loss_fn=work.loss_fn, target=target, optimizer=optimizer,
                     options=replace(work.step_options, grad_accumulation=1), scaler=scaler, mark=mark)
    except Exception as err:
        raise_explained(err, recorder, args, kwargs)
    finally:
        recorder.module_stack.clear()
    rebuild_buckets(model)
