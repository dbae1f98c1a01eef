"""Measurement: run the step for real and record what it does (live bytes per op, CUDA counters, NVML).

May import: analysis (the recorder and the step), the Graph, the runtime, devices, units and errors.
"""

from udnn_lab.measurement.cpu_snapshot import write_cpu_snapshot
from udnn_lab.measurement.measuring import Measurement, measure
from udnn_lab.measurement.snapshot import Replay, Snapshot, load_snapshot

__all__ = ["Measurement", "Replay", "Snapshot", "load_snapshot", "measure", "write_cpu_snapshot"]
