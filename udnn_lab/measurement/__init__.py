"""Measurement: run the step for real and record what it does (live bytes per op, CUDA counters, NVML).

May import: analysis (the recorder and the step), the Graph, the runtime, devices, units and errors.
"""

from udnn_lab.measurement.measuring import Measurement, measure

__all__ = ["Measurement", "measure"]
