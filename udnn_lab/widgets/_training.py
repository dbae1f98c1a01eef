"""MemoryLab's training panel: Train runs ul.train in a thread (the kernel stays free), Stop asks it to stop.

A thin shell like the rest of the app: the work is ``ul.train`` under the plan the app shows
(made again for this machine's step, since the plan on screen may be for another device);
each finished step updates the progress bar and the live chart (memory, loss, time).

Stop asks the loop to end after the step in flight. The loop checks between steps, so a
step that has begun always finishes; what the panel shows says which step that is (the
step just finished and the one running), so Stop ends the run after the step it names.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import replace

import ipywidgets as widgets
import torch

from udnn_lab import charts, frames
from udnn_lab.analysis.tracing import trace
from udnn_lab.devices import model_device
from udnn_lab.parallel import Parallel
from udnn_lab.planning.budget import plan
from udnn_lab.runtime.training import Run, train
from udnn_lab.runtime.training_ranks import check_offload
from udnn_lab.simulation.simulator import resolve_hardware, simulate
from udnn_lab.units import format_bytes, format_seconds
from udnn_lab.widgets._offline_chart import OfflineChart


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
        self.chart = OfflineChart(None, layout=widgets.Layout(min_height="120px"))
        self.stop_button.on_click(lambda _: self.stop())
        self.run: Run | None = None
        self.rows: list[dict] = []
        self.thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._view = 0  # bumped when the view is cleared: a run's late steps no longer draw into it

    @property
    def running(self) -> bool:
        return self.thread is not None and self.thread.is_alive()

    def start(self, work, policy: str, budget_bytes: int | None, steps: int, fallback_hardware,
              parallel: Parallel | None = None, counts: str = "allocated") -> threading.Thread:
        """Plan ``work``'s step on this machine and train it ``steps`` steps in a background thread.

        ``counts``: what the budget counts (``ul.plan``'s): 'reserved' plans a CUDA step for the caching allocator's
        bytes, the number its out-of-memory error is about; a step on a CPU has no such allocator and counts
        allocated bytes, and the status says so.

        ``parallel`` (by default ``work.parallel``): train ``parallel.world_size`` ranks (processes) on this machine
        instead, each on ``work``'s batch (the run's batch is that many times larger), each rank under the plan of
        its own step."""
        if self.running:
            raise RuntimeError("a training run is already going: press Stop first")
        parallel = parallel if parallel is not None else work.parallel
        device = model_device(work.model)
        hardware = _local_hardware(device, fallback_hardware)
        if parallel is not None and hardware.gpus_per_node is None:
            hardware = fallback_hardware  # no collective figures for this machine: time the plan on the profile's
        if parallel is None:
            graphs = [trace(work)]
        else:
            _check_ranks_here(parallel, device)
            graphs = [trace(work, parallel=replace(parallel, rank=rank)) for rank in range(parallel.world_size)]
        counted = counts if graphs[0].device == "cuda" else "allocated"
        plans = [plan(graph, budget_bytes, policy, hardware=hardware, counts=counted) for graph in graphs]
        chosen = plans[0] if parallel is None else plans
        predicted = max(simulate(g, p, hardware=hardware).peak_bytes for g, p in zip(graphs, plans, strict=True))
        self.rows, self.run = [], None
        self._stop.clear()
        self.progress.max, self.progress.value, self.progress.description = steps, 0, f"0/{steps}"
        self.train_button.disabled, self.stop_button.disabled = True, False
        copies = 1 if parallel is None else parallel.world_size  # every rank takes its share of the batch
        batch = (_repeated(work.example_input, copies), _repeated(work.target, copies))
        batches = (batch for _ in range(steps))
        # said when the run ends too: the step reports replace this line
        said = "" if counted == counts else (f"; the budget counted allocated bytes: the step runs on "
                                             f"{graphs[0].device}, where no caching allocator reserves more")
        self.report(f"step 1/{steps} running{said}")
        self.thread = threading.Thread(target=self._train, daemon=True, name="udnn_lab MemoryLab training",
                                       args=(work, batches, chosen, steps, budget_bytes, predicted, self._view,
                                             parallel, said))
        self.thread.start()
        return self.thread

    def stop(self) -> None:
        """End the run after the step in flight."""
        if self.running and not self._stop.is_set():
            self.report(f"stopping after step {len(self.rows) + 1}, the one running")
        self._stop.set()
        self.stop_button.disabled = True

    def clear(self, reason: str = "") -> None:
        """Empty the chart and the progress bar; a run still going is stopped (``reason`` says why)."""
        if self.running:
            self._stop.set()
            self.report(f"{reason}: training stopped" if reason else "training stopped")
        self._view += 1
        self.rows = []
        self.progress.value, self.progress.description = 0, ""  # before the chart: a browser sees it go first
        self.chart.chart = None

    def _train(self, work, batches, chosen, steps: int, budget_bytes, predicted: int, view: int,
               parallel: Parallel | None, said: str = "") -> None:
        def step_done(row: dict) -> bool:
            if view != self._view:
                return False  # the view was cleared: this run is over
            self.rows.append(row)
            done = len(self.rows)
            self.progress.value, self.progress.description = done, f"{done}/{steps}"
            self.chart.chart = charts.training(frames.training(self.rows), budget_bytes, predicted)
            after = "; stopping" if self._stop.is_set() else f"; step {done + 1} running" if done < steps else ""
            self.report(f"step {done}/{steps} done: loss {row['loss']:.4g}, peak "
                        f"{format_bytes(row['peak_bytes'])}, {format_seconds(row['time_s'])}{after}")
            return True
        try:
            run = train(work.model, batches, work.optimizer, loss_fn=work.loss_fn, plan=chosen, steps=steps,
                        callbacks=[step_done], stop=self._stop, progress=False, name=work.name, parallel=parallel)
            if view == self._view:
                self.run = run
                ended = f"stopped after step {len(run.steps)} as asked" if run.stopped == "stop requested" \
                    else f"stopped: {run.stopped}"
                ranks = f" on {parallel.world_size} ranks" if parallel is not None else ""
                self.report(f"trained {len(run.steps)} steps{ranks} under {policy_of(chosen)} ({ended}){said}")
        except Exception as error:  # shown in the app; the model stays as the last finished step left it
            self.report(error)
        finally:
            self.train_button.disabled, self.stop_button.disabled = False, True


MAX_CPU_RANKS = 8  # rank processes a CPU run starts at most: each imports torch and holds a copy of the model


def policy_of(chosen) -> str:
    return chosen.policy if not isinstance(chosen, list) else chosen[0].policy


def _check_ranks_here(parallel: Parallel, device: torch.device) -> None:
    check_offload(parallel, device)
    if device.type == "cpu" and parallel.world_size > MAX_CPU_RANKS:
        raise ValueError(f"Train starts {parallel.world_size} rank processes on this machine's CPU, more than "
                         f"{MAX_CPU_RANKS}: lower the world size to train here (the prediction stays of the world "
                         f"size you set)")


def _repeated(value, copies: int):
    """A batch ``copies`` times along its first dimension: each rank gets one copy."""
    if copies == 1 or not isinstance(value, torch.Tensor):
        return value
    return torch.cat([value] * copies)


def _local_hardware(device: torch.device, fallback):
    try:
        return resolve_hardware(None, device.type)
    except ValueError:
        return fallback
