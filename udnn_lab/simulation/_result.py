"""What ``simulate`` returns: the totals of one simulated step, and its tables on demand."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np
import pandas as pd

from udnn_lab.simulation._tables import StepRecord, counted_by_op, curve_frame, timeline_frame
from udnn_lab.units import format_bytes, format_seconds


@dataclass(frozen=True, repr=False)
class Simulation:
    """The predicted step: timeline, memory curve, time, stalls and traffic.

    The totals are computed as the step is simulated; the two tables (``timeline``, ``curve``) are
    built the first time they are read, since planners simulate many plans and read only the totals.
    """

    model_name: str
    policy: str
    device: str
    budget_bytes: int | None
    step_time_s: float
    compute_time_s: float  # ops and recomputations
    stall_time_s: float  # compute waiting for memory or for prefetches
    d2h_bytes: int
    h2d_bytes: int
    lower_bound_s: float  # max(compute time, D2H bytes / bandwidth, H2D bytes / bandwidth, communication time)
    peak_bytes: int  # as the budget counts them: 512-byte blocks on CUDA, exact on CPU
    record: StepRecord = field(compare=False)  # what happened, as rows (with the graph): the tables come from it
    released_before: Mapping[int, int] = field(default_factory=dict)  # offloaded tensor -> op it was freed before
    # what the plan changes of the analyzer's liveness: (first op it holds for, +1 back on / -1 off the device,
    # tensor id), in the order they happened; a tensor is on the device at op i when the graph has it live there
    # plus the signs of its changes from ops <= i is 1 (how frames.live_tensors lists the tensors at an op)
    device_changes: tuple[tuple[int, int, int], ...] = ()
    # one rank of several (NOTE [collectives]): seconds the communication stream is busy, seconds of it compute
    # waits for or that outlast compute, and bytes of the collectives' buffers; 0 for a graph without collectives
    communication_time_s: float = 0.0
    exposed_communication_s: float = 0.0
    communication_bytes: int = 0
    hardware: str = ""  # the name of the profile it was simulated on
    scratch_by_op: np.ndarray | None = field(default=None, compare=False)  # each op's scratch, where any was priced

    def __repr__(self) -> str:
        budget = format_bytes(self.budget_bytes) if self.budget_bytes is not None else "none"
        return (f"Simulation({self.model_name!r}, {self.policy}, step={format_seconds(self.step_time_s)}, "
                f"stall={format_seconds(self.stall_time_s)}, peak={format_bytes(self.peak_bytes)}, budget={budget}, "
                f"hardware={self.hardware!r})")

    @property
    def fits(self) -> bool:
        return self.budget_bytes is None or self.peak_bytes <= self.budget_bytes

    def counted_by_op(self) -> tuple[np.ndarray, int]:
        """(the bytes the budget counts while each op runs, its scratch with it; those before the first op)."""
        return counted_by_op(self.record.graph, self.device_changes, self.scratch_by_op)

    @cached_property
    def timeline(self) -> pd.DataFrame:
        """One row per op, copy and stall (simulation._tables.TIMELINE_COLUMNS), by start time."""
        return timeline_frame(self.record)

    @cached_property
    def curve(self) -> pd.DataFrame:
        """Graph.memory_curve()'s columns under the plan, plus each op's start_s and end_s."""
        return curve_frame(self.record)

    def memory_curve(self) -> pd.DataFrame:
        return self.curve.copy()
