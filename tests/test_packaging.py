"""The wheel carries everything the code reads: built, installed into a fresh venv outside the checkout, run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", "-w", str(out), str(ROOT)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    (built,) = out.glob("udnn_lab-*.whl")
    return built


@pytest.fixture(scope="module")
def installed(wheel, tmp_path_factory) -> Path:
    """A venv with the wheel installed; its other packages are this environment's (no network needed)."""
    venv = tmp_path_factory.mktemp("venv")
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    python = venv / "bin" / "python"
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    # this environment's packages, but not its editable udnn_lab: a plain path line adds no .pth files of its own
    (site / "dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    done = subprocess.run([str(python), "-m", "pip", "install", "--no-deps", "--no-index", "--quiet", str(wheel)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return venv


def _run(venv: Path, args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PATH": f"{venv / 'bin'}{os.pathsep}{os.environ['PATH']}",
           # the borrowed packages' data files (nbconvert's templates) stay in this environment's prefix
           "JUPYTER_PATH": str(Path(sys.prefix) / "share" / "jupyter")}
    env.pop("PYTHONPATH", None)
    return subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=900)


def test_the_wheel_carries_the_data_and_the_report_template(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    assert "udnn_lab/report/template.ipynb" in names
    for folder in ("hardware", "rates", "published"):
        shipped = {p.name for p in (ROOT / "data" / folder).glob("*.json")}
        assert shipped and {f"udnn_lab/data/{folder}/{name}" for name in shipped} <= names, folder


def test_the_installed_package_reads_its_own_data(installed, tmp_path):
    code = ("import udnn_lab as ul, pathlib; from udnn_lab.cost import RateCurve\n"
            "print(pathlib.Path(ul.__file__).resolve())\n"
            "print(RateCurve.for_hardware(ul.Hardware.load('cpu-amd-epyc-2cpu')) is not None)\n"
            "print(len(ul.Hardware.names()))\n"
            "from udnn_lab.zoo import published_fine_tune_peaks; print(len(published_fine_tune_peaks()))")
    done = _run(installed, [str(installed / "bin" / "python"), "-c", code], tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    location, has_rates, profiles, published = done.stdout.split()
    assert Path(location).is_relative_to(installed.resolve()), location  # the wheel's copy, not the checkout
    assert has_rates == "True"
    assert int(profiles) == len(list((ROOT / "data" / "hardware").glob("*.json")))
    assert int(published) == len(json.loads((ROOT / "data" / "published" / "fine_tune_peaks.json").read_text()))


def test_udnn_lab_analyze_and_report_run_from_the_installed_wheel(installed, tmp_path):
    analyzed = _run(installed, ["udnn-lab", "analyze", "resnet18", "--batch", "2", "--image-size", "32",
                                "--out", "curve"], tmp_path)
    assert analyzed.returncode == 0, analyzed.stderr[-3000:]
    assert "peak" in analyzed.stdout.lower() and (tmp_path / "curve.csv").exists()
    reported = _run(installed, ["udnn-lab", "report", "resnet18", "--batch", "2", "--image-size", "32",
                                "--budget", "60MiB", "--out", "report.html"], tmp_path)
    assert reported.returncode == 0, reported.stderr[-3000:]
    page = (tmp_path / "report.html").read_text(encoding="utf-8")
    assert "<svg" in page and "resnet18" in page
