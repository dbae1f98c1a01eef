"""Analysis: trace one training step (forward, backward, optimizer) at the level of aten ops.

``trace`` runs the step under fake tensors (no memory, no GPU) and returns a Graph; the
recorder follows every storage from allocation to release (NOTE [storage lifetimes]). With
``parallel=`` it is one rank's step under DDP or FSDP2 (one_rank.py, NOTE [one rank of N]).
``recording`` is what later stages take from here: ``record_real_step`` records a real step into a Graph
(measurement, cost), ``records_op`` numbers ops as a Graph does (the runtime).
May import: the Graph, the vocabulary, units, errors, devices, the workload and the parallel specs.
"""

from udnn_lab.analysis.tracing import trace

__all__ = ["trace"]
