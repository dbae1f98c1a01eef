"""``udnn-lab report``: one self-contained HTML document about a model's training step under a budget.

The analysis is a notebook, template.ipynb, whose ``parameters`` cell lists what can
be set. Here the request is checked while a fresh kernel (kernel.py) loads what the
notebook imports, papermill runs the notebook in that kernel, and nbconvert turns it into
HTML with the code hidden. The notebook draws every chart inline as SVG, and the page
leaves out nbconvert's CDN scripts (require.js, MathJax, Mermaid), so the file opens
without a network. Its header holds the command that makes it again.
"""

from __future__ import annotations

import re
import shlex
import tempfile
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from udnn_lab import zoo
from udnn_lab.errors import ReportError
from udnn_lab.hardware.profiles import Hardware
from udnn_lab.planning.registry import POLICIES
from udnn_lab.report.kernel import kernel_started
from udnn_lab.units import format_bytes, parse_bytes
from udnn_lab.vocabulary import ATTENTION_IMPLEMENTATIONS, AttentionImplementation, Precision
from udnn_lab.workload import COMPUTE_DTYPES, StepOptions
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
    # a shipped profile name or a profile .json; None: the profile for this machine's GPU, else the closest shipped
    # one (the notebook finds it, and says which: udnn_lab.simulation.simulator.resolve_hardware)
    hardware: str | None = None
    policy: str = "auto"
    image_size: int | None = None  # side of image inputs; None: the zoo's default
    input_shape: tuple[int, ...] | None = None  # one example's shape, for a factory's module
    optimizer: str = "default"  # the zoo's own: SGD with momentum, AdamW for hf: models
    dtype: str = "float32"
    seq_len: int | None = None  # tokens per example of an hf: model; None: the zoo's default
    attn_implementation: AttentionImplementation | None = None  # of an hf: model; None: what transformers picks
    lora_rank: int | None = None  # train LoRA adapters of this rank on the frozen hf: model
    precision: Precision | None = None  # PyTorch Lightning's names; None: dtype's '-true' one (32-true)
    grad_accumulation: int = 1  # micro-batches of ``batch`` examples per optimizer step
    clip_grad_norm: float | None = None  # max total gradient norm; None: no clipping
    # a memory snapshot of a real run of this step (torch.cuda.memory._dump_snapshot's file, or
    # ul.write_cpu_snapshot's): the report lays it over the prediction; None: no such section
    snapshot: str | None = None

    def check(self) -> None:
        """Raise ValueError (or the zoo's and hardware's own errors): the names, then the model itself."""
        self.check_names()
        self.check_model()

    def check_names(self) -> None:
        """Everything but building the model: quick, so it runs before any kernel starts."""
        if isinstance(self.batch, bool) or not isinstance(self.batch, int) or self.batch < 1:
            raise ValueError(f"the batch size must be a whole number of at least 1, got {self.batch!r}")
        if self.policy not in POLICIES:
            raise ValueError(f"unknown policy {self.policy!r}; the policies are: {', '.join(POLICIES)}")
        if self.dtype not in DTYPES:
            raise ValueError(f"unknown dtype {self.dtype!r}; use one of {', '.join(DTYPES)}")
        if self.optimizer not in ("default", *OPTIMIZERS):
            raise ValueError(f"unknown optimizer {self.optimizer!r}; use one of default, {', '.join(OPTIMIZERS)}")
        self._check_budget_and_hardware()
        self._check_step_options()
        self._check_hf_options()
        if self.snapshot is not None and not Path(self.snapshot).is_file():
            raise ValueError(f"no snapshot at {self.snapshot}: give the file torch.cuda.memory._dump_snapshot(path) "
                             "(or ul.write_cpu_snapshot) wrote")
        if self.model.lower().startswith(zoo.hf_configs.PREFIX):
            zoo.hf_configs.spec(self.model)
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

    def _check_budget_and_hardware(self) -> None:
        try:
            budget_bytes = parse_bytes(self.budget)
        except (TypeError, ValueError) as error:
            raise ValueError(f"cannot read the budget {self.budget!r}: {error}") from None
        if budget_bytes <= 0:
            raise ValueError(f"the budget must be more than 0 bytes, got {self.budget!r}")
        if self.hardware is not None:
            Hardware.load(self.hardware)

    def _check_step_options(self) -> None:
        StepOptions(self.precision or "32-true", self.grad_accumulation, self.clip_grad_norm)  # says what is wrong
        if self.precision is None or self.dtype == "float32":
            return
        implied = next(name for name, dtype in COMPUTE_DTYPES.items()
                       if name.endswith("-true") and dtype == DTYPES[self.dtype])
        if self.precision != implied:
            raise ValueError(f"dtype {self.dtype} means precision {implied}, but precision {self.precision} was "
                             "asked for: give one of them (precision is the newer way)")

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
                attn_implementation=self.attn_implementation, lora_rank=self.lora_rank, precision=self.precision)

    @property
    def builds_by_construction(self) -> bool:
        """One of the zoo's fixed models (resnet18, densenet121): once its name checks, building it can fail only
        for want of an optional package (timm), which the notebook then says. Your factory, a family member whose
        size is checked as it builds (resnet164) and an hf: model (checked as its config builds) are built before
        the notebook runs."""
        if ":" in self.model or self.model.lower().startswith(zoo.hf_configs.PREFIX):
            return False
        return zoo.entry(self.model).name in zoo.describe()

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
        words += ["--budget", str(self.budget)] + (["--hardware", self.hardware] if self.hardware is not None else [])
        words += ["--policy", self.policy, "--optimizer", self.optimizer, "--dtype", self.dtype]
        accumulation = self.grad_accumulation if self.grad_accumulation != 1 else None
        for option, setting in (("--precision", self.precision), ("--grad-accumulation", accumulation),
                                ("--clip-grad-norm", self.clip_grad_norm), ("--snapshot", self.snapshot)):
            words += [option, str(setting)] if setting is not None else []
        words += ["--out", str(out)]
        return shlex.join(words)


def write_report(request: ReportRequest, out: str | Path, progress: Callable[[str], None] | None = None,
                 kernel: Any = None) -> Path:
    """Run the report notebook for ``request`` and write it to ``out`` as one HTML file; return its path.

    ``progress`` is called with a line of text as each stage starts. An infeasible budget is
    not an error: the report says so and gives the smallest budget that fits. If the
    notebook fails, ReportError names the failing cell and keeps the executed notebook
    beside ``out`` (``*.failed.ipynb``). ``kernel``: one from ``kernel_started()``, already
    loading (``udnn-lab report`` starts it before it loads torch itself); without it, one is
    started here once the request's names are checked.
    """
    say, start = progress or (lambda _: None), time.perf_counter()
    say("checking the model, hardware and budget ...")
    request.check_names()
    out = Path(out)
    with nullcontext(kernel) if kernel is not None else kernel_started() as running:
        # the kernel loads torch and udnn_lab meanwhile; building one of the zoo's fixed models here would load
        # torchvision a second time (a second or more), and the notebook builds it anyway
        if not request.builds_by_construction:
            request.check_model()
        exporter = _html_exporter()
        notebook = _execute(request, out, say, running)
    say("writing HTML ...")
    page, _ = exporter.from_notebook_node(notebook, resources={"metadata": {"name": f"{request.model} memory report"}})
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


def _html_exporter():
    """The exporter, warmed up: its first page loads what nbconvert loads lazily (the templates, BeautifulSoup's
    table of entities, CSS selectors), half a second that is spent here while the kernel still works."""
    # heavy: only when a report is written
    from jinja2 import DictLoader
    from nbconvert import HTMLExporter
    from nbformat.v4 import new_markdown_cell, new_notebook  # (as above)

    exporter = HTMLExporter(template_name="lab", template_file="udnn_report.html.j2",
                            extra_loaders=[DictLoader({"udnn_report.html.j2": _PAGE})],
                            exclude_input=True, exclude_input_prompt=True, exclude_output_prompt=True)
    exporter.from_notebook_node(new_notebook(cells=[new_markdown_cell("warm-up")]))
    return exporter
