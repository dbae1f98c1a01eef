"""The vDNN papers' "average memory usage" reduction, for a simulated step.

Document 002 (SEEDS.md) reports "average GPU memory −91% (AlexNet), −95% (GoogLeNet)" for vDNN.
The reduction is against the paper's baseline, the network-wide allocation of
:func:`udnn_lab.graph.paper_accounting.network_wide` (every buffer allocated for the whole step),
whose memory is constant, so its average is its total. SEEDS.md does not say over what vDNN's
usage is averaged; we read it as the step's time (assumed), each op's bytes held for as long as the
simulation says the op lasts. Only the paper's functions are counted on both sides: the optimizer's
state is left out of vDNN's usage as it is of the baseline, and workspaces of neither.

PyTorch's accounting of the same saving (``frames.savings``' ``average_saved``) compares against
the keep-all step, whose tensors are freed after their last use: a much smaller baseline.
"""

from __future__ import annotations

import numpy as np

from udnn_lab.graph.paper_accounting import network_wide
from udnn_lab.graph.step_graph import Graph
from udnn_lab.simulation.simulator import Simulation
from udnn_lab.vocabulary import CATEGORIES

PAPER_CATEGORIES = tuple(c for c in CATEGORIES if c != "optimizer_state")  # what the baseline counts


def network_wide_saving(graph: Graph, simulation: Simulation) -> float:
    """1 − (the step's live bytes averaged over its time) / the network-wide baseline: the papers' reduction.

    ``simulation`` must be of ``graph``'s step (``ul.simulate(graph, plan)``); exact bytes, optimizer state
    excluded (module docstring).
    """
    curve = simulation.curve
    same_step = (simulation.model_name == graph.model_name and len(curve) == len(graph.ops)
                 and curve.attrs.get("baseline_bytes") == graph.baseline_bytes)
    if not same_step:
        raise ValueError(f"the simulation is of another step ({simulation.model_name!r}, {len(curve)} ops, "
                         f"{curve.attrs.get('baseline_bytes')} bytes before the first) than the graph "
                         f"({graph.model_name!r}, {len(graph.ops)} ops, {graph.baseline_bytes} bytes before the "
                         f"first): pass ul.simulate(graph, plan)")
    baseline = network_wide(graph).total_bytes
    if baseline == 0:
        raise ValueError(f"{graph.model_name!r} holds no bytes on {graph.device} in the paper's functions: "
                         f"nothing to compare against")
    return 1.0 - time_averaged_bytes(simulation) / baseline


def time_averaged_bytes(simulation: Simulation) -> float:
    """Exact live bytes in the paper's functions, averaged over the step's time."""
    curve = simulation.curve
    if not len(curve):
        return 0.0
    live = curve[list(PAPER_CATEGORIES)].to_numpy().sum(axis=1)
    held = np.diff(curve["end_s"].to_numpy(), prepend=0.0)  # op i's bytes, from op i-1's end to its own
    total = held.sum()
    return float((live * held).sum() / total) if total > 0 else float(live.mean())
