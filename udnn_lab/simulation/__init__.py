"""Simulation: Graph + Plan + costs -> Simulation, one step on three streams (NOTE [simulated streams]),
and the collectives of one rank of several on a fourth (NOTE [collectives]).

May import: the Graph and Plan IR, hardware, cost, the vocabulary and units.
"""

from udnn_lab.simulation.paper_savings import network_wide_saving
from udnn_lab.simulation.simulator import Simulation, simulate, simulate_with

__all__ = ["Simulation", "network_wide_saving", "simulate", "simulate_with"]
