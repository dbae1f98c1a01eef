"""The stand-in trace made here (CPU kernels standing in for CUDA's) against the trace a GPU made of the same step with
CUDA's own kernels: the keep-all rows of the newest GPU corpus run committed under data/benchmarks/gpu/ hold that
trace's peak (NOTE [stand-in attention], [stand-in dropout], [stand-in autocast])."""

import json
import sys
from pathlib import Path

import pytest
import torch

import udnn_lab as ul

ROOT = Path(__file__).resolve().parents[2]
RUNS = sorted((ROOT / "data" / "benchmarks" / "gpu").glob("*-corpus"))
TOLERANCE = 0.01


def _traced_on_the_gpu() -> dict[str, int]:
    """Model -> the CUDA trace's peak (its keep-all row's simulated peak), from the newest run."""
    rows = [json.loads(line) for path in sorted(RUNS[-1].glob("gpu_corpus*.jsonl"))
            for line in path.read_text().splitlines() if line.strip()]
    return {r["model"]: r["simulated_peak_bytes"] for r in rows
            if r.get("policy") == "keep-all" and r.get("check") is None and r.get("simulated_peak_bytes")}


PEAKS = _traced_on_the_gpu() if RUNS else {}


@pytest.mark.parametrize("name", sorted(PEAKS))
def test_the_stand_in_trace_peaks_as_the_gpu_s_own_trace_did(name):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import gpu_corpus

    case = next(c for c in gpu_corpus.CORPUS if c.name == name)
    if case.model.startswith("hf:"):
        pytest.importorskip("transformers")
    graph = ul.trace(case.workload(torch.device("meta"), small=False), device="cuda")
    on_gpu = PEAKS[name]
    assert abs(graph.cuda_peak_bytes - on_gpu) <= TOLERANCE * on_gpu, \
        f"{name}: {graph.cuda_peak_bytes} B here, {on_gpu} B traced with CUDA's kernels ({RUNS[-1].name})"
