"""The report's kernel: started before the command loads torch, preloading what the template imports."""

import ast
import os
import subprocess
import sys
from pathlib import Path

import nbformat

import udnn_lab
from udnn_lab.report.writing import TEMPLATE

ROOT = Path(__file__).resolve().parent.parent.parent


def _python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})


def modules_the_template_uses() -> set[str]:
    """What the template's code imports (torch, udnn_lab's stages) and the homes of the ``ul.<name>`` it calls."""
    used = set()
    for cell in nbformat.read(TEMPLATE, as_version=4).cells:
        if cell.cell_type != "code":
            continue
        for node in ast.walk(ast.parse(cell.source)):
            if isinstance(node, ast.Import):
                used |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module == "udnn_lab":
                used |= {f"udnn_lab.{alias.name}" for alias in node.names}
            elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "ul":
                used.add(udnn_lab._HOMES.get(node.attr, "udnn_lab"))
    return {name for name in used if name.split(".")[0] in ("torch", "torchvision", "altair", "udnn_lab")}


def test_after_preload_the_template_finds_everything_it_uses_loaded():
    used = modules_the_template_uses()
    assert {"torch", "udnn_lab.charts", "udnn_lab.frames", "udnn_lab.analysis", "udnn_lab.planning",
            "udnn_lab.simulation", "udnn_lab.zoo"} <= used  # the template as it is: the parse finds its calls
    done = _python(
        "import sys\n"
        "from udnn_lab.report.kernel import preload\n"
        "preload()\n"
        f"missing = [name for name in {sorted(used)!r} if name not in sys.modules]\n"
        "assert not missing, missing\n"
        "assert sys.modules.get('rfc3987_syntax', 'absent') is None, 'rfc3987_syntax was loaded'\n"
        "assert sys.modules.get('anywidget', 'absent') is None and 'ipywidgets' not in sys.modules, 'widgets loaded'\n"
        "import gc\n"
        "assert gc.isenabled() and gc.get_freeze_count() > 100_000, (gc.isenabled(), gc.get_freeze_count())\n"
        "import altair as alt\n"
        "alt.Chart(alt.Data(values=[{'x': 1}])).mark_point().encode(x='x:Q').to_dict()  # validates\n")
    assert done.returncode == 0, done.stderr[-3000:]


def test_iri_checks_stay_when_jsonschema_is_loaded_already():
    done = _python(
        "import sys, jsonschema\n"
        "from udnn_lab.report.kernel import without_iri_format_checks\n"
        "loaded = 'rfc3987_syntax' in sys.modules\n"
        "without_iri_format_checks()\n"
        "assert ('rfc3987_syntax' in sys.modules) == loaded and sys.modules.get('rfc3987_syntax', 1) is not None\n")
    assert done.returncode == 0, done.stderr[-3000:]


def test_jupyter_chart_stays_when_altair_is_loaded_already():
    done = _python(
        "import sys, altair\n"
        "from udnn_lab.report.kernel import without_jupyter_chart\n"
        "loaded = 'anywidget' in sys.modules\n"
        "without_jupyter_chart()\n"
        "assert ('anywidget' in sys.modules) == loaded and sys.modules.get('anywidget', 1) is not None\n")
    assert done.returncode == 0, done.stderr[-3000:]


def test_udnn_lab_report_starts_the_kernel_before_it_loads_torch(tmp_path):
    done = _python(
        "import sys\n"
        "import udnn_lab.report.kernel as kernel\n"
        "started = kernel.kernel_started\n"
        "torch_loaded = []\n"
        "def spy():\n"
        "    torch_loaded.append('torch' in sys.modules)\n"
        "    return started()\n"
        "kernel.kernel_started = spy\n"
        "from udnn_lab.cli import main\n"
        f"code = main(['report', 'mlp3', '--budget', 'lots', '--out', {str(tmp_path / 'r.html')!r}])\n"
        "assert code == 1 and torch_loaded == [False], (code, torch_loaded)\n")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "cannot read the budget 'lots'" in done.stderr  # refused as before, the kernel shut down
    assert not (tmp_path / "r.html").exists()
