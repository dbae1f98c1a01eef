"""The kernel a report runs in: this interpreter, started early, loading what the notebook needs as it starts.

Starting a kernel is cheap; what costs is the kernel importing torch, torchvision, altair and udnn_lab
(seconds). So the kernel is started first and imports them (``preload``) while the caller checks the
request, and the template's first cell finds them loaded. This module imports nothing heavy, so that
``udnn-lab report`` can start the kernel before it loads torch itself.
"""

from __future__ import annotations

import gc
import importlib
import os
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

# What the template imports, in the order the kernel loads them.
PRELOADED = ("torch", "torchvision", "udnn_lab.zoo", "udnn_lab.analysis", "udnn_lab.planning",
             "udnn_lab.frames", "udnn_lab.charts")
# The smallest chart: drawing it starts vl-convert's JavaScript engine (about half a second, the first time only).
_FIRST_DRAWING = {"mark": "point", "data": {"values": [{"x": 0}]},
                  "encoding": {"x": {"field": "x", "type": "quantitative"}}}


@contextmanager
def kernel_started() -> Iterator[Any]:
    """A kernel in this interpreter, started now and shut down when done (by error too).

    This interpreter, not whatever 'python3' kernelspec the user has installed: the report runs
    with the udnn_lab and torch that were asked for it. Local (IPC) sockets on POSIX, so the
    kernel opens no unencrypted TCP ports (and does not warn about them). It starts in the
    current directory, so a hardware profile or a factory module given by a relative path is found.
    """
    # heavy: jupyter_client comes with papermill and loads only when a report is written
    from jupyter_client import AsyncKernelManager
    from jupyter_client.kernelspec import KernelSpec
    from jupyter_client.utils import run_sync  # (as above)
    from traitlets import default  # (as above)

    class ThisInterpreterKernel(AsyncKernelManager):
        @default("transport")
        def _local_sockets(self) -> str:
            return "ipc" if os.name == "posix" else "tcp"

        @property
        def kernel_spec(self) -> KernelSpec:
            return KernelSpec(argv=[sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
                              display_name=f"Python {sys.version.split()[0]} ({sys.executable})", language="python",
                              name="python3")

    kernel = ThisInterpreterKernel(kernel_name="python3")
    preloading = f"__import__({__name__!r}, fromlist=['preload']).preload()"  # leaves no name in the notebook
    run_sync(kernel.start_kernel)(cwd=os.getcwd(), extra_arguments=[f"--IPKernelApp.exec_lines={preloading}"])
    try:
        yield kernel
    finally:
        if kernel.has_kernel:
            run_sync(kernel.shutdown_kernel)(now=True)


def preload() -> None:
    """Run by the kernel as it starts: load what the template imports, and start the chart renderer meanwhile.

    The cyclic collector is off while the modules load and their objects are frozen after: as torch,
    sympy (under torch._dynamo) and altair load, its sweeps go over their objects again and again (about
    a sixth of the loading's CPU), and frozen, the notebook's own collections skip them.
    """
    without_iri_format_checks()
    without_jupyter_chart()
    collecting = gc.isenabled()
    gc.disable()
    try:
        # heavy, and only in the report's kernel: the renderer's engine starts in a thread (it releases the GIL)
        import altair
        import vl_convert

        version = "_".join(altair.SCHEMA_VERSION.split(".")[:2])  # the Vega-Lite that altair draws with, as 'v6_4'
        threading.Thread(target=vl_convert.vegalite_to_svg, args=(_FIRST_DRAWING, version), daemon=True).start()
        for name in PRELOADED:
            importlib.import_module(name)
    finally:
        gc.freeze()
        if collecting:
            gc.enable()


def without_iri_format_checks() -> None:
    """Keep jsonschema, in a process of ours that has not loaded it yet, from loading its checks of 'iri' formats.

    jsonschema (under altair and nbformat) imports rfc3987_syntax for them, and that import builds
    dozens of Earley parsers: about a second, on every start (python-jsonschema/jsonschema#1428). No
    schema the report validates against (Vega-Lite's, the notebook format's) has an 'iri' format.
    """
    if "jsonschema" not in sys.modules and "rfc3987_syntax" not in sys.modules:
        sys.modules["rfc3987_syntax"] = None  # type: ignore[assignment]  # None: importing it raises ImportError


def without_jupyter_chart() -> None:
    """Keep altair, in the report's kernel, from loading anywidget (and ipywidgets under it) for its JupyterChart.

    The report draws every chart as SVG and shows no widget; altair then defines a JupyterChart that says
    anywidget is missing if it is used. Loading them costs the kernel about 0.15 s.
    """
    if "altair" not in sys.modules and "anywidget" not in sys.modules:
        sys.modules["anywidget"] = None  # type: ignore[assignment]  # None: importing it raises ImportError
