"""``udnn-lab report``: one self-contained HTML document about a model's training step under a budget.

The analysis is a notebook, template.ipynb, whose ``parameters`` cell lists what can
be set. Here the request is checked, papermill runs the notebook in a fresh kernel, and
nbconvert turns it into HTML with the code hidden. The notebook draws every chart inline as
SVG, and the page leaves out nbconvert's CDN scripts (require.js, MathJax, Mermaid), so the
file opens without a network. Its header holds the command that makes it again.
"""

from __future__ import annotations

import re
import shlex
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from udnn_lab import zoo
from udnn_lab.errors import ReportError
from udnn_lab.hardware.profiles import Hardware
from udnn_lab.planning.registry import POLICIES
from udnn_lab.units import format_bytes, parse_bytes
from udnn_lab.zoo import DTYPES, OPTIMIZERS

TEMPLATE = Path(__file__).with_name("template.ipynb")
# The lab page, less the blocks that load scripts from a CDN (the report has no math, diagrams or widgets).
_PAGE = """{%- extends 'index.html.j2' -%}
{%- block html_head_js -%}{%- endblock html_head_js -%}
{%- block jupyter_widgets -%}{%- endblock jupyter_widgets -%}
{%- block html_head_js_mathjax -%}{%- endblock html_head_js_mathjax -%}
{%- block html_head_js_mermaidjs -%}{%- endblock html_head_js_mermaidjs -%}
"""
_NETWORK_LOAD = re.compile(r"<(script|link|img|iframe)\b[^>]*\b(src|href)=[\"']?(https?:)?//", re.IGNORECASE)


@dataclass(frozen=True)
class ReportRequest:
    """What a report is about; the names are the template's parameters and the command's options."""

    model: str  # a zoo name (udnn-lab zoo)
    budget: str | int  # as typed ("6GiB"), so that the header repeats the command that was given
    batch: int = 8
    hardware: str = "h100-sxm"  # a shipped profile name or a profile .json
    policy: str = "auto"
    image_size: int | None = None  # side of image inputs; None: the zoo's default
    optimizer: str = "sgd"
    dtype: str = "float32"

    def check(self) -> None:
        """Raise ValueError (or the zoo's and hardware's own errors) before any kernel starts."""
        if self.policy not in POLICIES:
            raise ValueError(f"unknown policy {self.policy!r}; the policies are: {', '.join(POLICIES)}")
        if self.dtype not in DTYPES:
            raise ValueError(f"unknown dtype {self.dtype!r}; use one of {', '.join(DTYPES)}")
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"unknown optimizer {self.optimizer!r}; use one of {', '.join(OPTIMIZERS)}")
        try:
            budget_bytes = parse_bytes(self.budget)
        except (TypeError, ValueError) as error:
            raise ValueError(f"cannot read the budget {self.budget!r}: {error}") from None
        if budget_bytes <= 0:
            raise ValueError(f"the budget must be more than 0 bytes, got {self.budget!r}")
        Hardware.load(self.hardware)
        if ":" in self.model:
            raise ValueError(f"a report is made for a zoo model (udnn-lab zoo lists them), not {self.model!r}; "
                             "for your own module use 'udnn-lab analyze' or the notebooks")
        kind = zoo.entry(self.model).input_kind
        if self.image_size is not None and kind != "image":
            raise ValueError(f"{self.model} takes {kind} inputs, not images: leave out the image size")
        zoo.get(self.model, batch=self.batch, image_size=self.image_size, device="meta",
                optimizer=None if self.optimizer == "none" else self.optimizer)

    def command(self, out: str | Path) -> str:
        """The shell command that writes this report to ``out``."""
        words = ["udnn-lab", "report", self.model, "--batch", str(self.batch)]
        if self.image_size is not None:
            words += ["--image-size", str(self.image_size)]
        words += ["--budget", str(self.budget), "--hardware", self.hardware, "--policy", self.policy,
                  "--optimizer", self.optimizer, "--dtype", self.dtype, "--out", str(out)]
        return shlex.join(words)


def write_report(request: ReportRequest, out: str | Path, progress: Callable[[str], None] | None = None) -> Path:
    """Run the report notebook for ``request`` and write it to ``out`` as one HTML file; return its path.

    ``progress`` is called with a line of text as each stage starts. An infeasible budget is
    not an error: the report says so and gives the smallest budget that fits. If the
    notebook fails, ReportError names the failing cell and keeps the executed notebook
    beside ``out`` (``*.failed.ipynb``).
    """
    say, start = progress or (lambda _: None), time.perf_counter()
    say("checking the model, hardware and budget ...")
    request.check()
    out = Path(out)
    notebook = _execute(request, out, say)
    say("writing HTML ...")
    page = _to_html(notebook, title=f"{request.model} memory report")
    if _NETWORK_LOAD.search(page):
        raise ReportError(f"the report for {out} would load something from the network; this is a bug in "
                          "udnn_lab's report template, please report it")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(page, encoding="utf-8")
    say(f"wrote {out} ({format_bytes(out.stat().st_size)}) in {time.perf_counter() - start:.0f} s")
    return out


def _execute(request: ReportRequest, out: Path, say: Callable[[str], None]):
    # heavy (a second or more): only when a report is written
    import papermill
    from papermill.exceptions import PapermillExecutionError

    parameters = {**asdict(request), "budget": str(request.budget), "command": request.command(out)}
    say(f"running the report notebook in a new kernel (trace, plan, simulate {request.model}) ...")
    with tempfile.TemporaryDirectory(prefix="udnn-report-") as scratch:
        executed = Path(scratch) / "report.ipynb"
        try:
            # cwd=None: the kernel starts where we are, so a hardware profile given by a relative path is found
            return papermill.execute_notebook(str(TEMPLATE), str(executed), parameters=parameters,
                                              kernel_name="python3", progress_bar=False, cwd=None)
        except PapermillExecutionError as error:
            kept = out.with_suffix(".failed.ipynb")
            kept.parent.mkdir(parents=True, exist_ok=True)
            kept.write_bytes(executed.read_bytes())
            raise ReportError(f"the report notebook failed in cell {error.exec_count}: {error.ename}: "
                              f"{error.evalue}. The executed notebook is kept at {kept}") from None


def _to_html(notebook, title: str) -> str:
    # heavy: only when a report is written
    from jinja2 import DictLoader
    from nbconvert import HTMLExporter

    exporter = HTMLExporter(template_name="lab", template_file="udnn_report.html.j2",
                            extra_loaders=[DictLoader({"udnn_report.html.j2": _PAGE})],
                            exclude_input=True, exclude_input_prompt=True, exclude_output_prompt=True)
    page, _ = exporter.from_notebook_node(notebook, resources={"metadata": {"name": title}})
    return page
