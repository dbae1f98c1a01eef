"""The benchmark scripts that can run without a GPU run here once, quickly (their numbers are not checked)."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_offload_vs_peers_runs_on_cpu(tmp_path):
    out = tmp_path / "offload_vs_peers.json"
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "offload_vs_peers.py"), "--quick",
                           "--device", "cpu", "--out", str(out)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    document = json.loads(out.read_text())
    methods = {row["method"] for row in document["rows"]}
    assert {"unconstrained", "udnn_lab auto", "udnn_lab vdnn-all", "save_on_cpu", "torch.utils.checkpoint"} <= methods
    assert document["machine"]["device"] == "cpu" and document["largest_batch"]
    assert "targets" in done.stdout


def test_step_matrix_runs_one_setup(tmp_path):
    out = tmp_path / "step_matrix.json"
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "step_matrix.py"), "--quick", "--out", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    assert {row["policy"] for row in rows} == {"auto", "vdnn-all", "recompute"}
    assert all(row["trace_exact"] and row["measured_fits"] and row["training_equal"] for row in rows)
