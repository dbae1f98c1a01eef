"""The app's chart widget: altair's JupyterChart, offline, without switching altair for the whole process.

Here rather than in charts/: loading it loads anywidget and ipywidgets, which only the app needs (the report's
kernel draws SVG and keeps them out).
"""

from __future__ import annotations

import functools
from typing import Any

import altair as alt
from altair.jupyter.jupyter_chart import load_js_src
from altair.utils._importers import import_vl_convert, vl_version_for_vl_convert


class OfflineChart(alt.JupyterChart):
    """A JupyterChart that renders from JavaScript bundled with the package (no CDN, no network), whatever
    ``alt.JupyterChart.enable_offline`` and altair's renderer are set to: a chart that needs the offline widget
    asks for it here instead of switching either for the whole process."""

    def __init__(self, chart: alt.TopLevelMixin | None = None, **kwargs: Any) -> None:
        self._esm = offline_javascript()  # read once by anywidget's __init__, as the widget's own module
        super().__init__(chart, **kwargs)  # type: ignore[arg-type]  # altair's hint omits None


@functools.cache  # the same bundle every call; vl-convert takes seconds to make it
def offline_javascript() -> str:
    """altair's JupyterChart module with its imports bundled by vl-convert, as ``alt.JupyterChart.enable_offline``
    makes it, without setting it on the class."""
    lines = load_js_src().split("\n")
    while lines and (not lines[0].strip() or lines[0].startswith(("import", "//"))):
        lines.pop(0)  # the imports vl-convert's bundle provides
    return import_vl_convert().javascript_bundle("\n".join(lines), vl_version=vl_version_for_vl_convert())
