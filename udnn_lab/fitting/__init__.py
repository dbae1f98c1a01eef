"""Fitting: the largest batch size, or sequence length, whose training step fits a memory budget.

``sweep_ranks`` and ``min_world_size`` answer the same across ranks: per-rank peak and step time against
world size under DDP, FSDP2 and HSDP, and the smallest world size that fits. ``sweep`` is ``ul.sweep``:
``planning.sweep`` over budgets for a Graph, ``sweep_ranks`` when given ``world_sizes``.

``max_batch`` and ``max_seq_len`` build the step at each size they try (a zoo name with its
options, or your own callable), trace it under fake tensors and hold it against the budget:
the traced peak under keep-all, a feasible ``plan()`` (within the host budget) under another policy, on
``hardware`` (default None: the profile for this machine), whose device memory bounds the budget. Sizes grow
exponentially, then the gap is bisected (NOTE [monotone peak] in search.py); the result is a
FitSearch with every probe. May import: analysis, graph, hardware, simulation, planning, zoo,
and the workload, vocabulary, units and errors.
"""

from udnn_lab.fitting.maximum import max_batch, max_seq_len
from udnn_lab.fitting.ranks import SETUPS, WorldSizeSearch, min_world_size, parallel_spec, sweep, sweep_ranks
from udnn_lab.fitting.result import FitSearch, Probe

__all__ = ["SETUPS", "FitSearch", "Probe", "WorldSizeSearch", "max_batch", "max_seq_len", "min_world_size",
           "parallel_spec", "sweep", "sweep_ranks"]
