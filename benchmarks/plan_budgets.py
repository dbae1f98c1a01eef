"""Step time against the budget: ResNet-50 at batch 64, the CUDA step simulated on an H100 profile.

The step is traced as it runs on CUDA (fake tensors, no GPU needed; CPU kernels stand in while
tracing) and every plan is simulated on the ``h100-sxm`` hardware profile: the times are
predictions, not measurements. For budgets of 3, 4 and 5 GiB and the keep-all peak, and
policies keep-all, vdnn++, recompute, checkpoint-segments and auto: does the plan fit, its
predicted step time (and against keep-all's), its simulated peak, what it offloads and
recomputes, and how long planning took. Prints the table and writes JSON.

    python benchmarks/plan_budgets.py [--hardware h100-sxm] [--out data/benchmarks/plan_budgets.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

import udnn_lab as ul
from udnn_lab.devices import device_name
from udnn_lab.planning import POLICIES
from udnn_lab.simulation.simulator import cost_model, simulate_with
from udnn_lab.units import format_bytes

MODEL, BATCH = "resnet50", 64
GIB = 1 << 30
BUDGETS_GIB = (3, 4, 5)
COMPARED = ("keep-all", "vdnn++", "recompute", "checkpoint-segments", "auto")


def table(hardware: str) -> tuple[list[dict], int]:
    graph = ul.trace(ul.zoo.get(MODEL, batch=BATCH, device="meta"), device="cuda")
    cost = cost_model(graph, hardware)
    keep_all_s = simulate_with(graph, POLICIES["keep-all"](graph, cost, None), cost).step_time_s
    rows = []
    for budget in [b * GIB for b in BUDGETS_GIB] + [graph.cuda_peak_bytes]:
        for name in COMPARED:
            start = time.perf_counter()
            chosen = POLICIES[name](graph, cost, budget)
            seconds = time.perf_counter() - start
            sim = simulate_with(graph, chosen, cost)
            rows.append({"budget_bytes": budget, "policy": name, "fits": sim.fits,
                         "step_time_s": sim.step_time_s, "vs_keep_all": sim.step_time_s / keep_all_s,
                         "peak_bytes": sim.peak_bytes, "offloads": len(chosen.offloads),
                         "recomputed_tensors": sum(len(r.tensors) for r in chosen.recomputes),
                         "plan_seconds": seconds, "notes": list(chosen.notes)})
    return rows, graph.cuda_peak_bytes


def _print(rows: list[dict], peak: int) -> None:
    print(f"{MODEL} batch {BATCH}, CUDA step (keep-all peak {format_bytes(peak)}), simulated")
    print(f"{'budget':>10} {'policy':<20} {'fits':<5} {'step ms':>8} {'vs keep':>8} {'peak':>10} "
          f"{'offl':>5} {'recomp':>6}  chose / notes")
    for r in rows:
        print(f"{format_bytes(r['budget_bytes']):>10} {r['policy']:<20} {r['fits']!s:<5} "
              f"{r['step_time_s'] * 1e3:8.2f} {r['vs_keep_all']:8.3f} {format_bytes(r['peak_bytes']):>10} "
              f"{r['offloads']:5d} {r['recomputed_tensors']:6d}  {'; '.join(r['notes'][-1:])}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hardware", default="h100-sxm")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent.parent / "data" / "benchmarks"
                        / "plan_budgets.json")
    args = parser.parse_args()
    torch.set_num_threads(2)
    rows, peak = table(args.hardware)
    _print(rows, peak)
    document = {"benchmark": "plan_budgets", "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                "machine": {"python": platform.python_version(), "torch": torch.__version__,
                            "cpu": device_name("cpu")},
                "model": MODEL, "batch": BATCH, "hardware_profile": args.hardware, "simulated": True,
                "keep_all_peak_bytes": peak, "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(document, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
