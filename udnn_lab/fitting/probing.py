"""One probe of a fit search: build the step at a size, trace it under fake tensors, hold it against the budget."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.utils._pytree import tree_flatten

from udnn_lab.analysis import trace
from udnn_lab.analysis.step import input_tensors, split_input
from udnn_lab.errors import BudgetTooSmall, HostBudgetExceeded, PlanInfeasible
from udnn_lab.fitting.result import Probe
from udnn_lab.graph import Graph
from udnn_lab.hardware import Hardware
from udnn_lab.planning import Plan, host, plan
from udnn_lab.planning.reserved import reserved_peak_bytes
from udnn_lab.simulation import simulate
from udnn_lab.units import format_bytes
from udnn_lab.vocabulary import Dimension
from udnn_lab.workload import Workload

StepFactory = Callable[[int], Workload]  # size -> the training step at that size
TRANSIENT = 2  # a step is built with a copy of its batch alive at once (random values made, then cast or moved)


class StepProber:
    """Probes of one search: the same model, budget, policy and hardware at each size asked for."""

    def __init__(self, build: StepFactory, budget_bytes: int, policy: str, hardware: Hardware,
                 dimension: Dimension, host_budget_bytes: int | None = None, counts: str = "allocated",
                 outside_bytes: int = 0) -> None:
        self.build, self.budget_bytes, self.policy = build, budget_bytes, policy
        self.counts, self.outside_bytes = counts, outside_bytes  # 'reserved': planning/reserved.py
        self.host_budget_bytes = host_budget_bytes
        self.hardware, self.dimension = hardware, dimension
        self.model_name = ""
        self.weights_bytes = 0
        self.notes: tuple[str, ...] = ()  # the traced steps' notes, each once
        self._input_elements: dict[int, int] = {}
        self._host_bytes: dict[int, int] = {}  # size -> bytes its built step held in this host's memory

    def __call__(self, size: int) -> Probe:
        graph = trace(self._workload(size), device=self.hardware.device_type)
        self.model_name = graph.model_name
        self.weights_bytes = weights_bytes(graph)
        self.notes += tuple(note for note in graph.notes if note not in self.notes)
        if self.weights_bytes > self.budget_bytes:
            raise BudgetTooSmall(
                f"the weights of {graph.model_name} alone take {format_bytes(self.weights_bytes)}, more than the "
                f"{format_bytes(self.budget_bytes)} budget, so no {self._name} fits: raise the budget, or hold the "
                "weights in a 16-bit dtype (dtype=torch.bfloat16; --dtype bfloat16)", self.weights_bytes)
        traced = int(graph.counted_peak_bytes)
        if self.counts == "reserved":
            return self._in_reserved_bytes(size, graph, traced)
        # Under a budget the keep-all step fits, every policy keeps everything (planning.registry): nothing to plan
        if self.policy == "keep-all" or traced <= self.budget_bytes:
            return Probe(size, traced, traced <= self.budget_bytes, traced)
        try:
            chosen = plan(graph, self.budget_bytes, self.policy, hardware=self.hardware,
                          host_budget=self.host_budget_bytes)
        except HostBudgetExceeded as over:  # fits the device; its offloads need more host memory than allowed
            return Probe(size, over.peak_bytes, False, traced, over.host_bytes)
        except PlanInfeasible as infeasible:
            return Probe(size, infeasible.minimum_bytes, False, traced)
        held = chosen.host_pool_bytes
        return Probe(size, simulate(graph, chosen, hardware=self.hardware).peak_bytes, True, traced, held)

    def _in_reserved_bytes(self, size: int, graph: Graph, traced: int) -> Probe:
        """The probe with its peak counted as the caching allocator model reserves, plus what is outside it."""
        kept = Plan.keep_all(graph)
        held = reserved_peak_bytes(graph, kept, simulate(graph, kept, hardware=self.hardware)) + self.outside_bytes
        if self.policy == "keep-all" or held <= self.budget_bytes:
            return Probe(size, held, held <= self.budget_bytes, traced)
        try:
            chosen = plan(graph, self.budget_bytes, self.policy, hardware=self.hardware,
                          host_budget=self.host_budget_bytes, counts="reserved", outside_bytes=self.outside_bytes)
        except HostBudgetExceeded as over:
            return Probe(size, over.peak_bytes, False, traced, over.host_bytes)
        except PlanInfeasible:  # no plan of the policy: what keeping everything reserves
            return Probe(size, held, False, traced)
        reserved = reserved_peak_bytes(graph, chosen, simulate(graph, chosen, hardware=self.hardware))
        return Probe(size, reserved + self.outside_bytes, True, traced, chosen.host_pool_bytes)

    @property
    def _name(self) -> str:
        return "sequence length" if self.dimension == "seq_len" else "batch"

    def _workload(self, size: int) -> Workload:
        expected = self._expected_host_bytes(size)
        if expected:
            host.require_host(expected, f"building the step at {self._name} {size}",
                              f"lower the limit (limit=) below {size}, build the step on the meta device, or free "
                              "host memory")
        work = self.build(size)
        if not isinstance(work, Workload):
            raise TypeError(f"the step factory gave a {type(work).__name__} for {self._name} {size}, not a Workload: "
                            f"return ul.zoo.get(..., {self.dimension}=size) or ul.Workload(model, example_input, ...)")
        elements = sum(t.numel() for t in input_tensors(*split_input(work.example_input)))
        same = [other for other, count in self._input_elements.items() if count == elements and other != size]
        if same:
            raise ValueError(f"the step factory gave the same input ({elements} elements) for {self._name} {same[0]} "
                             f"and {size}: it must build the input from the {self._name} it is given")
        self._input_elements[size] = elements
        self._host_bytes[size] = host_held_bytes(work)
        return work

    def _expected_host_bytes(self, size: int) -> int:
        """Host memory building the step at ``size`` takes, from the sizes built so far (a line through the two
        largest, or through zero with one), a batch copy alive at once (``TRANSIENT``); 0 before any."""
        known = sorted(self._host_bytes.items())[-2:]
        if not known:
            return 0
        if len(known) == 1:
            (low, held), = known
            return TRANSIENT * held * max(size, low) // low
        (low, low_bytes), (high, high_bytes) = known
        slope = max(0.0, (high_bytes - low_bytes) / (high - low))
        return TRANSIENT * int(max(high_bytes, high_bytes + slope * (size - high)))


def weights_bytes(graph: Graph) -> int:
    """Bytes of the model's parameters on the device, counted as the budget counts them."""
    cuda = graph.device == "cuda"
    return sum(t.cuda_nbytes if cuda else t.nbytes for t in graph.tensors if t.category == "parameter")


def host_held_bytes(work: Workload) -> int:
    """Bytes a built step holds in this host's memory: the storages of its model, input and target on the CPU
    (none when they are on the meta device)."""
    leaves, _ = tree_flatten((list(work.model.parameters()), list(work.model.buffers()), work.example_input,
                              work.target))
    storages = {leaf.untyped_storage().data_ptr(): leaf.untyped_storage().nbytes()
                for leaf in leaves if isinstance(leaf, torch.Tensor) and leaf.device.type == "cpu"}
    return sum(storages.values())
