"""A memory snapshot of a real training step on the CPU, in the format ``torch.cuda.memory._dump_snapshot`` writes.

Without a GPU there is no caching allocator to record, but the step's storages can be: the step runs for real
under the recorder ``measure`` uses (NOTE [storage lifetimes] in analysis/_recorder.py), which calls back after
each op, and the Python stack is read there, so that every allocation has the frames of the code that asked
for it. The file then holds what a CUDA snapshot holds for the same step: ``segments`` (the blocks held at the
end, one segment each) and one device's history of ``alloc``, ``free_requested`` and ``free_completed``
events. Sizes are exact storage bytes; an ``addr`` is the storage's number in the recording (a CPU run has no
device addresses, and the history only needs one per live block); no segment events, so no reserved bytes.
Anything that reads a snapshot (``ul.load_snapshot``, the overlay on a prediction, PyTorch's memory_viz) reads it.
"""

from __future__ import annotations

import gzip
import pickle
import sys
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

import torch

from udnn_lab.analysis.recording import record_real_step
from udnn_lab.analysis.step import grad_scaler, preserved, run_step, split_input, state_made_at_first_step
from udnn_lab.devices import model_device
from udnn_lab.graph.step_graph import Graph, TensorInfo
from udnn_lab.workload import as_workload, check_one_process

_BASE_ADDRESS = 1 << 32  # addresses are _BASE_ADDRESS + _ADDRESS_STRIDE * the storage's number
_ADDRESS_STRIDE = 1 << 20
_RECORDER = "udnn_lab/analysis/_recorder.py"  # its frames say how the stack was read, not who allocated


def write_cpu_snapshot(path: str | Path, model: torch.nn.Module | Any, example_input: Any = None,
                       loss_fn: Callable | None = None, optimizer: torch.optim.Optimizer | None = None, *,
                       target: Any = None, warmup: int = 1) -> Path:
    """Run one real training step on the CPU and write its storages' history as a memory snapshot at ``path``.

    ``model`` is a module on the CPU with its ``example_input`` (and ``loss_fn``, ``optimizer``, ``target``, as
    ``ul.measure`` takes them) or a Workload. ``warmup`` plain steps run first (they make the optimizer's state);
    parameters, gradients and optimizer state are restored afterwards. A path ending in ``.gz`` is gzip'd.
    """
    work = as_workload(model, example_input, loss_fn=loss_fn, optimizer=optimizer, target=target)
    check_one_process(work, "write_cpu_snapshot")
    device = model_device(work.model)
    if device.type != "cpu":
        raise ValueError(f"write_cpu_snapshot records a step on the CPU, and this model is on {device}: on a GPU "
                         "record with torch.cuda.memory._record_memory_history() and write the file with "
                         "torch.cuda.memory._dump_snapshot(path)")
    args, kwargs = split_input(work.example_input)
    stacks: list[list[dict]] = []
    scaler = grad_scaler(work.step_options, device)
    with preserved(work.model, work.optimizer):
        for _ in range(warmup):
            run_step(work.model, args, kwargs, loss_fn=work.loss_fn, target=work.target, optimizer=work.optimizer,
                     options=work.step_options, scaler=scaler)
        work.model.zero_grad(set_to_none=True)  # the recorded step starts without gradients, as measure's does
        with state_made_at_first_step(work.optimizer):  # no warm-up: the state of the parameters given a gradient
            recorded = record_real_step(work.model, args, kwargs, target=work.target, loss_fn=work.loss_fn,
                                        optimizer=work.optimizer, name=work.name, device_type="cpu",
                                        options=work.step_options, scaler=scaler,
                                        after_op=lambda: stacks.append(_frames(sys._getframe(1))))
    snapshot = snapshot_of(recorded, stacks)
    out = Path(path)
    raw = pickle.dumps(snapshot, protocol=4)
    out.write_bytes(gzip.compress(raw) if out.suffix == ".gz" else raw)
    return out


def snapshot_of(step: Graph, stacks: list[list[dict]]) -> dict:
    """A snapshot dict of a recorded real step (``stacks``: the frames of each op's caller, innermost first).

    Each op's allocations come before the releases right after it (NOTE [storage lifetimes] 3), so the history's
    most allocated at once is the step's peak as its memory curve counts it.
    """
    if len(stacks) != len(step.ops):
        raise ValueError(f"one stack per op of the step: {len(stacks)} stacks for {len(step.ops)} ops")
    events: list[dict] = []
    tensors = [t for t in step.tensors if step.on_device(t) and t.nbytes > 0]
    for index in range(len(step.ops)):
        for t in tensors:
            if t.alloc_step == index:
                events.append({"action": "alloc", "addr": _address(t.id), "size": t.nbytes, "stream": 0,
                               "frames": stacks[index]})
        for t in tensors:
            if t.free_step == index:
                for action in ("free_requested", "free_completed"):
                    events.append({"action": action, "addr": _address(t.id), "size": t.nbytes, "stream": 0,
                                   "frames": stacks[index]})
    segments = [_segment(t, stacks[t.alloc_step] if t.alloc_step >= 0 else []) for t in tensors
                if t.free_step is None]
    return {"segments": segments, "device_traces": [events]}


def _segment(t: TensorInfo, frames: list[dict]) -> dict:
    """A block held at the end, as the one block of its own segment."""
    block = {"address": _address(t.id), "size": t.nbytes, "requested_size": t.nbytes, "state": "active_allocated",
             "frames": frames}
    return {"device": 0, "address": block["address"], "total_size": t.nbytes, "allocated_size": t.nbytes,
            "active_size": t.nbytes, "requested_size": t.nbytes, "stream": 0, "segment_type": "large",
            "is_expandable": False, "blocks": [block]}


def _address(storage: int) -> int:
    return _BASE_ADDRESS + _ADDRESS_STRIDE * storage


def _frames(frame: FrameType | None) -> list[dict]:
    """The stack from ``frame`` out, innermost first, as a snapshot's frames; the recorder's own left out."""
    found = []
    while frame is not None:
        code = frame.f_code
        if not code.co_filename.endswith(_RECORDER):
            found.append({"filename": code.co_filename, "line": frame.f_lineno, "name": code.co_name})
        frame = frame.f_back
    return found
