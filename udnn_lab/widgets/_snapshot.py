"""MemoryLab's snapshot overlay: a memory snapshot of a real run (``torch.cuda.memory._dump_snapshot``, or
``ul.write_cpu_snapshot``) laid over the prediction on screen, redrawn as the step or plan changes.

A path box and a button bring the file in; a file that is not a snapshot (or that asks to run code) is said
in one line under the box, and what was shown before stays.
"""

from __future__ import annotations

import html
from pathlib import Path

import ipywidgets as widgets
import pandas as pd

from udnn_lab import charts
from udnn_lab.frames import SnapshotOverlay, snapshot_overlay
from udnn_lab.graph.step_graph import Graph
from udnn_lab.measurement.snapshot import Snapshot, load_snapshot
from udnn_lab.simulation.simulator import Simulation
from udnn_lab.units import format_bytes
from udnn_lab.widgets._offline_chart import OfflineChart
from udnn_lab.widgets._texts import RED, error_text, wrapping

DIFFERENCES_SHOWN = 8  # rows of the differences table: the largest


class SnapshotPanel:
    """A path box, an "Overlay snapshot" button, the overlay chart and the largest differences."""

    def __init__(self) -> None:
        # the path is sent on Enter or when the box loses focus, and read as it arrives: a button's click can
        # reach the kernel before the path typed just before it (ipywidgets holds back state while it is busy)
        self.path = widgets.Text(placeholder="snapshot.pickle(.gz) from torch.cuda.memory._dump_snapshot",
                                 description="snapshot", continuous_update=False, layout=widgets.Layout(width="420px"))
        self.path.observe(self._path_sent, names="value")
        self.load_button = widgets.Button(description="Overlay snapshot", icon="upload",
                                          tooltip="read a memory snapshot of a real run and lay it over the "
                                                  "prediction on screen")
        self.message = widgets.HTML(layout=widgets.Layout(width="100%", height="auto"))
        self.message.add_class("udnn-snapshot-message")
        self.chart = OfflineChart(None, layout=widgets.Layout(display="none"))
        self.table = widgets.HTML(layout=widgets.Layout(width="100%", height="auto"))
        self.table.add_class("udnn-snapshot-differences")
        self.box = widgets.VBox([widgets.HBox([self.path, self.load_button]), self.message, self.chart, self.table],
                                layout=widgets.Layout(height="auto"))
        self.snapshot: Snapshot | None = None
        self.overlay: SnapshotOverlay | None = None
        self._prediction: tuple[Graph, Simulation | None] | None = None
        self._loading = False

    def load(self, path: str | Path) -> None:
        """Read the snapshot at ``path`` and lay it over the prediction last shown; a bad file is said in one line."""
        self._loading = True
        try:
            self.path.value = str(path)
            self.snapshot = load_snapshot(Path(str(path).strip()).expanduser())
            self.message.value = ""
            self._draw()
        except Exception as error:  # the app shows every error; the kernel never sees one
            self.message.value = wrapping(error_text(error))
        finally:
            self._loading = False

    def _path_sent(self, change: dict) -> None:
        if not self._loading and str(change["new"]).strip():
            self.load(change["new"])

    def follow(self, graph: Graph, simulation: Simulation | None) -> None:
        """The prediction on screen changed: lay the snapshot, once one is read, over this one."""
        self._prediction = (graph, simulation)
        if self.snapshot is not None:
            try:
                self._draw()
            except Exception as error:
                self.message.value = wrapping(error_text(error))

    def _draw(self) -> None:
        if self.snapshot is None or self._prediction is None:
            return
        graph, simulation = self._prediction
        overlay = snapshot_overlay(self.snapshot, graph, simulation)
        self.overlay = overlay
        self.chart.chart = charts.snapshot_overlay(overlay.timeline(), overlay.peak_parts(), width=420, height=220,
                                                   title=f"{Path(overlay.source).name} over the prediction")
        self.chart.layout.display = None
        self.table.value = differences_table(overlay.differences(), overlay)


def differences_table(frame: pd.DataFrame, overlay: SnapshotOverlay) -> str:
    """The peaks in one line, then the sizes whose counts differ most, as HTML."""
    difference = overlay.difference_bytes
    color = RED if difference > 0 else "#2ca02c"
    head = (f"<b>peak</b>: predicted <b>{format_bytes(overlay.predicted_peak_bytes)}</b>, measured "
            f"<b>{format_bytes(overlay.measured_peak_bytes)}</b> (<span style='color:{color}'>"
            f"{'+' if difference >= 0 else '-'}{format_bytes(abs(difference))}</span>; "
            f"{format_bytes(overlay.measured_start_bytes)} held before the history began)")
    shown = frame[frame["difference_bytes"] != 0].head(DIFFERENCES_SHOWN)
    if shown.empty:
        return wrapping(head + ": every size at the peaks has as many blocks as tensors predicted")
    columns = ["size", "predicted", "measured", "difference", "match", "predicted as", "measured at"]
    header = "".join(f"<th style='text-align:left;padding:1px 6px'>{c}</th>" for c in columns)
    rows = "".join(
        "<tr class='udnn-snapshot-difference'>" + "".join(f"<td style='padding:1px 6px;vertical-align:top'>{v}</td>"
                                                          for v in _cells(row)) + "</tr>"
        for row in shown.itertuples())
    return (f"<div style='line-height:1.3;font-size:12px;max-width:100%;overflow-x:auto'><div>{head}; the sizes "
            f"that differ most:</div><table style='border-collapse:collapse'><thead><tr>{header}</tr></thead>"
            f"<tbody>{rows}</tbody></table></div>")


def _cells(row) -> list[str]:
    sign = "+" if row.difference_bytes >= 0 else "-"
    return [format_bytes(int(row.size_bytes)), f"{row.predicted_count} ({format_bytes(int(row.predicted_bytes))})",
            f"{row.measured_count} ({format_bytes(int(row.measured_bytes))})",
            f"{sign}{format_bytes(abs(int(row.difference_bytes)))}", html.escape(row.match),
            html.escape(row.predicted_as), html.escape(row.measured_at)]
