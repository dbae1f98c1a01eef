"""A real step recorded op by op: what measurement, cost, the runtime and fitting take from the tracer.

``record_real_step`` runs one training step on real tensors under the recorder and returns its Graph (the
tracer's own rules: which ops are recorded, NOTE [storage lifetimes]). ``records_op`` says whether an op is
one the Graph counts, so that a runtime following a plan numbers ops as the plan does. ``flat_tensors``,
``is_distributed``, ``fsdp_modules``, ``resized_storages`` and ``plain_values`` (with ``PLAIN_TYPES``) read
tensors out of arguments and models as the recorder does;
``HOST_NOTE_START`` and ``with_host_note`` write and find a graph's note on host memory (NOTE [host storages]);
``written_positions`` says where an op writes in place, and ``real_step_ops`` lists the ops a real step runs
(NOTE [view replay] 4).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from udnn_lab.analysis._fake.memo import flat_tensors
from udnn_lab.analysis._host import HOST_NOTE_START, with_host_note
from udnn_lab.analysis._recorder import PLAIN_TYPES, StepRecorder, plain_values, records_op
from udnn_lab.analysis._recording import graph_from_recording, record_step
from udnn_lab.analysis._sharded import fsdp_modules, is_distributed, resized_storages
from udnn_lab.analysis._view_writes import real_step_ops, written_positions
from udnn_lab.graph.step_graph import Graph
from udnn_lab.workload import DEFAULT_STEP, StepOptions


def record_real_step(model: torch.nn.Module, args: tuple, kwargs: dict, *, target: Any, loss_fn: Callable | None,
                     optimizer: torch.optim.Optimizer | None, name: str, device_type: str,
                     options: StepOptions = DEFAULT_STEP, scaler: torch.amp.GradScaler | None = None,
                     runtime: Any = None, after_op: Callable[[], None] | None = None,
                     track_saved: bool = False) -> Graph:
    """One real training step, recorded: its Graph (``fake=False``), named ``name`` on ``device_type``.

    ``runtime``: an OffloadRuntime the step runs under; ``after_op``: called after each recorded op (to read the
    CUDA allocator's counters). ``options`` and ``scaler``: as ``run_step`` takes them. ``track_saved``: record
    what autograd saves and the module and saved-tensor hook calls, as ``trace`` does (a plan can then be made
    for the Graph and followed by hooks).
    """
    recorder = StepRecorder(after_op=after_op)
    if device_type == "cpu" and runtime is not None:
        recorder.replayed = []  # what its recomputations hold is counted (a CUDA step's allocator sees it)
    record_step(recorder, model, args, kwargs, target, loss_fn, optimizer, track_saved=track_saved, runtime=runtime,
                options=options, scaler=scaler)
    return graph_from_recording(recorder, name, device_type, fake=False)


__all__ = ["HOST_NOTE_START", "PLAIN_TYPES", "flat_tensors", "fsdp_modules", "is_distributed", "plain_values",
           "real_step_ops", "record_real_step", "records_op", "resized_storages", "with_host_note", "written_positions"]
