"""MemoryLab's training panel: Train runs ul.train in a thread (the kernel stays free), Stop asks it to stop.

A thin shell like the rest of the app: the work is ``ul.train`` under the plan the app shows
(made again for this machine's step, since the plan on screen may be for another device);
each finished step updates the progress bar and the live memory chart.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import altair as alt
import ipywidgets as widgets
import torch

from udnn_lab import charts, frames
from udnn_lab.analysis.tracing import trace
from udnn_lab.devices import model_device
from udnn_lab.planning.budget import plan
from udnn_lab.runtime.training import Run, train
from udnn_lab.simulation.simulator import resolve_hardware, simulate
from udnn_lab.units import format_bytes, format_seconds


class TrainingPanel:
    """Steps, Train, Stop, a progress bar and a live chart; one run at a time."""

    def __init__(self, report: Callable[[str | Exception], None]) -> None:
        self.report = report
        self.steps = widgets.BoundedIntText(value=20, min=1, max=100_000, description="steps",
                                            layout=widgets.Layout(width="150px"))
        self.train_button = widgets.Button(description="Train", icon="forward",
                                           tooltip="train here, under the plan shown, without blocking the kernel")
        self.stop_button = widgets.Button(description="Stop", icon="stop", disabled=True,
                                          tooltip="stop after the step that is running")
        self.progress = widgets.IntProgress(value=0, min=0, max=1, description="", layout=widgets.Layout(width="290px"))
        self.chart = alt.JupyterChart(None,  # type: ignore[arg-type]  # altair's hint omits None
                                      layout=widgets.Layout(min_height="120px"))
        self.stop_button.on_click(lambda _: self.stop())
        self.run: Run | None = None
        self.rows: list[dict] = []
        self.thread: threading.Thread | None = None
        self._stop = threading.Event()

    @property
    def running(self) -> bool:
        return self.thread is not None and self.thread.is_alive()

    def start(self, work, policy: str, budget_bytes: int | None, steps: int, fallback_hardware) -> threading.Thread:
        """Plan ``work``'s step on this machine and train it ``steps`` steps in a background thread."""
        if self.running:
            raise RuntimeError("a training run is already going: press Stop first")
        device = model_device(work.model)
        graph = trace(work)
        hardware = _local_hardware(device, fallback_hardware)
        chosen = plan(graph, budget_bytes, policy, hardware=hardware)
        predicted = simulate(graph, chosen, hardware=hardware).peak_bytes
        self.rows, self.run = [], None
        self._stop.clear()
        self.progress.max, self.progress.value = steps, 0
        self.train_button.disabled, self.stop_button.disabled = True, False
        batches = ((work.example_input, work.target) for _ in range(steps))
        self.thread = threading.Thread(target=self._train, daemon=True, name="udnn_lab MemoryLab training",
                                       args=(work, batches, chosen, steps, budget_bytes, predicted))
        self.thread.start()
        return self.thread

    def stop(self) -> None:
        self._stop.set()

    def _train(self, work, batches, chosen, steps: int, budget_bytes, predicted: int) -> None:
        def step_done(row: dict) -> None:
            self.rows.append(row)
            self.progress.value = len(self.rows)
            self.chart.chart = charts.training(frames.training(self.rows), budget_bytes, predicted)
            self.report(f"step {row['step'] + 1}/{steps}: loss {row['loss']:.4g}, peak "
                        f"{format_bytes(row['peak_bytes'])}, {format_seconds(row['time_s'])}")
        try:
            self.run = train(work.model, batches, work.optimizer, loss_fn=work.loss_fn, plan=chosen, steps=steps,
                             callbacks=[step_done], stop=self._stop, progress=False, name=work.name)
            self.report(f"trained {len(self.run.steps)} steps under {chosen.policy} (stopped: {self.run.stopped})")
        except Exception as error:  # shown in the app; the model stays as the last finished step left it
            self.report(error)
        finally:
            self.train_button.disabled, self.stop_button.disabled = False, True


def _local_hardware(device: torch.device, fallback):
    try:
        return resolve_hardware(None, device.type)
    except ValueError:
        return fallback
