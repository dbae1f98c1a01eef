"""``udnn-lab report``: one self-contained HTML document about a model's training step under a budget.

The analysis is a notebook, template.ipynb, whose ``parameters`` cell lists what can
be set. Here the request is checked, papermill runs the notebook in a fresh kernel, and
nbconvert turns it into HTML with the code hidden. The notebook draws every chart inline as
SVG, and the page leaves out nbconvert's CDN scripts (require.js, MathJax, Mermaid), so the
file opens without a network. Its header holds the command that makes it again.
"""

from __future__ import annotations

import os
import re
import shlex
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from udnn_lab import zoo
from udnn_lab.errors import ReportError
from udnn_lab.hardware.profiles import Hardware
from udnn_lab.planning.registry import POLICIES
from udnn_lab.units import format_bytes, parse_bytes
from udnn_lab.vocabulary import ATTENTION_IMPLEMENTATIONS, AttentionImplementation
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

    model: str  # a zoo name (udnn-lab zoo) or 'package.module:factory'
    budget: str | int  # as typed ("6GiB"), so that the header repeats the command that was given
    batch: int = 8
    hardware: str = "h100-sxm"  # a shipped profile name or a profile .json
    policy: str = "auto"
    image_size: int | None = None  # side of image inputs; None: the zoo's default
    input_shape: tuple[int, ...] | None = None  # one example's shape, for a factory's module
    optimizer: str = "default"  # the zoo's own: SGD with momentum, AdamW for hf: models
    dtype: str = "float32"
    seq_len: int | None = None  # tokens per example of an hf: model; None: the zoo's default
    attn_implementation: AttentionImplementation | None = None  # of an hf: model; None: what transformers picks
    lora_rank: int | None = None  # train LoRA adapters of this rank on the frozen hf: model

    def check(self) -> None:
        """Raise ValueError (or the zoo's and hardware's own errors): the names, then the model itself."""
        self.check_names()
        self.check_model()

    def check_names(self) -> None:
        """Everything but building the model: quick, so it runs before any kernel starts."""
        if self.policy not in POLICIES:
            raise ValueError(f"unknown policy {self.policy!r}; the policies are: {', '.join(POLICIES)}")
        if self.dtype not in DTYPES:
            raise ValueError(f"unknown dtype {self.dtype!r}; use one of {', '.join(DTYPES)}")
        if self.optimizer not in ("default", *OPTIMIZERS):
            raise ValueError(f"unknown optimizer {self.optimizer!r}; use one of default, {', '.join(OPTIMIZERS)}")
        try:
            budget_bytes = parse_bytes(self.budget)
        except (TypeError, ValueError) as error:
            raise ValueError(f"cannot read the budget {self.budget!r}: {error}") from None
        if budget_bytes <= 0:
            raise ValueError(f"the budget must be more than 0 bytes, got {self.budget!r}")
        Hardware.load(self.hardware)
        self._check_hf_options()
        if self.model.lower().startswith(zoo.hf_configs.PREFIX):
            if self.image_size is not None:
                raise ValueError(f"{self.model} is built from its config, with its own input size: leave out the "
                                 "image size")
            return
        if ":" in self.model:
            if self.input_shape is None:
                raise ValueError(f"for your own module ({self.model}) give its input shape, one example's shape, "
                                 "e.g. --input-shape 3x224x224")
            return
        kind = zoo.entry(self.model).input_kind
        if self.image_size is not None and kind != "image":
            raise ValueError(f"{self.model} takes {kind} inputs, not images: leave out the image size")

    def _check_hf_options(self) -> None:
        given = [name for name, value in (("seq_len", self.seq_len), ("attn_implementation", self.attn_implementation),
                                          ("lora_rank", self.lora_rank)) if value is not None]
        if given and not self.model.lower().startswith(zoo.hf_configs.PREFIX):
            raise ValueError(f"{', '.join(given)}: for Hugging Face models (hf:<name>) only, not {self.model}")
        if self.attn_implementation is not None and self.attn_implementation not in ATTENTION_IMPLEMENTATIONS:
            raise ValueError(f"unknown attention {self.attn_implementation!r}; use one of "
                             f"{', '.join(ATTENTION_IMPLEMENTATIONS)}")
        for name, value in (("seq_len", self.seq_len), ("lora_rank", self.lora_rank)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive int, got {value!r}")

    def check_model(self) -> None:
        """Build the model on the meta device (a factory's on the CPU): it exists and takes this batch."""
        zoo.get(self.model, batch=self.batch, image_size=self.image_size, input_shape=self.input_shape,
                device="meta", dtype=None if self.dtype == "float32" else DTYPES[self.dtype],
                optimizer=None if self.optimizer == "none" else self.optimizer, seq_len=self.seq_len,
                attn_implementation=self.attn_implementation, lora_rank=self.lora_rank)

    def command(self, out: str | Path) -> str:
        """The shell command that writes this report to ``out``."""
        words = ["udnn-lab", "report", self.model, "--batch", str(self.batch)]
        if self.image_size is not None:
            words += ["--image-size", str(self.image_size)]
        if self.input_shape is not None:
            words += ["--input-shape", "x".join(map(str, self.input_shape))]
        for option, value in (("--seq-len", self.seq_len), ("--attn-implementation", self.attn_implementation),
                              ("--lora-rank", self.lora_rank)):
            words += [option, str(value)] if value is not None else []
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
    request.check_names()
    out = Path(out)
    with _kernel_started() as kernel:  # it loads torch and udnn_lab while the model is checked here
        request.check_model()
        notebook = _execute(request, out, say, kernel)
    say("writing HTML ...")
    page = _to_html(notebook, title=f"{request.model} memory report")
    if _NETWORK_LOAD.search(page):
        raise ReportError(f"the report for {out} would load something from the network; this is a bug in "
                          "udnn_lab's report template, please report it")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(page, encoding="utf-8")
    say(f"wrote {out} ({format_bytes(out.stat().st_size)}) in {time.perf_counter() - start:.0f} s")
    return out


def _execute(request: ReportRequest, out: Path, say: Callable[[str], None], kernel):
    # heavy (a second or more): only when a report is written
    import papermill
    from papermill.exceptions import PapermillExecutionError

    parameters = {**asdict(request), "budget": str(request.budget), "command": request.command(out),
                  "input_shape": list(request.input_shape) if request.input_shape else None}
    say(f"running the report notebook (trace, plan, simulate {request.model}) ...")
    with tempfile.TemporaryDirectory(prefix="udnn-report-") as scratch:
        executed = Path(scratch) / "report.ipynb"
        try:
            # cwd=None: the kernel starts where we are, so a hardware profile given by a relative path is found
            return papermill.execute_notebook(str(TEMPLATE), str(executed), parameters=parameters,
                                              kernel_name="python3", km=kernel, progress_bar=False)
        except PapermillExecutionError as error:
            kept = out.with_suffix(".failed.ipynb")
            kept.parent.mkdir(parents=True, exist_ok=True)
            kept.write_bytes(executed.read_bytes())
            raise ReportError(f"the report notebook failed in cell {error.exec_count}: {error.ename}: "
                              f"{error.evalue}. The executed notebook is kept at {kept}") from None


# Imported by the kernel as it starts, while the request is still being checked here: the template's first cell
# then finds them loaded.
_PRELOAD = ("import torch, torchvision, altair, vl_convert, udnn_lab.zoo, udnn_lab.analysis, udnn_lab.planning, "
            "udnn_lab.charts, udnn_lab.frames")


@contextmanager
def _kernel_started() -> Iterator[Any]:
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
    run_sync(kernel.start_kernel)(cwd=os.getcwd(), extra_arguments=[f"--IPKernelApp.exec_lines={_PRELOAD}"])
    try:
        yield kernel
    finally:
        if kernel.has_kernel:
            run_sync(kernel.shutdown_kernel)(now=True)


def _to_html(notebook, title: str) -> str:
    # heavy: only when a report is written
    from jinja2 import DictLoader
    from nbconvert import HTMLExporter

    exporter = HTMLExporter(template_name="lab", template_file="udnn_report.html.j2",
                            extra_loaders=[DictLoader({"udnn_report.html.j2": _PAGE})],
                            exclude_input=True, exclude_input_prompt=True, exclude_output_prompt=True)
    page, _ = exporter.from_notebook_node(notebook, resources={"metadata": {"name": title}})
    return page
