"""Every policy on the zoo at budgets of 30%, 50% and 70% of the keep-all peak, in simulation.

Models are traced as their CUDA training step (no GPU needed) and simulated on a shipped
GPU profile. For each model, budget and policy: does it fit, the predicted step time
relative to keep-all without a budget, bytes moved, pinned host memory, stalls. Also:
how much more pin-dp keeps resident than pin-greedy (document 001 reports up to 20%
more), vdnn++'s pinned memory against vdnn-all's, and how long auto takes to plan a
1,000-layer network. Prints tables and writes JSON.

    python benchmarks/plan_policies.py [--hardware h100-sxm] [--out data/benchmarks/plan_policies.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

import udnn_lab as ul
from udnn_lab.devices import device_name
from udnn_lab.planning import POLICIES
from udnn_lab.planning.pinning import pin_dp, pin_greedy
from udnn_lab.simulation.simulator import cost_model, simulate_with

MODELS = [("alexnet", 128, {}), ("vgg16", 64, {}), ("googlenet", 64, {}), ("inception_v3", 32, {}),
          ("resnet50", 64, {}), ("resnet152", 32, {}), ("densenet121", 32, {}), ("densenet201", 32, {}),
          ("resnet1001", 64, {}), ("lstm", 256, {}), ("transformer", 32, {})]
FRACTIONS = (0.3, 0.5, 0.7)


def compare(hardware: str) -> tuple[list[dict], list[dict]]:
    rows, pinning = [], []
    for name, batch, options in MODELS:
        print(f"  {name} (batch {batch}) ...", file=sys.stderr, flush=True)
        graph = ul.trace(ul.zoo.get(name, batch=batch, device="meta", **options), device="cuda")
        cost = cost_model(graph, hardware)
        base = simulate_with(graph, POLICIES["keep-all"](graph, cost, None), cost)
        for fraction in FRACTIONS:
            budget = int(graph.cuda_peak_bytes * fraction)
            for policy, choose in POLICIES.items():
                start = time.perf_counter()
                chosen = choose(graph, cost, budget)
                planning = time.perf_counter() - start
                sim = simulate_with(graph, chosen, cost)
                rows.append({"model": name, "batch": batch, "fraction": fraction, "budget_bytes": budget,
                             "policy": policy, "fits": sim.fits, "peak_bytes": sim.peak_bytes,
                             "step_time_s": sim.step_time_s, "relative_step_time": sim.step_time_s / base.step_time_s,
                             "d2h_bytes": sim.d2h_bytes, "h2d_bytes": sim.h2d_bytes, "stall_time_s": sim.stall_time_s,
                             "pinned_bytes": chosen.pinned_pool_bytes, "offloads": len(chosen.offloads),
                             "recomputes": len(chosen.recomputes), "planning_s": planning,
                             "keep_all_step_time_s": base.step_time_s, "keep_all_peak_bytes": graph.cuda_peak_bytes})
            pinning.append(_pinning(graph, cost, budget, name, fraction))
    return rows, pinning


def _pinning(graph, cost, budget: int, name: str, fraction: float) -> dict:
    kept = {}
    for label, policy in (("dp", pin_dp), ("greedy", pin_greedy)):
        chosen = policy(graph, cost, budget)
        moved = {o.tensor for o in chosen.offloads}
        candidates = [t for t in graph.tensors if t.category == "feature_map" and t.id not in moved]
        kept[label] = (sum(t.nbytes for t in candidates if t.first_backward_use is not None),
                       simulate_with(graph, chosen, cost).fits)
    more = kept["dp"][0] / kept["greedy"][0] - 1 if kept["greedy"][0] else float("nan")
    return {"model": name, "fraction": fraction, "dp_kept_bytes": kept["dp"][0], "greedy_kept_bytes": kept["greedy"][0],
            "dp_fits": kept["dp"][1], "greedy_fits": kept["greedy"][1], "dp_keeps_more": more}


def planning_time(hardware: str, repeats: int = 3) -> dict:
    graph = ul.trace(ul.zoo.get("resnet1001", batch=64, device="meta"), device="cuda")
    times = {}
    for fraction in FRACTIONS:
        taken = []
        for _ in range(repeats):
            start = time.perf_counter()
            ul.plan(graph, int(graph.cuda_peak_bytes * fraction), "auto", hardware=hardware)
            taken.append(time.perf_counter() - start)
        times[str(fraction)] = statistics.median(taken)
    return {"model": "resnet1001", "ops": len(graph.ops), "auto_plan_seconds": times, "target_seconds": 2.0}


def _print(rows: list[dict], pinning: list[dict], timing: dict) -> None:
    print(f"\n{'model':12s} {'budget':>6s} " + " ".join(f"{p:>10s}" for p in POLICIES))
    for name, _, _ in MODELS:
        for fraction in FRACTIONS:
            cells = []
            for policy in POLICIES:
                row = next(r for r in rows
                           if r["model"] == name and r["fraction"] == fraction and r["policy"] == policy)
                cells.append(f"{row['relative_step_time']:9.2f}x" if row["fits"] else f"{'-':>10s}")
            print(f"{name:12s} {fraction:6.0%} " + " ".join(cells))
    print("(step time relative to keep-all without a budget; '-': does not fit)")
    print(f"\n{'model':12s} {'budget':>6s} {'dp kept':>10s} {'greedy':>10s} {'dp more':>8s}")
    for p in pinning:
        print(f"{p['model']:12s} {p['fraction']:6.0%} {p['dp_kept_bytes'] / 2**20:9.0f}M "
              f"{p['greedy_kept_bytes'] / 2**20:9.0f}M "
              f"{p['dp_keeps_more']:+8.1%}")
    print(f"\nauto on resnet1001 ({timing['ops']} ops): " + ", ".join(f"{k}: {v:.2f}s" for k, v in
                                                             timing["auto_plan_seconds"].items()) + " (target < 2 s)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hardware", default="h100-sxm")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent.parent / "data" / "benchmarks"
                        / "plan_policies.json")
    args = parser.parse_args()
    torch.set_num_threads(2)
    rows, pinning = compare(args.hardware)
    timing = planning_time(args.hardware)
    _print(rows, pinning, timing)
    pp = [(r, next(x for x in rows if x["model"] == r["model"] and x["fraction"] == r["fraction"]
                   and x["policy"] == "vdnn-all"))
          for r in rows if r["policy"] == "vdnn++" and r["fits"]]
    document = {"benchmark": "plan_policies", "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                "machine": {"python": platform.python_version(), "torch": torch.__version__,
                            "cpu": device_name("cpu")},
                "hardware_profile": args.hardware, "simulated": True, "rows": rows, "pinning": pinning,
                "vdnn_plus_plus_pinned_vs_vdnn_all": [{"model": a["model"], "fraction": a["fraction"],
                                                       "ratio": a["pinned_bytes"] / max(b["pinned_bytes"], 1)}
                                                      for a, b in pp],
                "planning_time": timing}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(document, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
