"""What MemoryLab asks of the library, with the caches that keep its slider snappy.

Tracing is cached per network setting, the minimum budget per graph, policy and hardware,
and simulations per budget, all in the instance (no module-level state). Nothing here
decides anything: it calls zoo, trace, plan, min_budget, simulate and measure.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from udnn_lab import zoo
from udnn_lab.analysis.tracing import trace
from udnn_lab.errors import PlanInfeasible, UdnnLabError
from udnn_lab.graph.plan_ir import Plan
from udnn_lab.graph.step_graph import Graph
from udnn_lab.hardware.profiles import Hardware
from udnn_lab.measurement.measuring import Measurement, measure
from udnn_lab.planning.budget import min_budget, plan
from udnn_lab.planning.reserved import allocated_peak_bytes, counts_whole_blocks, reserved_peak_bytes
from udnn_lab.simulation.simulator import Simulation, resolve_hardware, simulate
from udnn_lab.units import format_bytes
from udnn_lab.vocabulary import AttentionImplementation, Precision
from udnn_lab.widgets._networks import zoo_request
from udnn_lab.widgets._parallel_controls import spec_of
from udnn_lab.workload import Workload


@dataclass(frozen=True)
class Setting:
    """One training step as the app's controls describe it."""

    network: str  # a zoo name, an hf: one with '-small' (widgets/_networks.py), or the label of the module passed in
    batch: int
    precision: Precision
    optimizer: str  # one of OPTIMIZERS
    device: str  # 'cuda' or 'cpu': the device whose memory is predicted (the hardware profile's)
    seq_len: int | None = None  # tokens per example of an hf: network; None for the others
    lora_rank: int | None = None  # LoRA adapters of this rank on the frozen hf: network; None: a full fine-tune
    attn_implementation: AttentionImplementation | None = None  # of an hf: network
    parallel: str | None = None  # 'DDP', 'FSDP2' or 'HSDP': the step is one rank of world_size; None: one GPU
    world_size: int = 1
    offload_params: bool = False  # FSDP2's CPUOffloadPolicy (FSDP2 and HSDP only)


@dataclass(frozen=True)
class MeasuredStep:
    """A real step on this machine beside its own prediction: same device, same plan, same ops."""

    asked: tuple[Setting, str, int | None, str]  # setting, policy, budget and hardware on screen when it was made
    measurement: Measurement
    graph: Graph  # the measured step, traced for the device it ran on
    prediction: Simulation  # of the plan the step ran under, on that graph
    note: str  # why this plan: the one on screen, made again for this device, or every tensor kept
    hardware_name: str  # the profile the prediction was simulated with (this machine's, where there is one)
    min_budget_bytes: int | None  # the policy's smallest budget for this step on that profile; None: none known


class _Cache(OrderedDict):
    """A small least-recently-used map."""

    def __init__(self, size: int) -> None:
        super().__init__()
        self.size = size

    def get_or_make(self, key: Any, make: Callable[[], Any]) -> Any:
        if key in self:
            self.move_to_end(key)
            return self[key]
        value = self[key] = make()
        while len(self) > self.size:
            self.popitem(last=False)
        return value


class LabSession:
    """Graphs, minimum budgets and simulations for MemoryLab, computed once and kept."""

    def __init__(self, model: nn.Module | None = None, input_shape: tuple[int, ...] | None = None,
                 image_size: int | None = None, hardware: dict[str, Hardware] | None = None) -> None:
        if model is not None and input_shape is None:
            raise ValueError("for your own module, give input_shape: the shape of one example, e.g. (3, 224, 224)")
        self.model, self.input_shape, self.image_size = model, input_shape, image_size
        self.custom_name = f"{type(model).__name__} (yours)" if model is not None else None
        self._hardware = dict(hardware or {})
        self._graphs = _Cache(6)
        self._trainable = _Cache(2)
        self._minimums = _Cache(64)
        self._simulations = _Cache(64)

    def hardware_names(self) -> list[str]:
        return list(self._hardware) + [n for n in Hardware.names() if n not in self._hardware]

    def hardware(self, name: str) -> Hardware:
        if name not in self._hardware:
            self._hardware[name] = Hardware.load(name)
        return self._hardware[name]

    def workload(self, setting: Setting, device: str) -> Workload:
        """The step on ``device`` ('meta' to trace without weights, 'cpu' to run it)."""
        optimizer = None if setting.optimizer == "none" else setting.optimizer
        parallel = spec_of(setting.parallel, setting.world_size, setting.offload_params)
        if setting.network == self.custom_name:
            assert self.model is not None  # custom_name is set only with a model
            # the zoo checks that your module is in the precision's dtype, and says how to convert it if not
            return zoo.get(self.model, batch=setting.batch, input_shape=self.input_shape, optimizer=optimizer,
                           precision=setting.precision, parallel=parallel)
        name, small = zoo_request(setting.network)
        return zoo.get(name, batch=setting.batch, image_size=self.image_size, device=device, optimizer=optimizer,
                       precision=setting.precision, small=small, seq_len=setting.seq_len,
                       lora_rank=setting.lora_rank, attn_implementation=setting.attn_implementation, parallel=parallel)

    def graph(self, setting: Setting) -> Graph:
        """The step the setting describes (one rank of it, with ranks set), traced for the profile's device."""
        return self._graphs.get_or_make(setting, lambda: trace(self.workload(setting, "meta"), device=setting.device))

    def min_budget(self, setting: Setting, policy: str, hardware: str) -> int:
        key = (setting, policy, hardware)
        return self._minimums.get_or_make(
            key, lambda: min_budget(self.graph(setting), policy, hardware=self.hardware(hardware)))

    def planned(self, setting: Setting, policy: str, budget_bytes: int | None, hardware: str,
                counts: str = "allocated") -> tuple[Plan, Simulation]:
        """The plan of ``policy`` under the budget (counted as ``counts`` says: ul.plan's) and its simulation;
        raises PlanInfeasible when it cannot fit."""
        def make() -> tuple[Plan, Simulation]:
            graph, hw = self.graph(setting), self.hardware(hardware)
            chosen = plan(graph, budget_bytes, policy, hardware=hw, counts=counts)
            return chosen, simulate(graph, chosen, hardware=hw)
        return self._simulations.get_or_make((setting, policy, budget_bytes, hardware, counts), make)

    def reserved_peak(self, setting: Setting, chosen: Plan, simulation: Simulation) -> int:
        """What the caching allocator model reserves at most over the step under ``chosen``."""
        return reserved_peak_bytes(self.graph(setting), chosen, simulation)

    def counted_peak(self, setting: Setting, chosen: Plan, simulation: Simulation) -> int | None:
        """The peak as torch.cuda.max_memory_allocated counts it under ``chosen`` (NOTE [whole blocks] in
        planning/reserved.py), where it differs from the live peak: a CUDA step; None elsewhere."""
        graph = self.graph(setting)
        return allocated_peak_bytes(graph, chosen, simulation) if counts_whole_blocks(graph) else None

    def baseline(self, setting: Setting, budget_bytes: int | None, hardware: str) -> tuple[Plan, Simulation]:
        """Every tensor kept, under the budget (it may not fit): what the app shows when no plan fits."""
        def make() -> tuple[Plan, Simulation]:
            graph, hw = self.graph(setting), self.hardware(hardware)
            kept = Plan.keep_all(graph, budget_bytes)
            return kept, simulate(graph, kept, hardware=hw)
        return self._simulations.get_or_make((setting, "keep-all*", budget_bytes, hardware), make)

    def trainable(self, setting: Setting) -> Workload:
        """The model the app trains for this setting, on this machine (kept, so Train carries on from where it
        stopped); your own module itself when you passed one. With ranks set, the model each rank copies."""
        device = "cuda" if setting.device == "cuda" and torch.cuda.is_available() else "cpu"
        return self._trainable.get_or_make((setting, device), lambda: self.workload(setting, device))

    def local_device(self, setting: Setting) -> str:
        """Where this machine runs the setting's step: CUDA when the profile is CUDA's and there is one, else CPU."""
        return "cuda" if setting.device == "cuda" and torch.cuda.is_available() else "cpu"

    def local_hardware(self, device: str, hardware: str) -> Hardware:
        """The profile to plan a step on this machine's ``device`` with: ``hardware`` when it is of that kind,
        else the shipped profile of this machine, else ``hardware`` after all (its copy rates are a guess)."""
        chosen = self.hardware(hardware)
        if chosen.device_type == device:
            return chosen
        try:
            return resolve_hardware(None, device)
        except ValueError:
            return chosen

    def measure(self, setting: Setting, policy: str, budget_bytes: int | None, hardware: str,
                repeats: int = 1) -> MeasuredStep:
        """A real step on this machine (on its CPU when it lacks the profile's device; where your module lives
        when you passed one), under the plan of ``policy`` and the budget made again for that device's step,
        beside that plan's prediction. When the plan cannot fit there, the step runs with every tensor kept."""
        _one_process(setting, "Measure")
        work = self.workload(setting, self.local_device(setting))  # your own module stays where it lives
        graph = trace(work)
        local = self.local_hardware(graph.device, hardware)
        where = f"this machine's {graph.device}"
        try:
            chosen = plan(graph, budget_bytes, policy, hardware=local)
            note = f"the {policy} plan at {_budget(budget_bytes)}, made for {where}"
        except PlanInfeasible as error:
            chosen = Plan.keep_all(graph, budget_bytes)
            note = (f"the {policy} plan cannot be applied on {where} ({error}); predicted and measured there with "
                    "every tensor kept")
        measured = measure(work, plan=chosen if chosen.offloads or chosen.recomputes else None, repeats=repeats)
        return MeasuredStep((setting, policy, budget_bytes, hardware), measured, graph,
                            simulate(graph, chosen, hardware=local), note, local.name,
                            _least_budget(graph, policy, local))


def _least_budget(graph: Graph, policy: str, hardware: Hardware) -> int | None:
    """The policy's smallest budget for ``graph`` on ``hardware``; None when it has none there."""
    try:
        return min_budget(graph, policy, hardware=hardware)
    except (UdnnLabError, ValueError):  # e.g. a policy that does not apply to this device's step
        return None


def _one_process(setting: Setting, action: str) -> None:
    if setting.parallel is not None:
        raise ValueError(f"{action} runs the step in this one process, and the setting is one rank of "
                         f"{setting.parallel} over {setting.world_size}: set ranks to 'one GPU' to {action.lower()} "
                         f"it here (Train runs the ranks, each its own process)")


def _budget(budget_bytes: int | None) -> str:
    return format_bytes(budget_bytes) if budget_bytes is not None else "no budget"
