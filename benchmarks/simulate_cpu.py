"""Simulated against measured step time on this machine's CPU (keep everything, no offload).

1. Calibrate: profile a set of models op by op and fit this CPU's rate curve (achieved
   FLOP/s against op size, per kind of op; memory bandwidth; per-op overhead). The
   curve is kept in data/rates/<hardware>.json for the cost model.
2. Validate on other models: ResNet-18, VGG-11 and a 50-layer MLP. For each, the
   measured step time (median of plain steps) against the simulated one, with op times
   (a) from the fitted curve (a prediction: the model was not in the calibration set),
   (b) from the hardware profile's figures alone, (c) from a profile of that very step.
Prints a table and writes JSON with the machine, versions, date and every timing.

    python benchmarks/simulate_cpu.py [--out data/benchmarks/simulate_cpu.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
from datetime import datetime, timezone
from pathlib import Path

import torch

import udnn_lab as ul
from udnn_lab.cost.model import RATES_DIR, RateCurve
from udnn_lab.devices import device_name
from udnn_lab.simulation.simulator import resolve_hardware, simulate

CALIBRATION = [  # (zoo name, batch, options): none of them is validated below
    ("alexnet", 8, {"image_size": 64}), ("vgg16", 4, {"image_size": 64}), ("resnet34", 8, {"image_size": 64}),
    ("resnet50", 4, {"image_size": 64}), ("densenet121", 4, {"image_size": 64}), ("mlp5", 64, {}),
    ("mlp12", 16, {}), ("googlenet", 4, {"image_size": 64}),
]
VALIDATION = [("resnet18", 16, {"image_size": 64}), ("vgg11", 8, {"image_size": 64}), ("mlp50", 64, {})]
TARGET = 0.15


def calibrate(repeats: int) -> tuple[RateCurve, list[dict]]:
    profiles, rows = [], []
    for name, batch, options in CALIBRATION:
        print(f"  profiling {name} (batch {batch}) ...", file=sys.stderr, flush=True)
        prof = ul.profile(ul.zoo.get(name, batch=batch, **options), repeats=repeats)
        profiles.append(prof)
        rows.append({"model": name, "batch": batch, **options, "ops": len(prof.ops), "step_time_s": prof.step_time_s,
                     "op_time_s": prof.op_time_s})
    curve = RateCurve.fit(profiles, source=f"ul.profile of {', '.join(n for n, _, _ in CALIBRATION)} on "
                          f"{device_name('cpu')}, {torch.get_num_threads()} threads, "
                          f"{datetime.now(timezone.utc).date()}")
    return curve, rows


def validate(curve: RateCurve, repeats: int) -> list[dict]:
    hardware = resolve_hardware(None, "cpu")
    rows = []
    for name, batch, options in VALIDATION:
        print(f"  validating {name} (batch {batch}) ...", file=sys.stderr, flush=True)
        work = ul.zoo.get(name, batch=batch, **options)
        graph = ul.trace(work)
        measured = ul.measure(work, repeats=repeats)
        own = ul.profile(work, repeats=repeats)
        predicted = {
            "rate_curve": simulate(graph, hardware=hardware, rates=curve).step_time_s,
            "hardware_figures": simulate(graph, hardware=hardware, rates=False).step_time_s,
            "own_profile": simulate(graph, hardware=hardware, profile=own).step_time_s,
        }
        rows.append({"model": name, "batch": batch, **options, "ops": len(graph.ops),
                     "measured_step_s": measured.step_time_s, "measured_steps_s": list(measured.step_times_s),
                     **{f"simulated_{k}_s": v for k, v in predicted.items()},
                     **{f"error_{k}": (v - measured.step_time_s) / measured.step_time_s for k, v in predicted.items()}})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent.parent / "data" / "benchmarks"
                        / "simulate_cpu.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    curve, calibration = calibrate(args.repeats)
    hardware = resolve_hardware(None, "cpu")
    kept = curve.save(RATES_DIR / f"{hardware.name}.json")
    rows = validate(curve, args.repeats)
    print(f"\n{'model':10s} {'measured':>10s} {'curve':>10s} {'err':>7s} {'hw figs':>10s} {'err':>7s} "
          f"{'own prof':>10s} {'err':>7s}")
    for r in rows:
        print(f"{r['model']:10s} {r['measured_step_s'] * 1e3:9.1f}ms {r['simulated_rate_curve_s'] * 1e3:9.1f}ms "
              f"{r['error_rate_curve']:+7.1%} {r['simulated_hardware_figures_s'] * 1e3:9.1f}ms "
              f"{r['error_hardware_figures']:+7.1%} {r['simulated_own_profile_s'] * 1e3:9.1f}ms "
              f"{r['error_own_profile']:+7.1%}")
    print(f"target: simulated within {TARGET:.0%} of measured; rate curve kept in {kept}")
    document = {"benchmark": "simulate_cpu", "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                "machine": {"device": "cpu", "cpu": device_name("cpu"), "threads": args.threads,
                            "python": platform.python_version(), "torch": torch.__version__,
                            "hardware_profile": hardware.name},
                "target_relative_error": TARGET, "calibration": calibration, "validation": rows,
                "rate_curve": curve.to_dict(), "median_abs_error_rate_curve":
                    statistics.median(abs(r["error_rate_curve"]) for r in rows)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(document, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
