"""Costs: measured op times (``profile``), rate curves, and the cost model the simulator and planners use.

May import: the Graph, hardware, analysis (to run a profiled step), units and errors.
"""

from udnn_lab.cost.model import CostModel, RateCurve
from udnn_lab.cost.profiling import Profile, profile

__all__ = ["CostModel", "Profile", "RateCurve", "profile"]
