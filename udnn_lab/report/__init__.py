"""Reports: run the shipped parameterized notebook (``template.ipynb``) and write one offline HTML page.

May import: hardware, planning's policy names, the zoo, units and errors (the notebook imports the rest).
"""

from udnn_lab.report.writing import ReportRequest, write_report

__all__ = ["ReportRequest", "write_report"]
