"""MemoryLab's drill-down: the tensors live at one op of the step, under the plan on screen.

The op comes from a click on the memory curve (the chart's OP_SELECTION, read from the
JupyterChart's selections) or from the "inspect op" box; until one is picked, the peak's op.
"""

from __future__ import annotations

import html
import re

import ipywidgets as widgets
import pandas as pd
from altair.utils.selection import PointSelection

from udnn_lab.charts import OP_SELECTION
from udnn_lab.frames import live_tensors, plan_reasons
from udnn_lab.graph.plan_ir import Plan
from udnn_lab.graph.step_graph import Graph
from udnn_lab.simulation.simulator import Simulation
from udnn_lab.units import format_bytes, format_seconds

ROWS_SHOWN = 20  # the largest; the header counts them all


class DrillPanel:
    """An "inspect op" box and the table of the tensors live at that op."""

    def __init__(self) -> None:
        self.op = widgets.BoundedIntText(value=0, min=0, max=0, description="inspect op",
                                         tooltip="an op of the step; or click the memory curve",
                                         layout=widgets.Layout(width="200px"))
        self.table = widgets.HTML(layout=widgets.Layout(width="100%", height="auto"))
        self.box = widgets.VBox([self.op, self.table], layout=widgets.Layout(height="auto"))
        self.picked = False  # the user chose the op: keep it across replans; else follow the peak
        self.graph: Graph | None = None
        self.simulation: Simulation | None = None
        self.reasons: dict[int, str] = {}  # saved tensor id -> why the plan on screen does what it does with it
        self.frame: pd.DataFrame | None = None
        self._quiet = False
        self.op.observe(self._on_op, names="value")

    def show(self, graph: Graph, simulation: Simulation, peak_op: int, plan: Plan | None = None) -> None:
        """The step and plan on screen changed: the same op if the user picked one (and the step has it), else
        the peak. With the ``plan`` simulated, each saved tensor's row says why the plan does what it does."""
        self.graph, self.simulation = graph, simulation
        self.reasons = {}
        if plan is not None and (plan.offloads or plan.recomputes):
            why = plan_reasons(graph, plan, simulation)
            self.reasons = dict(zip(why["id"], why["reason"]))
        last = len(graph.ops) - 1
        op = self.op.value if self.picked and self.op.value <= last else peak_op
        self.picked = self.picked and self.op.value <= last
        self._quiet = True
        try:
            self.op.max = max(last, 0)
            self.op.value = op
        finally:
            self._quiet = False
        self._draw()

    def on_selections(self, change: dict) -> None:
        """The memory chart's selections changed (a click in the browser): inspect the op picked, if any."""
        state = change["new"].get(OP_SELECTION)
        if not state:
            return
        points = PointSelection.from_vega(OP_SELECTION, state.get("value"), state.get("store", [])).value
        if points and "index" in points[0]:
            self.pick(int(points[0]["index"]))

    def pick(self, op: int) -> None:
        """Inspect op ``op`` (as a click on it does)."""
        if op != self.op.value:
            self.op.value = op  # the box's observer draws the table

    def _on_op(self, change: dict) -> None:
        if not self._quiet:
            self.picked = True
            self._draw()

    def _draw(self) -> None:
        if self.graph is None or self.simulation is None:
            return
        self.frame = live_tensors(self.graph, self.op.value, self.simulation)
        self.table.value = _table(self.frame, self.reasons)


def _table(frame: pd.DataFrame, reasons: dict[int, str]) -> str:
    on = frame[frame["on_device"]]
    off = frame[~frame["on_device"]]
    attrs = frame.attrs
    where = " · ".join(html.escape(str(s)) for s in (attrs["op"], attrs["module"] or "(model)", attrs["phase"]))
    head = (f"<b>live at op {attrs['op_index']}</b> ({where}), {html.escape(attrs['policy'])}: "
            f"<b>{len(on)}</b> tensors on the device, <b>{format_bytes(int(on['nbytes'].sum()))}</b>")
    if len(off):
        head += f"; {len(off)} off it ({format_bytes(int(off['nbytes'].sum()))})"
    shown = frame.head(ROWS_SHOWN)
    cells = "".join(_row(row, reasons) for row in shown.itertuples())
    more = f"<div><i>… and {len(frame) - len(shown)} smaller</i></div>" if len(frame) > len(shown) else ""
    columns = ["tensor", "size", "category", "state", "produced by", "module", "live ops", "lives"] + \
        (["why (the plan)"] if reasons else [])
    header = "".join(f"<th style='text-align:left;padding:1px 6px'>{c}</th>" for c in columns)
    scrolls = "line-height:1.3;font-size:12px;max-width:100%;overflow-x:auto"  # a wide table scrolls, never cut
    return (f"<div class='udnn-live-tensors' style='{scrolls}'><div>{head}</div>"
            f"<table style='border-collapse:collapse'><thead><tr>{header}</tr></thead><tbody>{cells}</tbody></table>"
            f"{more}</div>")


WRAPPING = (4, 5)  # produced by and module: long names wrap at their dots and underscores, never cut


def _cell(value: str, wraps: bool) -> str:
    """One cell; a long name wraps after its dots and underscores, and its whole text is the cell's tooltip."""
    if not wraps:
        return f"<td style='padding:1px 6px;white-space:nowrap'>{value}</td>"
    breakable = re.sub(r"([._])", r"\1<wbr>", value)
    return (f"<td class='udnn-wraps' title='{value}' style='padding:1px 6px;white-space:normal;"
            f"overflow-wrap:break-word;max-width:22em'>{breakable}</td>")


def _row(row, reasons: dict[int, str]) -> str:
    producer = html.escape(row.producer_op) if row.producer < 0 else f"#{row.producer} {html.escape(row.producer_op)}"
    free = "end" if pd.isna(row.free_op) else str(row.free_op)
    first = "start" if row.alloc_op < 0 else str(row.alloc_op)
    lives = f"{row.lifetime_ops} ops" + ("" if pd.isna(row.lifetime_s) else f", {format_seconds(row.lifetime_s)}")
    values = [html.escape(row.tensor), format_bytes(int(row.nbytes)), html.escape(row.category), row.state, producer,
              html.escape(row.module or "(model)"), f"{first} → {free}", lives]
    cells = "".join(_cell(v, wraps=i in WRAPPING) for i, v in enumerate(values))
    if reasons:
        why = html.escape(reasons.get(row.id, ""))
        cells += f"<td class='udnn-why' style='padding:1px 6px;white-space:normal;min-width:16em'>{why}</td>"
    return f"<tr class='udnn-live-tensor'>{cells}</tr>"
