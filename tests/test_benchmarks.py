"""The benchmark scripts that can run without a GPU run here once, quickly (their numbers are not checked)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import udnn_lab as ul

ROOT = Path(__file__).resolve().parent.parent


def test_offload_vs_peers_runs_on_cpu(tmp_path):
    out = tmp_path / "offload_vs_peers.json"
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "offload_vs_peers.py"), "--quick",
                           "--device", "cpu", "--out", str(out)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    document = json.loads(out.read_text())
    methods = {row["method"] for row in document["rows"]}
    assert {"unconstrained", "udnn_lab auto", "udnn_lab vdnn-all", "save_on_cpu", "torch.utils.checkpoint",
            "selective activation checkpointing", "udnn_lab auto at save_on_cpu's peak"} <= methods
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


def test_host_proxy_runs_one_workload(tmp_path):
    out = tmp_path / "host_proxy.json"
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "host_proxy.py"), "--quick", "--repeats", "2",
                           "--out", str(out)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    document = json.loads(out.read_text())
    rows = document["rows"]
    assert rows and {"auto midway", "recompute midway"} <= {row["plan"] for row in rows}
    assert all(row["measured_slowdown"] > 0 and row["simulated_slowdown"] >= 1.0 for row in rows)
    against = document["against_checkpoint"]["rows"]  # the same blocks under torch.utils.checkpoint, and ours
    assert against[0]["method"] == "torch.utils.checkpoint" and against[0]["peak_bytes"] > 0
    assert any(row["method"].startswith("udnn_lab recompute") and row["step_s"] > 0 for row in against)
    assert "target" in done.stdout and "torch.utils.checkpoint" in done.stdout


def test_gpu_corpus_dry_run_on_cpu_holds_every_plan_to_eager(tmp_path):
    command = [sys.executable, str(ROOT / "benchmarks" / "gpu_corpus.py"), "--device", "cpu", "--small",
               "--models", "gpt2", "--out", str(tmp_path)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, env=_threads())
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [json.loads(line) for line in (tmp_path / "gpu_corpus.jsonl").read_text().splitlines()]
    planned = [row for row in rows if row["policy"] not in ("keep-all",) and row.get("measured_steps_s")]
    assert rows[0]["policy"] == "keep-all" and rows[0]["nondeterministic_grads"] == 0
    assert {row["policy"] for row in planned} == {"auto", "vdnn++", "recompute"}
    assert all(row["grads_differ"] == 0 and not row["error"] for row in planned), [r["status"] for r in planned]
    import gzip

    with gzip.open(tmp_path / "gpu_corpus" / "gpt2-keep-all-kernels.json.gz", "rt") as file:
        kernels = json.load(file)
    assert [row["count"] for row in kernels if row["op"].startswith("Optimizer.step")] == [1]  # one step, profiled
    assert {"eager", "control", "kernels", "profile"} <= set(rows[0]["phase_s"])  # where the model's time went
    kinds = [row["budget_kind"] for row in rows[1:] if row.get("budget_kind")]
    assert kinds[:3] == ["midway"] * 3 and "min+5%" in kinds  # every policy at one budget before the next budget
    again = subprocess.run([*command, "--resume"], capture_output=True, text=True, timeout=600, env=_threads())
    assert "gpt2: in gpu_corpus.jsonl already" in again.stdout
    curve = tmp_path / "rates.json"  # the keep-all step's per-op profile makes a rate curve
    fitted = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "fit_rates.py"), str(tmp_path / "gpu_corpus"),
                             "--hardware", "cpu-amd-epyc-2cpu", "--out", str(curve)], capture_output=True, text=True,
                            timeout=300)
    assert fitted.returncode == 0, fitted.stderr[-2000:]
    assert "gpt2" in fitted.stdout and ul.RateCurve.load(curve).points
    # the graph and every plan saved: this machine simulates each run again, as it did then when nothing changed
    resimulated = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_resimulate.py"), str(tmp_path),
                                  "--out", str(tmp_path / "resimulated.json")], capture_output=True, text=True,
                                 timeout=300, env=_threads())
    assert resimulated.returncode == 0, resimulated.stderr[-2000:]
    again_rows = json.loads((tmp_path / "resimulated.json").read_text())["rows"]
    assert {r["policy"] for r in again_rows} == {"keep-all", "auto", "vdnn++", "recompute"}
    planned_again = [r for r in again_rows if r["policy"] != "keep-all"]  # keep-all's row was simulated unprofiled
    assert all(r["simulated_now_s"] == pytest.approx(r["simulated_then_s"], rel=1e-9) for r in planned_again), \
        [(r["policy"], r["simulated_now_s"], r["simulated_then_s"]) for r in planned_again]


@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA the check runs for real (make gpu-check)")
def test_gpu_check_without_cuda_says_each_step_skipped():
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py")], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "corpus: skipped" in done.stdout and "tests: skipped" in done.stdout


def test_gpu_check_records_a_test_that_kills_pytest_and_runs_the_rest(tmp_path):
    # a CUDA kernel's segmentation fault ended the H200's test step, and the results before it with it
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import gpu_check

    cases = tmp_path / "test_cases.py"
    cases.write_text("import os, signal\n\n"
                     "def test_a():\n    pass\n\n"
                     "def test_b():\n    assert 1 == 2, 'one is not two'\n\n"
                     "def test_c():\n    os.kill(os.getpid(), signal.SIGSEGV)\n\n"
                     "def test_d():\n    pass\n")
    out = tmp_path / "out"
    out.mkdir()
    result = gpu_check._tests(out, 120, (str(cases),))
    outcomes = {case["test"].split("::")[-1]: case["outcome"] for case in result["tests"]}
    assert outcomes == {"test_a": "passed", "test_b": "failed", "test_c": "crashed", "test_d": "passed"}
    assert "one is not two" in next(case["message"] for case in result["tests"] if case["outcome"] == "failed")
    assert result["exit"] == "crashed" and len(result["runs"]) == 2
    log = (out / "pytest-gpu.log").read_text()
    assert "Segmentation fault" in log and "1 passed, 3 deselected" in log


def _threads() -> dict:
    import os

    return {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def _event(action: str, addr: int, size: int, filename: str = "", line: int = 0) -> dict:
    frames = [{"name": "f", "filename": filename, "line": line}] if filename else []
    return {"action": action, "addr": addr, "size": size, "frames": frames}


def test_gpu_diagnose_names_what_was_alive_at_the_peak(tmp_path):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import gzip
    import pickle

    from udnn_lab.measurement.snapshot import Snapshot

    mib = 2**20
    history = [_event("alloc", 1, 10 * mib, "/usr/lib/python3.12/copy.py", 1),  # the copy before the step
               _event("alloc", 2, 100 * mib, "/m/torchvision/models/vgg.py", 66),  # a feature map
               _event("alloc", 3, 300 * mib),  # a library's workspace: no Python frame
               _event("free_requested", 3, 300 * mib), _event("free_completed", 3, 300 * mib),
               _event("alloc", 4, 50 * mib, "/m/udnn_lab/runtime/_copies.py", 45),  # lower than the peak
               _event("free_completed", 2, 100 * mib)]
    snapshot = {"segments": [], "device_traces": [history]}
    peak = Snapshot("test", (), (tuple(history),)).peak()
    assert peak.allocated_bytes == 410 * mib and max(block.order for block in peak.blocks) == 3
    rows = list(peak.by_place().head(5).itertuples(index=False))
    assert [round(total / mib) for _, total, _ in rows] == [300, 100, 10]
    assert rows[0][0].startswith("(no Python frame") and "vgg.py:66" in rows[1][0] and "copy" in rows[2][0]
    with gzip.open(tmp_path / "vgg16-vdnn-all-none-snapshot.pickle.gz", "wb") as file:
        pickle.dump(snapshot, file)
    (tmp_path / "gpu_corpus.jsonl").write_text(json.dumps(
        {"model": "vgg16", "policy": "vdnn-all", "budget_kind": "none", "simulated_peak_bytes": 110 * mib,
         "measured_peaks": [410 * mib], "budget_bytes": None}) + "\n")
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_diagnose.py"), str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "410.0 MiB allocated at the peak" in done.stdout and "simulated peak 110.0 MiB" in done.stdout


def test_gpu_errors_counts_the_short_predictions_and_the_margin_that_leaves_none(tmp_path):
    rows = [{"peak_error": e, "reserved_growth_error": r, "outside_allocator_bytes": o}
            for e, r, o in ((-0.02, -0.10, 500 * 2**20), (0.01, 0.05, 520 * 2**20), (0.0, None, None))]
    rows += [{"model": "vgg16", "policy": "keep-all", "left_behind_bytes": [64 * 2**20, 0, 0]},
             {"model": "vgg16", "policy": "keep-all", "check": "capped", "capped_runs": True},
             {"model": "vgg16", "policy": "auto", "budget_kind": "midway", "check": "capped", "capped_runs": False}]
    rows += [{"model": model, "policy": "auto", "budget_kind": kind, "step_error": error}  # the plan runs' steps
             for model, kind, error in (("vgg16", "midway", 0.02), ("gpt2", "midway", -0.25), ("gpt2", "50%", 0.05))]
    (tmp_path / "gpu_corpus-1.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    (tmp_path / "gpu_corpus-2.jsonl").write_text(json.dumps(rows[0]))  # a resumed call's copy of the first's rows
    out = tmp_path / "errors.json"
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_errors.py"), str(tmp_path), "--out",
                           str(out)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    found = json.loads(out.read_text())
    assert found["allocated peak"]["runs"] == 3 and found["allocated peak"]["underestimates"] == 1
    assert found["allocated peak"]["margin_for_none_short"] == pytest.approx(0.02)
    assert found["reserved growth"]["runs"] == 2 and found["reserved growth"]["min"] == pytest.approx(-0.10)
    assert found["outside allocator"] == {"runs": 2, "min_bytes": 500 * 2**20, "max_bytes": 520 * 2**20}
    assert "reserved growth" in done.stdout and "500 to 520 MiB" in done.stdout
    assert found["capped"] == {"runs": 2, "ran": 1, "out_of_memory": ["vgg16 auto midway"]}
    assert "1 of 2 ran; out of memory: vgg16 auto midway" in done.stdout and "64.0 to 64.0 MiB over 1" in done.stdout
    assert found["plan steps"] == {"runs": 3, "within": 2, "models": 2, "models_within": 1,
                                   "largest": ["gpt2 auto midway -25.0%"]}
    assert "2 of 3 runs; every plan of a model within it: 1 of 2 models" in done.stdout


def test_trainer_callbacks_runs_one_setup_of_each_trainer(tmp_path):
    out = tmp_path / "trainer_callbacks.json"
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "trainer_callbacks.py"), "--quick",
                           "--out", str(out)], capture_output=True, text=True, timeout=600, env=_threads())
    assert done.returncode == 0, done.stderr[-2000:]
    document = json.loads(out.read_text())
    assert {row["trainer"] for row in document["rows"]} == {"transformers.Trainer", "lightning.Trainer"}
    assert document["summary"]["runs"] == 2 and "targets" in done.stdout
    assert len(out.with_suffix(".jsonl").read_text().splitlines()) == 2  # written as they came
