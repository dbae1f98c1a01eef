"""What a graph's notes say when CPU kernels stood in for a CUDA device's (tracing.py and one_rank.py)."""

from __future__ import annotations

from typing import Any

from udnn_lab.analysis._fake.attention import STAND_IN_ATTENTION_NOTE
from udnn_lab.analysis._fake.autocast import STAND_IN_AUTOCAST_NOTE
from udnn_lab.analysis._fake.dropout import STAND_IN_DROPOUT_NOTE
from udnn_lab.workload import StepOptions

CPU_FOR_CUDA_NOTE = ("no CUDA device here: traced with CPU kernels; sizes are those of the CUDA step, "
                     "cuDNN-specific saved tensors and workspaces are not included")
CPU_AUTOCAST_NOTE = ("autocast ran with the CPU's lists of ops to cast (CPU kernels stood in for CUDA ones): CUDA's "
                     "autocast casts some other ops, so casts and saved tensors can differ from the CUDA step")


def substitution_notes(substituted: bool, options: StepOptions, attention: Any, dropout: Any = None,
                       casts: Any = None) -> list[str]:
    """What the graph's notes say when CPU kernels stood in for CUDA ones."""
    notes = [CPU_FOR_CUDA_NOTE] if substituted else []
    if substituted and options.mixed:
        notes.append(CPU_AUTOCAST_NOTE)
    if getattr(attention, "substituted", 0):
        notes.append(STAND_IN_ATTENTION_NOTE)
    if getattr(dropout, "substituted", 0):
        notes.append(STAND_IN_DROPOUT_NOTE)
    if getattr(casts, "cast", 0):
        notes.append(STAND_IN_AUTOCAST_NOTE)
    return notes
