"""Simulation: Graph + Plan + costs -> Simulation, one step on three streams (NOTE [simulated streams]).

May import: the Graph and Plan IR, hardware, cost, the vocabulary and units.
"""

from udnn_lab.simulation.simulator import Simulation, simulate, simulate_with

__all__ = ["Simulation", "simulate", "simulate_with"]
