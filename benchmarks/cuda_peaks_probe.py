"""Measured against simulated step peaks on CUDA, per policy, three steps each.

For ResNet-50 (batch 64) and the zoo transformer (batch 16): keep-all, vdnn-all, and auto
and vdnn++ at a budget midway between their minimum and the keep-all peak. Each step
records the allocator's peak less what the process holds outside the step (so it reads
like the simulated peak), what is held after
forward, after the step and after gc.collect() (memory a reference cycle keeps), the
runtime's copy statistics, and the simulated peak. The third step synchronizes after
forward, so a difference between it and the others shows the host running ahead of the GPU.

    python benchmarks/cuda_peaks_probe.py [--out data/benchmarks/gpu/cuda_peaks_probe.json]
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import gc
import json
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import udnn_lab as ul  # noqa: E402
from udnn_lab.analysis.step import compute_loss, split_input  # noqa: E402
from udnn_lab.units import cuda_block_bytes  # noqa: E402
from udnn_lab.workload import optimizer_like  # noqa: E402

CASES = (("resnet50", 64), ("transformer", 16))


def _plans(graph, hardware) -> dict:
    plans = {"keep-all": None, "vdnn-all": ul.plan(graph, None, "vdnn-all", hardware=hardware)}
    for policy in ("auto", "vdnn++"):
        low = ul.min_budget(graph, policy, hardware=hardware)
        plans[f"{policy} midway"] = ul.plan(graph, (low + graph.cuda_peak_bytes) // 2, policy, hardware=hardware)
    return plans


def _steps(work, plan, device) -> list[dict]:
    model = copy.deepcopy(work.model)
    optimizer = optimizer_like(work.optimizer, model.parameters())
    runtime = ul.OffloadRuntime(plan, model=model)
    args, kwargs = split_input(work.example_input)
    rows = []
    for sync in (False, False, True):
        optimizer.zero_grad(set_to_none=True)
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        started = time.perf_counter()
        try:
            with runtime:
                loss = compute_loss(model(*args, **kwargs), work.loss_fn, work.target)
                if sync:
                    torch.cuda.synchronize(device)
                after_forward = torch.cuda.memory_allocated(device)
                loss.backward()
        except Exception as err:  # recorded, and the memory it leaves behind measured below
            rows.append({"error": f"{type(err).__name__}: {err}"})
            break
        optimizer.step()
        torch.cuda.synchronize(device)
        outside = before - _resident_bytes(model, optimizer, work)  # the workload's own model, other tests' leftovers
        row = {"synchronized_after_forward": sync, "step_s": time.perf_counter() - started,
               "before_bytes": before, "measured_peak_bytes": torch.cuda.max_memory_allocated(device) - outside,
               "after_forward_bytes": after_forward, "after_bytes": torch.cuda.memory_allocated(device)}
        del loss
        gc.collect()
        row["after_gc_bytes"] = torch.cuda.memory_allocated(device)
        row["runtime"] = dataclasses.asdict(runtime.last_step) if runtime.last_step else None
        rows.append(row)
    runtime.release()
    return rows


def _resident_bytes(model, optimizer, work) -> int:
    """What the step's graph counts before its first op, as the allocator rounds it (512-byte blocks)."""
    state = [v for per_param in optimizer.state.values() for v in per_param.values() if isinstance(v, torch.Tensor)]
    tensors = [*model.parameters(), *model.buffers(), *state, work.example_input, work.target]
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors if t.is_cuda}
    return sum(cuda_block_bytes(n) for n in storages.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=ROOT / "data" / "benchmarks" / "gpu" / "cuda_peaks_probe.json")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("cuda_peaks_probe: no CUDA device here, nothing measured.")
        return
    device = torch.device("cuda", torch.cuda.current_device())
    hardware = ul.Hardware.load("h100-sxm")
    results = []
    for name, batch in CASES:
        work = ul.zoo.get(name, batch=batch, device=device)
        graph = ul.trace(work)
        try:
            plans = _plans(graph, hardware)
        except ul.PlanInfeasible as err:
            results.append({"model": name, "batch": batch, "error": str(err)})
            continue
        for policy, plan in plans.items():
            held = torch.cuda.memory_allocated(device)
            predicted = ul.simulate(graph, plan, hardware=hardware).peak_bytes if plan else graph.cuda_peak_bytes
            steps = _steps(work, plan, device)
            gc.collect()
            torch.cuda.empty_cache()
            results.append({"model": name, "batch": batch, "policy": policy, "simulated_peak_bytes": predicted,
                            "steps": steps, "held_after_bytes": torch.cuda.memory_allocated(device) - held})
            peaks = [s.get("measured_peak_bytes") for s in steps]
            print(f"{name:12s} {policy:15s} simulated {predicted / 2**20:8.0f} MiB, measured step peaks "
                  f"{[round(p / 2**20) if p else None for p in peaks]} MiB", flush=True)
        del work, graph
    document = {"benchmark": "cuda_peaks_probe", "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                "device": torch.cuda.get_device_name(device), "torch": torch.__version__, "results": results}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(document, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
