"""What every chart shares: offline rendering, saving, display units, colours."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import altair as alt
import pandas as pd

from udnn_lab.units import format_bytes
from udnn_lab.vocabulary import CATEGORIES

SAVE_FORMATS: tuple[Literal["html", "png", "svg", "pdf", "json"], ...] = ("html", "png", "svg", "pdf", "json")
CATEGORY_COLORS = {
    "parameter": "#4c78a8", "buffer": "#9ecae9", "input": "#bab0ac", "feature_map": "#f58518",
    "weight_cast": "#b279a2", "gradient_map": "#e45756", "parameter_gradient": "#72b7b2", "optimizer_state": "#54a24b",
    "communication": "#ff9da6", "temporary": "#eeca3b",
}
PHASE_COLORS = {"forward": "#dbe9f6", "backward": "#fde2cf", "optimizer": "#e2f0d9"}
_CDN_SCRIPT = re.compile(r"<script[^>]+src=[\"']?(https?:)?//", re.IGNORECASE)


def enable_offline() -> None:
    """Render charts in notebooks as JupyterChart widgets from JavaScript bundled with the package (no CDN,
    no network); JupyterChart widgets made directly are offline too.

    Same as ``alt.renderers.enable("jupyter", offline=True)``, except that the chart is rebuilt
    from its spec without re-validating every data row against the Vega-Lite schema (altair's
    renderer spends seconds on that for a few thousand rows).
    """
    alt.JupyterChart.enable_offline(True)
    if "udnn_lab" not in alt.renderers.names():
        alt.renderers.register("udnn_lab", _render_widget)
    alt.renderers.enable("udnn_lab", offline=True)


_TOP_LEVEL = (("layer", "LayerChart"), ("vconcat", "VConcatChart"), ("hconcat", "HConcatChart"),
              ("concat", "ConcatChart"), ("facet", "FacetChart"), ("repeat", "RepeatChart"))


def _render_widget(spec: dict, **metadata) -> tuple[dict, dict]:
    """The jupyter renderer, offline. A chart without params is handed to the widget as the spec it already
    is; one with params (selections, bindings) is rebuilt as the chart class its spec names, unvalidated."""
    alt.JupyterChart.enable_offline(metadata.get("offline", True))
    embed = metadata.get("embed_options")
    if '"params"' in json.dumps({k: v for k, v in spec.items() if k != "datasets"}):
        kind = next((getattr(alt, name) for key, name in _TOP_LEVEL if key in spec), alt.Chart)
        widget = alt.JupyterChart(chart=kind.from_dict(spec, validate=False), embed_options=embed)
    else:
        widget = alt.JupyterChart(None, embed_options=embed)  # type: ignore[arg-type]  # altair's hint omits None
        widget.spec = spec
    bundle = widget._repr_mimebundle_()
    assert bundle is not None  # None only for a widget without a view, which an anywidget never is
    return bundle


def save(chart: alt.TopLevelMixin, path: str | os.PathLike, scale: float = 2.0) -> Path:
    """Save ``chart`` to a standalone file: .html (JavaScript embedded, no CDN), .png, .svg, .pdf or .json.

    PNG, SVG and PDF are drawn by vl-convert, without a browser or a network.
    """
    path = Path(path)
    kind = path.suffix.lower().lstrip(".")
    if kind not in SAVE_FORMATS:
        raise ValueError(f"cannot save a chart as {path.name!r}: use a file ending in "
                         f"{', '.join('.' + f for f in SAVE_FORMATS)}")
    path.parent.mkdir(parents=True, exist_ok=True)
    if kind == "html":
        chart.save(path, format="html", inline=True)
        if _CDN_SCRIPT.search(path.read_text(encoding="utf-8")):
            raise RuntimeError(f"{path} loads a script from the network; update vl-convert-python so that "
                               "altair can inline the Vega JavaScript")
    elif kind in ("png", "pdf"):
        chart.save(path, format=kind, scale_factor=scale)
    else:
        chart.save(path, format=kind)
    return path


def byte_unit(largest: float) -> tuple[str, int]:
    """The display unit for sizes up to ``largest`` bytes, the one ``units.format_bytes`` writes ``largest`` in:
    ('GiB', 2**30), ('MiB', 2**20) or ('KiB', 2**10)."""
    if largest >= 2**30:
        return "GiB", 2**30
    if largest >= 2**20:
        return "MiB", 2**20
    return "KiB", 2**10


def category_scale(present: Sequence[str] | None = None) -> alt.Scale:
    """Fixed colours per memory category, in CATEGORIES order."""
    domain = [c for c in CATEGORIES if present is None or c in present]
    return alt.Scale(domain=domain, range=[CATEGORY_COLORS[c] for c in domain])


def titled(chart: alt.TopLevelMixin, title: str | None, subtitle: str | list[str] | None = None) -> Any:
    """``chart`` with ``title`` (None: as it is) and, under it, ``subtitle`` (a line, or a list of lines)."""
    if not title:
        return chart
    return chart.properties(title=alt.TitleParams(title, subtitle=subtitle, anchor="start") if subtitle else title)


def check_columns(frame: pd.DataFrame, columns: list[str], made_by: str) -> None:
    """Raise ValueError naming the missing columns and the frames function that makes the right frame."""
    if not isinstance(frame, pd.DataFrame):
        raise TypeError(f"charts take DataFrames; make this one with {made_by}, got {type(frame).__name__}")
    missing = [c for c in columns if c not in frame]
    if missing:
        raise ValueError(f"this chart needs the columns {columns}; missing {missing}: make the frame with {made_by}")


RULE_LABEL_GAP = 6  # pixels between the plot's edge and a rule's label


def rule_texts(values: dict[str, float | None]) -> dict[str, str]:
    """Each rule's label: its name and its size as ``units.format_bytes`` writes sizes everywhere else."""
    return {label: f"{label} {format_bytes(value)}" for label, value in values.items() if value is not None}


def rule_label_room(values: dict[str, float | None]) -> int:
    """Pixels the labels of horizontal rules take right of the plot (legends there move over by as much)."""
    texts = rule_texts(values).values()
    return RULE_LABEL_GAP + max((len(t) for t in texts), default=0) * 7 + 8 if texts else 0


def rules(values: dict[str, float | None], scale: int, unit: str,
          orient: str = "y") -> alt.LayerChart | alt.FacetChart | None:
    """Labelled reference rules (a budget, a minimum), one per non-None value, in display units.

    Labels sit outside the plot, so they never cover the data: right of the plot for
    horizontal rules (give legends there ``rule_label_room`` of offset), above it for
    vertical ones. Of two rules, the label of the higher (or further right) one goes above
    (or right of) its rule, the other's below (or left), so close rules keep their labels apart.
    """
    texts = rule_texts(values)
    if not texts:
        return None
    ranked = sorted(texts, key=lambda label: -float(values[label] or 0))
    data = pd.DataFrame([{"label": label, "value": float(values[label] or 0) / scale, "text": texts[label],
                          "first": i % 2 == 0} for i, label in enumerate(ranked)])
    colors = alt.Scale(domain=list(values), range=["#d62728", "#7f7f7f", "#2ca02c"][:len(values)])
    field = alt.Y("value:Q") if orient == "y" else alt.X("value:Q")
    rule = alt.Chart(data).mark_rule(strokeWidth=2, strokeDash=[6, 3]).encode(
        field, color=alt.Color("label:N", scale=colors, title=None, legend=None), tooltip=["text:N"])
    layers = [rule]
    for first, group in data.groupby("first"):
        placement: dict[str, Any]
        if orient == "y":
            placement = dict(align="left", x="width", dx=RULE_LABEL_GAP, baseline="bottom" if first else "top",
                             dy=-2 if first else 2)
        else:
            placement = dict(align="left" if first else "right", y=0, baseline="bottom", dy=-RULE_LABEL_GAP,
                             dx=4 if first else -4)
        layers.append(alt.Chart(group).mark_text(fontWeight="bold", **placement).encode(
            field, text="text:N", color=alt.Color("label:N", scale=colors, legend=None)))
    return alt.layer(*layers)
