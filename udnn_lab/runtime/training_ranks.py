"""Managed training over ranks from one process (a notebook): ``ul.train(..., parallel=ul.DDP(2))`` or ``ul.FSDP(2)``.

This process starts ``world_size`` rank processes (spawned: a fresh interpreter each). Every rank unpickles its
own copy of the model, wraps it with ``spec.apply`` in a process group (gloo on CPU; NCCL with one GPU per rank
when the model is on CUDA), makes the user's optimizer class with its settings over the wrapped parameters, and
runs the very step ``ul.train`` runs in one process (``_step_loop.one_step``), under its own rank's plan.

Data: each batch is the global batch. Every tensor of it is split along dim 0 into ``world_size`` equal parts
and rank r trains on part r, so under DDP (gradients averaged over ranks) a step is single-process training on
the whole batch, up to the order of the reduction, for a loss that averages over examples. Layers that look
across the batch (batch norm) see only their rank's part, as in any data-parallel run.

NOTE [rank protocol]
  The parent sends a rank one message per step on that rank's own queue: its part of the step's batches
  (pickled bytes, so no tensor is shared between processes), or None: the run is over. It sends step k + 1
  only after every rank's row of step k came back and the callbacks saw it, so a stop (``stop.set()``, a
  callback returning False, the steps or batches running out) ends every rank at the same step boundary, the
  one a single process would stop at; the cost is one round trip through the queues per step. Only one step's
  batches are ever in flight, whatever the iterable holds.
  Ranks answer on one shared queue: ('row', rank, row) per step; after None, rank 0 writes the full state dicts
  of the model and the optimizer to a file (_rank_state.py; under FSDP2 every rank takes part in gathering them)
  and says ('state', rank); every rank then says ('done', rank, pinned bytes) and leaves. A rank that
  raises says ('error', rank, traceback text). The parent ends every rank that is still alive, whatever happens
  (an error, a rank that died silently, KeyboardInterrupt), before it returns or raises. Ranks ignore SIGINT:
  Ctrl-C in a terminal reaches the whole process group, and the parent alone decides.

Plans: one per rank (each rank's step as ``ul.trace(..., parallel=replace(spec, rank=r))`` sees it), or one
Plan for every rank; rank r runs its steps under an OffloadRuntime of its own plan.

Rows: rank 0's row, with ``loss`` the mean of the ranks' losses (the global batch's loss for a loss that averages
over examples) and ``peak_bytes_rank<r>`` each rank's peak (``peak_bytes`` is rank 0's). The trained weights come
back into the user's model and the optimizer's state (Adam's step and moments, SGD's momentum buffers, whole
tensors, gathered from the shards under FSDP2) into the user's optimizer, keyed to the user's own parameters: what
single-process training on the whole batches leaves there, so training can go on in this process. The ranks start
from the state the user's optimizer holds (_rank_state.py), so a run also goes on from earlier training.
"""

from __future__ import annotations

import io
import multiprocessing.process
import pickle
import queue
import signal
import tempfile
import threading
import traceback
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pandas as pd
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel

from udnn_lab.analysis.step import grad_scaler, map_tensors, same_optimizer
from udnn_lab.devices import device_name, model_device
from udnn_lab.errors import RankFailed
from udnn_lab.graph.plan_ir import Plan
from udnn_lab.parallel import DDP, FSDP, Parallel, check_spec, describe
from udnn_lab.runtime._rank_state import full_model_state, full_optimizer_state, load_optimizer_state
from udnn_lab.runtime._step_loop import STEP_COLUMNS, Run, groups, on_device, one_step, progress_bar
from udnn_lab.runtime.offload import OffloadRuntime
from udnn_lab.units import format_bytes
from udnn_lab.workload import StepOptions

Callback = Callable[[dict], "bool | None"]
POLL_S = 0.5  # how often a waiting process looks whether the other side is still alive
LEAVE_S = 30.0  # how long ranks get to leave on their own before they are killed


@dataclass(frozen=True)
class RankJob:
    """What every rank is given when it starts."""

    spec: Parallel
    payload: bytes  # torch.save of (model, optimizer, loss_fn): each rank unpickles a copy of its own
    plans: tuple[Plan | None, ...]
    options: StepOptions
    track: bool
    backend: str  # 'gloo' or 'nccl'
    folder: str  # the rendezvous file and the state rank 0 writes


def plans_per_rank(plan: Plan | Sequence[Plan] | None, world_size: int) -> tuple[Plan | None, ...]:
    """One plan per rank: a single Plan (or None) for every rank, or a list/tuple of ``world_size`` Plans."""
    if plan is None or isinstance(plan, Plan):
        return (plan,) * world_size
    if not isinstance(plan, (list, tuple)) or not all(isinstance(p, Plan) for p in plan):
        raise TypeError(f"plan is a Plan for every rank, or a list of one Plan per rank (ul.trace(..., "
                        f"parallel=replace(spec, rank=r)) for r in range(world_size)), got {type(plan).__name__}")
    if len(plan) != world_size:
        raise ValueError(f"plan has {len(plan)} Plans but the run has world_size={world_size} ranks: give one Plan "
                         f"per rank, or one Plan for them all")
    return tuple(plan)


def train_ranks(model: torch.nn.Module, batches: Iterable, optimizer: torch.optim.Optimizer | None, *,
                parallel: Parallel, options: StepOptions, loss_fn: Callable | None = None,
                plan: Plan | Sequence[Plan] | None = None, steps: int | None = None,
                callbacks: Iterable[Callback] = (), stop: threading.Event | None = None, progress: bool = True,
                track_memory: bool | None = None, name: str | None = None) -> Run:
    """``ul.train`` over ``parallel.world_size`` rank processes (the module's doc); returns rank 0's Run."""
    spec = check_spec(parallel)
    world = spec.world_size
    plans = plans_per_rank(plan, world)
    device = model_device(model)
    backend = _backend(device, world)
    check_offload(spec, device)
    callbacks = list(callbacks)
    feed = _Feed(groups(iter(batches), options.grad_accumulation), world, steps)
    first = feed.next()  # a batch that does not split is an error before any rank starts
    with tempfile.TemporaryDirectory(prefix="udnn-lab-ranks-") as folder:
        job = RankJob(spec=spec, payload=_payload(model, optimizer, loss_fn), plans=plans, options=options,
                      track=device.type == "cpu" if track_memory is None else track_memory, backend=backend,
                      folder=folder)
        ranks = _Ranks(job)
        bar = progress_bar(steps, progress, name or type(model).__name__)
        finished = False
        try:
            ranks.start()
            rows, stopped, pinned_bytes = _drive(ranks, feed, first, callbacks, stop, bar)
            finished = True
        finally:
            bar.close()
            ranks.end(wait=finished)
        state = torch.load(Path(folder, "state.pt"), weights_only=True)
        model.load_state_dict(state["model"])
        if optimizer is not None:
            optimizer.load_state_dict(state["optimizer"])
    plan_names = sorted({p.policy for p in plans if p is not None})
    return Run(model_name=name or type(model).__name__, device=device.type, device_name=device_name(device),
               policy=", ".join(plan_names) or "none", fused_optimizer=False,
               started_at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
               steps=pd.DataFrame(rows, columns=[*STEP_COLUMNS, *(f"peak_bytes_rank{r}" for r in range(world))]),
               stopped=stopped, pinned_bytes=pinned_bytes, options=options,
               notes=(f"{describe(spec).split(' of ', 1)[1]}, {backend}: every rank trained on 1/{world} of each "
                      f"batch; rows are rank 0's, loss the mean over ranks, peak_bytes_rank<r> each rank's peak",
                      "the weights and the optimizer's state came back from rank 0 (whole, gathered from the shards "
                      "under FSDP2)",
                      *_peak_caveat(spec, device), *_warm_up_note(plans)))


WARM_UP_STEPS = 2  # a wrapped model's first steps run other ops than its traced one: FSDP2's lazy init, DDP's rebuild


def warm_up_steps(plan: Plan | None) -> int:
    """Steps a rank runs before its plan: a plan followed op by op (a recompute, or a step traced with kernels
    other than the device's, so without hook events) needs the very ops of the traced step, which a wrapped model
    runs from its third step on; a plan followed by saved-tensor hooks acts from the first."""
    if plan is None or not (plan.offloads or plan.recomputes):
        return 0
    return WARM_UP_STEPS if plan.recomputes or not plan.hook_events else 0


def _warm_up_note(plans) -> tuple[str, ...]:
    steps = max((warm_up_steps(p) for p in plans), default=0)
    if not steps:
        return ()
    return (f"the first {steps} steps ran without the plan: it is followed op by op, and a DDP or FSDP2 model runs "
            f"the ops of its traced step from its step {steps + 1} on (FSDP2's lazy initialization, DDP's bucket "
            f"rebuild); those steps hold what the step holds with every tensor kept",)


def _peak_caveat(spec: Parallel, device: torch.device) -> tuple[str, ...]:
    if isinstance(spec, DDP) or device.type != "cpu":
        return ()
    return ("gloo's reduce-scatter copies its input into a buffer of its own (NCCL does not), and its worker thread "
            "lets go of finished buffers on its own schedule: an FSDP2 rank's CPU peak may read above its prediction "
            "by about one such buffer",)


def check_offload(spec: Parallel, device: torch.device) -> None:
    """Refuse FSDP2's parameter offload for ranks that run on the CPU: there is no other memory to move them to."""
    if device.type == "cpu" and isinstance(spec, FSDP) and spec.offload_params:
        raise ValueError("offload_params moves a GPU rank's parameters to host memory (FSDP2's CPUOffloadPolicy, "
                         "which pins them), and these ranks run on the CPU, the host itself: train them without "
                         "offload_params here (ul.trace(..., parallel=spec) predicts a GPU rank with it)")


def _backend(device: torch.device, world: int) -> str:
    if device.type == "cpu":
        return "gloo"
    if device.type != "cuda":
        raise ValueError(f"training over ranks runs on CPU (gloo) or CUDA (NCCL), the model is on {device.type}")
    if torch.cuda.device_count() < world:
        raise ValueError(f"world_size={world} needs one GPU per rank and this machine has "
                         f"{torch.cuda.device_count()}: make the spec with world_size <= {torch.cuda.device_count()}")
    return "nccl"


def _payload(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, loss_fn: Callable | None) -> bytes:
    buffer = io.BytesIO()
    try:
        torch.save((model, optimizer, loss_fn), buffer)
    except (pickle.PicklingError, AttributeError, TypeError) as err:
        raise TypeError(f"each rank gets a pickled copy of the model, optimizer and loss_fn, and one of them does "
                        f"not pickle ({err}): define them at a module's top level (no lambdas or local classes)"
                        ) from err
    return buffer.getvalue()


class _Feed:
    """The steps' batches, each split into one part per rank (the module's doc), until ``steps`` or the end."""

    def __init__(self, steps_batches: Iterator[list], world: int, steps: int | None) -> None:
        self.batches, self.world, self.steps, self.sent = steps_batches, world, steps, 0

    def next(self) -> list[bytes] | None:
        """Each rank's message for the next step, or None when there is none ('steps' or 'batches' says why)."""
        if self.steps is not None and self.sent >= self.steps:
            return None
        group = next(self.batches, None)
        if group is None:
            return None
        parts = [[self._part(batch, rank) for batch in group] for rank in range(self.world)]
        self.sent += 1
        return [pickle.dumps(part) for part in parts]

    def _part(self, batch: Any, rank: int) -> Any:
        def split(tensor: torch.Tensor) -> torch.Tensor:
            if tensor.dim() == 0 or tensor.shape[0] % self.world:
                raise ValueError(f"batch {self.sent} has a tensor of shape {tuple(tensor.shape)}, whose first "
                                 f"dimension does not split into world_size={self.world} equal parts: give batches "
                                 f"whose size is a multiple of {self.world}")
            return tensor.detach().chunk(self.world)[rank].cpu().clone()  # a copy: pickling a view sends it all

        return map_tensors(split, batch)

    def why_over(self) -> str:
        return "steps" if self.steps is not None and self.sent >= self.steps else "batches"


class _Ranks:
    """The rank processes and their queues (NOTE [rank protocol])."""

    def __init__(self, job: RankJob) -> None:
        context = mp.get_context("spawn")
        self.inboxes = [context.Queue() for _ in range(job.spec.world_size)]
        self.outbox = context.Queue()
        self.processes = [context.Process(target=_rank, args=(rank, job, self.inboxes[rank], self.outbox),
                                          name=f"udnn-lab rank {rank}", daemon=True)
                          for rank in range(job.spec.world_size)]

    def start(self) -> None:
        for process in self.processes:
            process.start()

    def send(self, messages: list[bytes] | None) -> None:
        for rank, inbox in enumerate(self.inboxes):
            inbox.put(None if messages is None else messages[rank])

    def receive(self) -> tuple:
        """The next message of any rank; RankFailed for an error, or for a rank that left without a word."""
        while True:
            try:
                message = self.outbox.get(timeout=POLL_S)
            except queue.Empty:
                for rank, process in enumerate(self.processes):
                    if process.exitcode not in (None, 0):
                        raise RankFailed(rank, f"its process ended with exit code {process.exitcode} without "
                                               f"a word (killed? out of memory?)") from None
                continue
            if message[0] == "error":
                raise RankFailed(message[1], message[2])
            return message

    def end(self, wait: bool) -> None:
        """Every rank gone: after a clean end given ``LEAVE_S`` to leave on their own, otherwise killed at once."""
        for process in self.processes:
            if wait and process.pid is not None:
                process.join(LEAVE_S)
            if process.is_alive():
                process.kill()
                process.join()
        for box in (*self.inboxes, self.outbox):
            box.close()
            box.cancel_join_thread()  # a killed rank never reads what is left in its queue


def _drive(ranks: _Ranks, feed: _Feed, first: list[bytes] | None, callbacks: list[Callback],
           stop: threading.Event | None, bar) -> tuple[list[dict], str, int]:
    """Step the ranks until the run is over; the merged rows, why it stopped, rank 0's pinned bytes."""
    world = len(ranks.processes)
    rows: list[dict] = []
    waiting: dict[int, dict[int, dict]] = {}
    stopped = "stop requested" if stop is not None and stop.is_set() else None
    ranks.send(None if stopped else first)
    stopped = stopped or (None if first is not None else feed.why_over())
    done: dict[int, int] = {}
    while len(done) < world:
        message = ranks.receive()
        if message[0] == "done":
            done[message[1]] = message[2]
            continue
        if message[0] != "row":
            continue  # 'state': rank 0 wrote it, the caller reads it
        _, rank, row = message
        waiting.setdefault(row["step"], {})[rank] = row
        if len(waiting[row["step"]]) < world:
            continue
        merged = _merged(waiting.pop(row["step"]))
        rows.append(merged)
        bar.update(1)
        bar.set_postfix(loss=f"{merged['loss']:.4g}", peak=format_bytes(merged["peak_bytes"]))
        if any(callback(merged) is False for callback in callbacks):
            stopped = "callback"
        elif stop is not None and stop.is_set():
            stopped = "stop requested"
        following = None if stopped else feed.next()
        ranks.send(following)
        if following is None and stopped is None:
            stopped = feed.why_over()
    return rows, stopped or "batches", done[0]


def _merged(by_rank: dict[int, dict]) -> dict:
    world = len(by_rank)
    row = dict(by_rank[0])
    row["loss"] = sum(by_rank[r]["loss"] for r in range(world)) / world
    row.update({f"peak_bytes_rank{r}": by_rank[r]["peak_bytes"] for r in range(world)})
    return row


def _rank(rank: int, job: RankJob, inbox, outbox) -> None:
    """One rank's process (NOTE [rank protocol])."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        device = torch.device("cuda", rank) if job.backend == "nccl" else torch.device("cpu")
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(job.backend, init_method=f"file://{Path(job.folder, 'rendezvous')}", rank=rank,
                                world_size=job.spec.world_size)
        try:
            pinned_bytes = _train_rank(rank, job, device, inbox, outbox)
        finally:
            dist.destroy_process_group()
        outbox.put(("done", rank, pinned_bytes))
    except BaseException:  # noqa: BLE001 - whatever it is, the parent hears of it and ends the others
        outbox.put(("error", rank, traceback.format_exc()))


def _train_rank(rank: int, job: RankJob, device: torch.device, inbox, outbox) -> int:
    model, optimizer, loss_fn = torch.load(io.BytesIO(job.payload), map_location=device, weights_only=False)
    names = {id(p): n for n, p in model.named_parameters()}
    spec = replace(job.spec, rank=rank)
    wrapped = spec.apply(model)
    inner = wrapped.module if isinstance(wrapped, DistributedDataParallel) else wrapped
    order = []  # the parameters' names in the order of the optimizer's groups: the user's optimizer's positions
    if optimizer is not None:  # the same groups, settings and state, over the wrapped (for FSDP, sharded) parameters
        order = [names[id(p)] for group in optimizer.param_groups for p in group["params"]]
        now = dict(inner.named_parameters())
        users = optimizer
        optimizer = same_optimizer(users, [{**group, "params": [now[names[id(p)]] for p in group["params"]]}
                                           for group in users.param_groups])
        load_optimizer_state(wrapped, optimizer, users.state_dict(), spec, order)
    runtime = OffloadRuntime(job.plans[rank], model=wrapped)
    without_plan = OffloadRuntime(None)
    warm_up = warm_up_steps(job.plans[rank])
    step = dict(loss_fn=loss_fn, optimizer=optimizer, options=job.options,
                scaler=grad_scaler(job.options, device))
    try:
        index = 0
        while (message := _next_message(inbox)) is not None:
            micro_batches = [on_device(batch, device) for batch in pickle.loads(message)]
            acting = runtime if index >= warm_up else without_plan
            outbox.put(("row", rank, one_step(index, wrapped, micro_batches, device, step, optimizer, acting,
                                              job.track)))
            index += 1
        state = {"model": full_model_state(wrapped, inner, spec),
                 "optimizer": None if optimizer is None else full_optimizer_state(wrapped, optimizer, spec, order)}
        if rank == 0:
            torch.save(state, Path(job.folder, "state.pt"))
            outbox.put(("state", rank))
        return runtime.pool.capacity_bytes if runtime.pool is not None else 0
    finally:
        runtime.release()
        without_plan.release()


def _next_message(inbox) -> bytes | None:
    """The parent's next message; None also when the parent is gone (no rank outlives it)."""
    parent = multiprocessing.process.parent_process()
    while True:
        try:
            return inbox.get(timeout=POLL_S)
        except queue.Empty:
            if parent is not None and not parent.is_alive():
                return None
