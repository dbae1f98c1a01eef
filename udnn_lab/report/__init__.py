"""Reports: run the shipped parameterized notebook (``template.ipynb``) and write one offline HTML page.

May import: hardware, planning's policy names, the zoo, units and errors (the notebook imports the rest).
Names load on first use, so that ``kernel_started`` (udnn_lab.report.kernel) comes without torch: the
command line starts the report's kernel before it loads torch itself.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from udnn_lab.report.kernel import kernel_started
    from udnn_lab.report.writing import ReportRequest, write_report

_HOMES = {"ReportRequest": "udnn_lab.report.writing", "write_report": "udnn_lab.report.writing",
          "kernel_started": "udnn_lab.report.kernel"}
__all__ = ["ReportRequest", "kernel_started", "write_report"]


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_HOMES[name]), name)


def __dir__() -> list[str]:
    return sorted(__all__)
