"""MemoryLab: one widget app over the library: pick a step, a policy and a budget; see memory and streams.

A thin shell: the controls are ipywidgets, the work is LabSession's calls into the library
(widgets/_state.py), the picture is charts.linked_memory_and_streams in one alt.JupyterChart whose
chart is replaced in place (never new output widgets): the memory curve over the stream timeline of
the same plan, a range of ops dragged on the curve fading the bars outside it and a span of time
dragged on the timeline marking the ops in it, in the page alone. A click on the memory curve reaches
Python through the chart's selections and lists the tensors live at that op (widgets/_drill.py). A memory
snapshot of a real run, once read, is laid over the prediction on screen (widgets/_snapshot.py).
Changes are debounced; errors are shown in the app, never raised into the kernel.
"""

from __future__ import annotations

import asyncio
import html
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import ipywidgets as widgets
import pandas as pd
from torch import nn

from udnn_lab import charts, frames, zoo
from udnn_lab.graph.step_graph import Graph
from udnn_lab.hardware import PREDICTED_DEVICE, Hardware
from udnn_lab.planning.budget import PlanInfeasible
from udnn_lab.planning.registry import quick_policies
from udnn_lab.planning.reserved import check_count_name
from udnn_lab.simulation.simulator import Simulation, resolve_hardware
from udnn_lab.units import format_bytes, format_seconds
from udnn_lab.vocabulary import PRECISIONS, AttentionImplementation, Precision
from udnn_lab.widgets._budget import BudgetControl
from udnn_lab.widgets._drill import DrillPanel
from udnn_lab.widgets._hf_controls import HFControls
from udnn_lab.widgets._networks import offered
from udnn_lab.widgets._offline_chart import OfflineChart
from udnn_lab.widgets._parallel_controls import ParallelControls
from udnn_lab.widgets._snapshot import SnapshotPanel
from udnn_lab.widgets._state import LabSession, MeasuredStep, Setting
from udnn_lab.widgets._texts import (
    error_text,
    fit_line,
    measured_subtitle,
    minimum_named,
    policy_named,
    predicted_for,
    step_named,
    summary,
    wrapping,
)
from udnn_lab.widgets._training import TrainingPanel
from udnn_lab.workload import precision_of

_GRAPH, _POLICY, _BUDGET = 2, 1, 0  # how much a change invalidates


@dataclass(frozen=True)
class _Drawing:
    """What the chart shows besides measured stream events: a curve and the simulation whose streams go under it."""

    curve: pd.DataFrame  # frames.memory_curve of ``simulation`` (and of a measured step)
    simulation: Simulation  # its ops are the curve's, so that a range of ops selects the bars that ran them
    budget_bytes: int
    min_budget_bytes: int | None
    title: str
    subtitle: list[str]  # what the chart is of: the device and profile of its prediction; why it changed


class _Debounce:
    """Call ``action`` once, ``wait_s`` after the last request (at once when wait_s is 0 or no event loop runs)."""

    def __init__(self, wait_s: float, action: Callable[[], None]) -> None:
        self.wait_s, self.action = wait_s, action
        self.pending: asyncio.TimerHandle | None = None

    def __call__(self) -> None:
        if self.pending is not None:
            self.pending.cancel()
            self.pending = None
        try:
            loop = asyncio.get_running_loop() if self.wait_s > 0 else None
        except RuntimeError:
            loop = None
        if loop is None:
            self.action()
        else:
            self.pending = loop.call_later(self.wait_s, self._fire)

    def _fire(self) -> None:
        self.pending = None
        self.action()


class MemoryLab(widgets.AppLayout):
    """Predicted memory and streams of one training step, under a policy and a budget, updated as you go.

    ``model``: a zoo name (``ul.zoo.names()``; 'hf:gpt2-small' for the zoo's small version of an
    hf: model) or your own ``nn.Module`` (then give ``input_shape``, one example's shape).
    ``precision``: PyTorch Lightning's names, '32-true' by default (your module's own dtype for
    your module). ``seq_len``, ``lora_rank`` (0: a full fine-tune) and ``attn_implementation``
    apply to hf: networks. ``parallel`` ('DDP', 'FSDP2', 'HSDP'; None: one GPU) and ``world_size``: the
    charts are of one rank of that many; ``offload_params``: FSDP2 keeps the rank's parameters, gradients and
    optimizer state in host memory (its ``CPUOffloadPolicy``; the summary says how much). ``hardware``: a
    profile name or a Hardware (e.g. from ``ul.Hardware.measure()``); None: the profile for this machine's GPU
    (``resolve_hardware(None, "cuda")``: measured here when it has one, else the closest shipped one, with a
    warning); the summary names the profile used. ``counts``: what the budget counts, 'allocated' bytes (live
    tensors) or, on a CUDA profile, 'reserved' bytes (the caching allocator model's, the number an out-of-memory
    error is about; ``ul.plan``'s ``counts``). The step is traced with fake tensors for the profile's
    device; "Measure" runs it for real on this machine, under the same policy and budget planned again for the
    device it runs on, and charts it beside that device's prediction (the chart's subtitle says so).
    """

    def __init__(self, model: str | nn.Module = "resnet50", *, input_shape: tuple[int, ...] | None = None,
                 batch: int = 32, precision: Precision | None = None, optimizer: str = "sgd",
                 hardware: str | Hardware | None = None, policy: str = "auto", image_size: int | None = None,
                 seq_len: int = 512, lora_rank: int = 0, attn_implementation: AttentionImplementation = "sdpa",
                 parallel: str | None = None, world_size: int = 8, offload_params: bool = False,
                 counts: str = "allocated", debounce_s: float = 0.3,
                 points: int = frames.DEFAULT_POINTS) -> None:
        if hardware is None:
            hardware = resolve_hardware(None, PREDICTED_DEVICE)
        extra = {hardware.name: hardware} if isinstance(hardware, Hardware) else {}
        custom = model if isinstance(model, nn.Module) else None
        if precision is None:
            precision = precision_of(custom) if custom is not None else "32-true"
        self.session = LabSession(custom, input_shape, image_size, extra)
        self.hf = HFControls(seq_len, lora_rank, attn_implementation, "290px")
        self.seq_len, self.lora_rank, self.attention = self.hf.controls
        self.ranks_controls = ParallelControls(parallel, world_size, "290px", offload_params)
        self.ranks, self.world_size, self.offload_params = self.ranks_controls.controls
        self.points = points
        self._dirty = -1
        self._measured: MeasuredStep | None = None
        self._network: str | None = None  # the network the charts and the training view are of
        self._events: pd.DataFrame | None = None
        self._minimum: int | None = None  # the policy's smallest budget, once known
        self._drawing: _Drawing | None = None
        self._debounce = _Debounce(debounce_s, self._update)
        self._build_controls(self.session.custom_name or str(model), batch, precision, optimizer,
                             hardware.name if isinstance(hardware, Hardware) else hardware, policy, counts)
        self.memory_and_streams = OfflineChart(None, layout=widgets.Layout(min_height="520px"))
        self.drill = DrillPanel()  # the tensors live at the op clicked on the memory curve
        self.memory_and_streams.observe(self.drill.on_selections, names="_vl_selections")  # what a click sets
        self.snapshot = SnapshotPanel()  # a real run's memory snapshot over the prediction
        self.snapshot.load_button.on_click(lambda _: self.overlay_snapshot(self.snapshot.path.value))
        grows = widgets.Layout(height="auto", width="100%", margin="0")  # long messages wrap; the footer grows
        self.summary = widgets.HTML(layout=grows)
        self.status = widgets.HTML(layout=grows)
        super().__init__(
            header=widgets.HTML("<b>udnn_lab · MemoryLab</b>: predicted memory of one training step"),
            left_sidebar=widgets.VBox([self.network, self.batch, self.precision, self.optimizer, *self.hf.controls,
                                       *self.ranks_controls.controls, self.hardware, self.device_note, self.policy,
                                       self.budget_entry, self.budget, self.fit_status, self.counts,
                                       self.minimum_text, self.actions]),
            # min_width 0: the grid's column, not the widest table row, sets how wide the centre is
            center=widgets.VBox([self.memory_and_streams, self.drill.box, self.snapshot.box, self.training.chart],
                                layout=widgets.Layout(min_width="0")),
            footer=widgets.VBox([self.summary, self.status], layout=widgets.Layout(height="auto")),
            pane_widths=["300px", 1, 0], pane_heights=["30px", 1, "80px"], height="auto")
        self.layout.grid_template_rows = "30px 1fr auto"  # pane_heights takes no 'auto': the footer fits its text
        self._request(_GRAPH, now=True)

    # -- controls ----------------------------------------------------------------------------
    def _build_controls(self, network: str, batch: int, precision: Precision, optimizer: str, hardware: str,
                        policy: str, counts: str) -> None:
        wide = widgets.Layout(width="290px")
        self.network = widgets.Combobox(value=network, options=offered(self.session.custom_name),
                                        description="network", ensure_option=False, continuous_update=False,
                                        layout=wide)
        self.batch = widgets.BoundedIntText(value=batch, min=1, max=1 << 20, description="batch", layout=wide)
        if precision not in PRECISIONS:
            raise ValueError(f"unknown precision {precision!r}: use one of {', '.join(PRECISIONS)}")
        self.precision = widgets.Dropdown(options=list(PRECISIONS), value=precision, description="precision",
                                          layout=wide, tooltip="-mixed: float32 weights, autocast; -true: weights, "
                                                               "gradients and optimizer state in that dtype")
        self.optimizer = widgets.Dropdown(options=list(zoo.OPTIMIZERS), value=optimizer, description="optimizer",
                                          layout=wide)
        self.hardware = widgets.Dropdown(options=self.session.hardware_names(), value=hardware,
                                         description="hardware", layout=wide)
        policies = list(quick_policies()) + ([policy] if policy not in quick_policies() else [])  # a solver if asked
        self.policy = widgets.Dropdown(options=policies, value=policy, description="policy", layout=wide)
        self.device_note = widgets.HTML(layout=widgets.Layout(width="290px", height="auto"))
        self.budget_control = BudgetControl(lambda: self._request(_BUDGET), self._show_budget_error, "290px")
        self.budget, self.budget_entry = self.budget_control.slider, self.budget_control.entry
        check_count_name(counts)
        self.counts = widgets.Dropdown(options=[("allocated bytes", "allocated"), ("reserved bytes", "reserved")],
                                       value=counts, description="counts", layout=wide,
                                       tooltip="what the budget counts: live tensors (allocated), or what the CUDA "
                                               "caching allocator reserves, the number an out-of-memory error is about")
        # whether the plan fits the budget, right under the budget's box and slider
        self.fit_status = widgets.HTML(layout=widgets.Layout(width="290px", height="auto"))
        self.fit_status.add_class("udnn-fit-status")
        self.minimum_text = widgets.HTML(layout=widgets.Layout(width="290px", height="auto"))
        self.measure_button = widgets.Button(description="Measure", icon="play",
                                             tooltip="run one real training step on this machine and overlay it")
        self.training = TrainingPanel(self._show_status)
        self.training.train_button.on_click(lambda _: self.train())
        self.actions = widgets.VBox([widgets.HBox([self.measure_button, self.training.train_button,
                                                   self.training.stop_button]),
                                     self.training.steps, self.training.progress])
        self.hf.follow(network)
        self.network.observe(lambda change: self.hf.follow(str(change.new).strip()), names="value")
        for control in (self.network, self.batch, self.precision, self.optimizer, *self.hf.controls,
                        *self.ranks_controls.controls, self.hardware):
            control.observe(lambda _: self._request(_GRAPH), names="value")
        self.policy.observe(lambda _: self._request(_POLICY), names="value")
        self.counts.observe(lambda _: self._request(_BUDGET), names="value")
        self.measure_button.on_click(lambda _: self.measure())

    def _request(self, level: int, now: bool = False) -> None:
        self._dirty = max(self._dirty, level)
        self._update() if now else self._debounce()

    @property
    def setting(self) -> Setting:
        device = self.session.hardware(self.hardware.value).device_type
        network = str(self.network.value).strip()
        parallel, world_size, offload_params = self.ranks_controls.setup()
        return Setting(network, int(self.batch.value), self.precision.value, self.optimizer.value, device,
                       **self.hf.options(network), parallel=parallel, world_size=world_size,
                       offload_params=offload_params)

    @property
    def budget_bytes(self) -> int:
        return self.budget_control.nbytes

    # -- updates -----------------------------------------------------------------------------
    def _update(self) -> None:
        level, self._dirty = self._dirty, -1
        try:
            if level >= _GRAPH:
                self._show_status("tracing the step …")
                self._load_graph()
            if level >= _POLICY:
                self._show_status(f"finding the smallest budget {self.policy.value} meets …")
                self._load_minimum()
            self._show_status("")
            self._show_plan()
        except Exception as error:  # the app shows every error; the kernel never sees one
            self._dirty = max(self._dirty, level if level >= _POLICY else -1)  # retried on the next change
            self._show_status(error)

    def _load_graph(self) -> None:
        setting = self.setting
        graph = self.session.graph(setting)
        peak = graph.counted_peak_bytes
        hardware = self.session.hardware(self.hardware.value)
        another = setting.network != self._network
        self.budget_control.rescale(peak, hardware.memory_bytes, reset=another)  # keeps the user's budget
        if another and self._network is not None:
            self.training.clear("the network changed")
        self._network = setting.network
        here = self.session.local_device(setting)
        self.device_note.value = "" if here == setting.device else (
            f"<div style='line-height:1.3;color:#8a6d00'>{html.escape(hardware.name)} is a {setting.device.upper()} "
            f"profile and this machine has no {setting.device.upper()} device: the prediction is for a device "
            f"it does not have; Measure and Train run on its {here.upper()}.</div>")

    def _load_minimum(self) -> None:
        self._minimum = self.session.min_budget(self.setting, self.policy.value, self.hardware.value)

    def _show_plan(self) -> None:
        setting, budget, hardware, policy = self.setting, self.budget_bytes, self.hardware.value, self.policy.value
        feasible = self._minimum is None or budget >= self._minimum
        self.budget.style.handle_color = "#2ca02c" if feasible else "#d62728"
        infeasible = False
        counts = self.counts.value
        try:
            self.plan, sim = self.session.planned(setting, policy, budget, hardware, counts)
            reserved = self.session.reserved_peak(setting, self.plan, sim) if counts == "reserved" else None
            counted = self.session.counted_peak(setting, self.plan, sim) if counts == "allocated" else None
            self.fit_status.value = fit_line(sim, reserved_bytes=reserved, budget_bytes=budget, counted_bytes=counted)
        except PlanInfeasible as error:
            self.plan, sim = self.session.baseline(setting, budget, hardware)
            self.fit_status.value = fit_line(sim, error)
            infeasible = True
        self.simulation = sim
        graph, profile = self.session.graph(setting), self.session.hardware(hardware)
        measured = self._measured
        if measured is not None and measured.asked != (setting, policy, budget, hardware):
            measured = self._measured = None  # measured for another step, plan or budget
        title = f"{step_named(graph, setting)}: {policy_named(policy, self.plan, infeasible, budget)}"
        self._drawing = self._predicted(graph, sim, title, profile) if measured is None else \
            self._measured_drawing(measured, graph, setting, profile)
        self._draw()
        self.snapshot.follow(graph, sim)
        self.minimum_text.value = minimum_named(policy, self._minimum, profile, measured)
        self.summary.value = summary(sim, profile, graph.host_peak_bytes if setting.offload_params else 0)

    def _predicted(self, graph: Graph, sim: Simulation, title: str, profile: Hardware) -> _Drawing:
        """The prediction on the profile's device, under the plan on screen."""
        self.drill.show(graph, sim, _peak_op(sim), self.plan)
        return _Drawing(frames.memory_curve(graph, sim, points=self.points), sim, self.budget_bytes, self._minimum,
                        title, [predicted_for(graph, profile)])

    def _measured_drawing(self, measured: MeasuredStep, graph: Graph, setting: Setting,
                          profile: Hardware) -> _Drawing:
        """Like with like: the measured step's own device, plan, ops and streams, and the policy's minimum there."""
        curve = frames.memory_curve(measured.graph, measured.prediction, measured.measurement, measured.prediction,
                                    points=self.points)
        title = f"{step_named(graph, setting)}, on this machine's {measured.graph.device}: {measured.prediction.policy}"
        self.drill.show(measured.graph, measured.prediction, _peak_op(measured.prediction))
        return _Drawing(curve, measured.prediction, self.budget_bytes, measured.min_budget_bytes, title,
                        measured_subtitle(measured, graph, profile))

    def _draw(self) -> None:
        drawing = self._drawing
        if drawing is None:
            return
        parts = [frames.timeline(drawing.simulation)]
        if self._events is not None:
            parts.append(frames.timeline(self._events, source="measured"))
        self.memory_and_streams.chart = charts.linked_memory_and_streams(
            drawing.curve, pd.concat(parts, ignore_index=True), drawing.budget_bytes, drawing.min_budget_bytes,
            width=560, height=260, title=drawing.title, legends="bottom", picked_op=self.drill.op.value,
            subtitle=drawing.subtitle)

    def _show_status(self, message: str | Exception) -> None:
        if isinstance(message, Exception):
            text = error_text(message)
        else:
            text = f"<i>{html.escape(message)}</i>" if message else ""
        self.status.value = wrapping(text) if text else ""

    def _show_budget_error(self, error: Exception) -> None:
        """A budget the box cannot read: said under the box, where it was typed."""
        self.fit_status.value = wrapping(error_text(error))

    # -- actions -----------------------------------------------------------------------------
    def measure(self, repeats: int = 1) -> None:
        """Run one real step of the current setting on this machine and overlay it on the prediction."""
        try:
            self._show_status("measuring a real step on this machine …")
            self._measured = self.session.measure(self.setting, self.policy.value, self.budget_bytes,
                                                  self.hardware.value, repeats=repeats)
            self._show_status("")
            self._show_plan()
            measured, predicted = self._measured.measurement, self._measured.prediction
            self._show_status(f"measured on {measured.device_name} under {self._measured.note}: peak "
                              f"{format_bytes(measured.peak_bytes)} (predicted {format_bytes(predicted.peak_bytes)}),"
                              f" step {format_seconds(measured.step_time_s or 0.0)}")
        except Exception as error:
            self._show_status(error)

    def overlay_snapshot(self, path: str | Path) -> None:
        """Lay a memory snapshot of a real run of this step (``torch.cuda.memory._dump_snapshot``'s file, or
        ``ul.write_cpu_snapshot``'s) over the prediction on screen, and keep it there as the setting changes; a
        file that is not one is said in one line under the snapshot box."""
        self.snapshot.load(path)

    def show_timeline(self, events: pd.DataFrame | None) -> None:
        """Overlay measured stream events (frames.timeline's input: stream, kind, start_s, end_s, ...) on the
        Gantt chart, beside the simulated lanes; None removes them."""
        try:
            if events is not None:
                frames.timeline(events, source="measured")  # check it before keeping it
            self._events = events
            self._draw()
        except Exception as error:
            self._show_status(error)

    def train(self, steps: int | None = None, wait: bool = False) -> None:
        """Train the current setting on this machine under the current policy and budget, in the background.

        The model trained is kept in ``self.session.trainable(self.setting)`` (your own module
        itself, when you passed one); Stop (or ``self.training.stop()``) ends the run after the
        step in flight and leaves it usable. ``wait=True`` returns when the run ends.
        """
        try:
            work = self.session.trainable(self.setting)
            self._show_status("planning for this machine and starting …")
            thread = self.training.start(work, self.policy.value, self.budget_bytes, steps or self.training.steps.value,
                                         self.session.hardware(self.hardware.value), counts=self.counts.value)
            if wait:
                thread.join()
        except Exception as error:
            self._show_status(error)


def _peak_op(sim: Simulation) -> int:
    counted = sim.curve["cuda_live_bytes" if sim.device == "cuda" else "live_bytes"]
    return int(counted.to_numpy().argmax()) if len(counted) else 0
