"""Plans: what to keep on the device, offload to host memory, or recompute (see ir.py)."""

from udnn_lab.plan.ir import Offload, Plan, PlanError, Recompute

__all__ = ["Offload", "Plan", "PlanError", "Recompute"]
