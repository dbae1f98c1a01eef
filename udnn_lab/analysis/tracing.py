"""model + example input -> Graph, without real memory and without a GPU.

The step runs under ``FakeTensorMode``: every tensor has its real shape, dtype and
device but no data. The user's model is never touched: its parameters and buffers
are swapped for fake ones for the duration of the trace, and the optimizer is cloned
over those fakes. ``fake=False`` traces with real tensors instead (for models whose
ops need real values), restoring the model and optimizer afterwards.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import replace
from itertools import chain
from typing import TYPE_CHECKING, Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.nn.parallel import DistributedDataParallel
from torch.nn.utils.stateless import _reparametrize_module

from udnn_lab.analysis._fake.python_caches import KeptModel, model_kept
from udnn_lab.analysis._fake.tensors import FAKE_LIMITS, fake_initial_state, fake_inputs, fake_optimizer, fake_state
from udnn_lab.analysis._fake.values import KnownValues
from udnn_lab.analysis._holders import forward_releases
from udnn_lab.analysis._recorder import StepRecorder
from udnn_lab.analysis._recording import graph_from_recording, record_step
from udnn_lab.analysis._sharded import is_distributed
from udnn_lab.analysis._substitution import CudaStandIns
from udnn_lab.analysis.step import (
    grad_scaler,
    input_tensors,
    map_tensors,
    preserved,
    split_input,
    state_at_first_step,
    step_on_made_grads,
)
from udnn_lab.errors import FakeTensorUnsupported
from udnn_lab.graph.step_graph import Graph
from udnn_lab.vocabulary import Precision
from udnn_lab.workload import Workload, as_workload

if TYPE_CHECKING:
    from udnn_lab.parallel import Parallel


def trace(model: torch.nn.Module | Workload, example_input: Any = None, loss_fn: Callable | None = None,
          optimizer: torch.optim.Optimizer | None = None, *, target: Any = None, device: str | None = None,
          fake: bool = True, name: str | None = None, fast_paths: bool = True, precision: Precision | None = None,
          grad_accumulation: int | None = None, clip_grad_norm: float | None = None,
          parallel: Parallel | None = None) -> Graph:
    """Record one training step (forward, backward, optimizer step) as a :class:`Graph`.

    ``example_input``: a tensor, a tuple of positional tensors or a dict of keyword
    tensors (one micro-batch). ``loss_fn(output)`` or, with ``target``, ``loss_fn(output, target)``;
    without one, the loss is the sum of the outputs. ``device``: where the step would
    run ('cpu', 'cuda'); by default the model's. With ``fake=False`` the step runs for
    real on that device; the model and optimizer are restored afterwards.
    ``fast_paths=False`` runs every op through fake mode's own dispatch (slower; it is
    how the fast paths of _fake/fast_paths.py are checked). ``precision`` ('32-true', 'bf16-mixed',
    '16-mixed', 'bf16-true', ...; by default the model's own dtype), ``grad_accumulation``
    (micro-batches per optimizer step) and ``clip_grad_norm`` (max total gradient norm): how
    the step runs (a Workload's own unless given here).

    ``parallel``: ``ul.DDP(world_size, ...)`` or ``ul.FSDP(world_size, ...)``: the Graph of one rank of a step
    spread over ``world_size`` ranks, traced from this process (NOTE [one rank of N]): DDP's or FSDP2's own code
    runs on a copy of the model (yours stays as it is), with its gradient buckets, sharded parameters,
    gradients and optimizer state, and all-gather and reduce-scatter buffers ("communication" in the breakdown).
    A Workload made with ``parallel=`` (``ul.zoo.get(..., parallel=ul.FSDP(8))``) is traced as that rank without
    being told again, and in a job a model it wrapped in DistributedDataParallel or sharded with ``fully_shard``
    as this process's rank of that (``ul.DDP.of``, ``ul.FSDP.of``); a ``parallel`` given here wins over the
    Workload's (to trace its step in one process, ``dataclasses.replace(work, parallel=None)``).
    With ``FSDP(..., offload_params=True)`` what the rank keeps in host memory is the breakdown's ``host_bytes``
    (NOTE [host storages]).
    """
    work = as_workload(model, example_input, loss_fn=loss_fn, optimizer=optimizer, target=target, name=name,
                       precision=precision, grad_accumulation=grad_accumulation, clip_grad_norm=clip_grad_norm,
                       parallel=parallel)
    if work.parallel is None and fake and is_distributed(work.model):
        work = _this_rank_of(work)
    run_on, counted_as = _resolve_device(work, device, fake)
    if work.parallel is not None:
        if not fake:
            raise ValueError("a parallel trace runs under fake tensors (one rank of a fake process group): "
                             "leave fake=True, or measure the real ranks with ul.measure in each process")
        # DTensor and FSDP2 take most of a second to import: loaded only when a parallel trace is asked for
        from udnn_lab.analysis.one_rank import trace_one_rank

        with _explained_fake_limits(), model_kept(work.model, refill=False):  # NOTE [what a traced model keeps]
            return trace_one_rank(work, work.parallel, counted_as, fast_paths)
    if fake:
        with _explained_fake_limits(), model_kept(work.model, _on_its_device(work, run_on, counted_as)) as kept:
            return _trace_fake(work, run_on, counted_as, fast_paths, kept)
    return _trace_real(work, run_on)


def _this_rank_of(work: Workload) -> Workload:
    """``work`` as this process's rank of the job that wrapped its model: a DistributedDataParallel's module with
    the wrapper's settings (``DDP.of``), or a model sharded with fully_shard (``FSDP.of``); a clear error outside a
    job, where there is no rank to trace."""
    # the specs import FSDP2 (most of a second): loaded only for a model a job wrapped
    from udnn_lab.parallel import DDP, FSDP

    if not torch.distributed.is_initialized():
        raise ValueError("the model is sharded with fully_shard but this process has no process group: trace the "
                         "plain model with parallel=ul.FSDP(world_size, ...), or trace inside the job that sharded it")
    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    if isinstance(work.model, DistributedDataParallel):
        return replace(work, model=work.model.module, parallel=DDP.of(work.model, world, rank))
    return replace(work, parallel=FSDP.of(work.model, rank))


def _resolve_device(work: Workload, device: str | None, fake: bool) -> tuple[torch.device, str]:
    """Where the step runs, and which device's memory the graph describes."""
    if device is None:
        first = next(chain(work.model.parameters(), work.model.buffers()), None)
        if first is None:
            tensors = input_tensors(*split_input(work.example_input))
            first = tensors[0] if tensors else None
        chosen = first.device if first is not None and first.device.type != "meta" else torch.device("cpu")
    else:
        chosen = torch.device(device)
    if chosen.type == "cuda" and not torch.cuda.is_available():
        if not fake:
            raise RuntimeError("fake=False runs the step for real on CUDA, but no CUDA device is available here")
        return torch.device("cpu"), "cuda"
    return chosen, chosen.type


def _on_its_device(work: Workload, run_on: torch.device, counted_as: str) -> bool:
    """Whether the step is traced on the device the model is on, as it will run (NOTE [what a traced model keeps]
    3: only then are its caches filled for real afterwards)."""
    first = next(chain(work.model.parameters(), work.model.buffers()), None)
    where = first.device if first is not None else torch.device("cpu")
    return counted_as == run_on.type and where.type == run_on.type and where.type != "meta"


def _trace_fake(work: Workload, device: torch.device, counted_as: str, fast_paths: bool, kept: KeptModel) -> Graph:
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    model = work.model
    fakes = fake_state(model, fake_mode, device)
    example = fake_inputs(work.example_input, fake_mode, device)
    args, kwargs = split_input(example)
    target = fake_inputs(work.target, fake_mode, device)
    values = KnownValues()  # NOTE [known values]
    values.know((work.example_input, work.target), (example, target))
    optimizer = fake_optimizer(work.optimizer, model, fakes, fake_mode, device, counted_as)
    options = work.step_options
    substituted = counted_as != device.type
    stand_ins = CudaStandIns(fake_mode, substituted, options)
    # the optimizer's state is made as it first steps (NOTE [optimizer state of a traced step])
    state = state_at_first_step(optimizer, fake_initial_state(fake_mode, device))
    with _reparametrize_module(model, fakes, tie_weights=True), fake_mode, stand_ins, state, values:
        scaler = grad_scaler(options, device)  # on the device whose kernels run the step
        # a step that filled a cache is not the steady one: the next is (NOTE [what a traced model keeps] 3)
        for _ in range(2):
            recorder = StepRecorder(fake_mode=fake_mode, fast_paths=fast_paths)
            recorder.known = values
            record_step(recorder, model, args, kwargs, target, work.loss_fn, optimizer, track_saved=True,
                        options=options, scaler=scaler)
            if not kept.filled():
                break
        holders = forward_releases(model, args, kwargs, target, work.loss_fn, recorder.run_op,  # [forward holders]
                                   options, scaler)
        return graph_from_recording(recorder, work.name, counted_as, fake=True,
                                    notes=stand_ins.notes(),
                                    cpu_stands_for_device=substituted, holders=holders)


@contextmanager
def _explained_fake_limits():
    """An op fake tensors cannot run becomes FakeTensorUnsupported; FakeTensorMode's own log of every failing
    meta kernel (at ERROR) is silenced, since the error raised says it better."""
    log = logging.getLogger("torch._subclasses.fake_tensor")
    level = log.level
    log.setLevel(logging.CRITICAL)
    try:
        yield
    except FAKE_LIMITS as err:
        op = getattr(err, "func", None) or str(err)
        raise FakeTensorUnsupported(
            f"op {op} cannot run under fake tensors: its result depends on tensor values. "
            f"Trace with a real small batch instead: ul.trace(model, small_batch, ..., fake=False)"
        ) from err
    finally:
        log.setLevel(level)


def _trace_real(work: Workload, device: torch.device) -> Graph:
    model, optimizer = work.model, work.optimizer
    args, kwargs = split_input(map_tensors(lambda t: t.to(device), work.example_input))
    target = map_tensors(lambda t: t.to(device), work.target)
    recorder = StepRecorder()
    scaler = grad_scaler(work.step_options, device)
    state = state_at_first_step(optimizer, step_on_made_grads)  # NOTE [optimizer state of a traced step]
    with preserved(model, optimizer), state:
        record_step(recorder, model, args, kwargs, target, work.loss_fn, optimizer, track_saved=True,
                    options=work.step_options, scaler=scaler)
        return graph_from_recording(recorder, work.name, device.type, fake=False)
