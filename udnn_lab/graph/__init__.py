"""The data every later stage reads: the traced step's Graph, its liveness, and the Plan IR; the vDNN papers'
network-wide accounting of a step's memory.

May import: the vocabulary, units and errors only.
"""

from udnn_lab.graph.paper_accounting import NetworkWide, network_wide
from udnn_lab.graph.plan_ir import Offload, Plan, PlanError, Recompute, TensorSite
from udnn_lab.graph.step_graph import Graph, HookEvent, ModuleCall, OpInfo, TensorInfo

__all__ = ["Graph", "HookEvent", "ModuleCall", "NetworkWide", "Offload", "OpInfo", "Plan", "PlanError", "Recompute",
           "TensorInfo", "TensorSite", "network_wide"]
