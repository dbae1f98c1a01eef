"""Reserved memory and fragmentation of a training step under allocation heuristics (document 003, vDNN++).

For a few zoo models (traced for CUDA on meta builds: no GPU needed) and the policies
keep-all (the eager step), vdnn-all and vdnn++ at 50% of the step's peak, replay the
step's allocations through the caching allocator model and the other heuristics of
``udnn_lab.allocator.heuristics`` and report, per heuristic, the live, allocated and reserved peaks
and the fragmentation (1 - live peak / reserved peak). A policy that cannot fit 50% is
recorded as infeasible, and planned again at the smallest budget it meets. The
eager step is also run for three steps (best fit), to show the cache settling.
Prints a table and writes JSON with the machine, versions, date and every number.

    python benchmarks/fragmentation.py [--out data/benchmarks/fragmentation.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

import udnn_lab as ul
from udnn_lab.allocator.heuristics import HEURISTICS, compare
from udnn_lab.devices import device_name

MODELS = [("resnet50", 64), ("densenet121", 32), ("vgg16", 64)]
IMAGE_SIZE = 224
POLICIES = [("keep-all", None), ("vdnn-all", 0.5), ("vdnn++", 0.5)]
HARDWARE = "h100-sxm"
GiB = 1 << 30


def run_policy(graph, policy: str, fraction: float | None) -> dict:
    """Plan (at ``fraction`` of the peak, else without a budget), simulate, and compare the heuristics."""
    budget = None if fraction is None else int(graph.cuda_peak_bytes * fraction)
    record = {"policy": policy, "budget_fraction": fraction, "budget_bytes": budget, "status": "planned"}
    try:
        plan = ul.plan(graph, budget=budget, policy=policy, hardware=HARDWARE)
    except ul.PlanInfeasible as err:
        record.update(status="infeasible", infeasible_message=str(err), minimum_budget_bytes=err.minimum_bytes)
        budget = err.minimum_bytes
        plan = ul.plan(graph, budget=budget, policy=policy, hardware=HARDWARE)
        record["planned_at"] = "minimum budget"
    simulation = ul.simulate(graph, plan, hardware=HARDWARE)
    started = time.perf_counter()
    table = compare(graph, plan, simulation=simulation)
    record.update(planned_budget_bytes=budget, offloads=len(plan.offloads), recomputes=len(plan.recomputes),
                  simulated_peak_bytes=simulation.peak_bytes, compare_time_s=time.perf_counter() - started,
                  heuristics=table.to_dict(orient="records"))
    return record


def run_model(name: str, batch: int) -> dict:
    print(f"  tracing {name} (batch {batch}, {IMAGE_SIZE}px) ...", file=sys.stderr, flush=True)
    graph = ul.trace(ul.zoo.get(name, batch=batch, image_size=IMAGE_SIZE, device="meta"), device="cuda")
    runs = [run_policy(graph, policy, fraction) for policy, fraction in POLICIES]
    steady = compare(graph, names=["best-fit"], steps=3).iloc[0]
    return {"model": name, "batch": batch, "image_size": IMAGE_SIZE, "ops": len(graph.ops),
            "cuda_peak_bytes": graph.cuda_peak_bytes, "runs": runs,
            "best_fit_three_steps": {"reserved_peak_bytes": int(steady.reserved_peak_bytes),
                                     "live_peak_bytes": int(steady.live_peak_bytes),
                                     "fragmentation": float(steady.fragmentation)}}


def print_table(models: list[dict]) -> None:
    print(f"\n{'model':12s} {'policy':9s} {'budget':>9s} {'heuristic':23s} {'live GiB':>9s} {'alloc GiB':>9s} "
          f"{'resv GiB':>9s} {'frag':>6s} {'segs':>5s}")
    for model in models:
        for run in model["runs"]:
            budget = "none" if run["budget_bytes"] is None else f"{run['budget_fraction']:.0%}"
            if run["status"] == "infeasible":
                budget = f"min {run['planned_budget_bytes'] / GiB:.2f}"
            for row in run["heuristics"]:
                print(f"{model['model']:12s} {run['policy']:9s} {budget:>9s} {row['heuristic']:23s} "
                      f"{row['live_peak_bytes'] / GiB:9.3f} {row['allocated_peak_bytes'] / GiB:9.3f} "
                      f"{row['reserved_peak_bytes'] / GiB:9.3f} {row['fragmentation']:6.1%} {row['segments']:5d}")
        steady = model["best_fit_three_steps"]
        print(f"{model['model']:12s} keep-all, 3 steps, best-fit: reserved {steady['reserved_peak_bytes'] / GiB:.3f} "
              f"GiB, fragmentation {steady['fragmentation']:.1%}")
    for model in models:
        for run in model["runs"]:
            if run["status"] == "infeasible":
                print(f"infeasible at 50%: {model['model']} {run['policy']}: {run['infeasible_message']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent.parent / "data" / "benchmarks"
                        / "fragmentation.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    started = time.perf_counter()
    models = [run_model(name, batch) for name, batch in MODELS]
    print_table(models)
    document = {
        "benchmark": "fragmentation", "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": {"device": "cpu (no GPU: steps traced for CUDA on meta builds)", "cpu": device_name("cpu"),
                    "cores": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
                    "platform": platform.platform()},
        "hardware_profile": HARDWARE, "allocator": "udnn_lab.allocator.heuristics model of the CUDA caching allocator, "
        "default config (NOTE [modelled allocator behaviour] in udnn_lab/allocator_model.py)",
        "heuristics": {h.name: {"kind": h.kind, "description": h.description} for h in HEURISTICS},
        "fragmentation_definition": "1 - live_peak_bytes / reserved_peak_bytes",
        "total_time_s": time.perf_counter() - started, "models": models,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(document, indent=1, default=_plain))
    print(f"wrote {args.out}")


def _plain(value):
    """numpy scalars and None-like pandas values -> JSON."""
    if hasattr(value, "item"):
        return value.item()
    raise TypeError(f"cannot write {type(value).__name__} to JSON")


if __name__ == "__main__":
    main()
