"""Document 004's co-training study, run in full: Q1-Q4 and the recommendation, printed and saved as JSON.

On a CPU at --size small it takes a few minutes; on a GPU, run it at --size full. With
--repeat 2 the study runs twice and the r values of the two runs are compared (the
acceptance check: within 10%); every run is saved.

    python benchmarks/sharing_study.py [--size small] [--device cpu] [--repeat 2] [--out data/sharing]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import pandas as pd

from udnn_lab import sharing


def main() -> None:
    args = _arguments()
    cores = "auto" if args.cores == "auto" else (None if args.cores == "none" else
                                                  [int(c) for c in args.cores.split(",")])
    results = []
    for index in range(args.repeat):
        began = time.perf_counter()
        result = sharing.run_study(size=args.size, device=args.device, iterations=args.iterations,
                                   min_phase_s=args.min_phase_s, cores=cores, progress=True)
        elapsed = time.perf_counter() - began
        path = Path(args.out) / f"{result.meta['device'].split(':')[0]}-{args.size}-run{index + 1}.json"
        result.save(path)
        _print(result, elapsed, path)
        results.append((result, path, elapsed))
    if len(results) >= 2:
        _compare(results, Path(args.out) / f"{results[0][0].meta['device'].split(':')[0]}-{args.size}-repeat.json")
    failed = sum(len(result.errors) for result, _, _ in results)
    if failed:
        raise SystemExit(f"{failed} job errors in the study (see 'errors' above): its figures are incomplete")


def _arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="small", choices=sharing.SIZES)
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when there is one)")
    parser.add_argument("--iterations", type=int, default=30, help="measured steps per phase, at least")
    parser.add_argument("--min-phase-s", type=float, default=2.0, help="seconds per measured phase, at least")
    parser.add_argument("--cores", default="auto", help="'auto', 'none' or a comma list of cores to pin jobs to")
    parser.add_argument("--repeat", type=int, default=1, help="run the study this many times and compare r")
    parser.add_argument("--out", default="data/sharing")
    return parser.parse_args()


def _print(result: sharing.StudyResult, elapsed: float, path: Path) -> None:
    pd.set_option("display.width", 200)
    pd.set_option("display.max_columns", 20)
    pd.set_option("display.max_colwidth", 70)
    print(f"\n{result!r}: {elapsed:.0f} s, saved to {path}")
    print("\nQ1: median step against the memory cap")
    print(result.q1_summary()[["job", "cap", "cap_bytes", "policy", "median_time_s", "slowdown", "enough"]]
          .to_string(index=False))
    print("\nQ2: r_AB (rows A, columns B)")
    print(result.degradation_matrix().round(3).to_string())
    print(result.pairs[["pair", "r_ab", "r_ba", "combined_throughput", "colocate", "interference", "attempts"]]
          .round(3).to_string(index=False))
    print("\nQ3: operator-mix similarity (normalized Jaccard)")
    print(result.jaccard().round(3).to_string())
    print("\nQ4: alone vs shared, two-sample KS (share of comparisons with the same distribution)")
    ks = result.ks().dropna(subset=["p_value"])
    print(ks.groupby("signal")["same_distribution"].mean().round(2).to_string())
    print("\nrecommendation (principles 1-3)")
    print(result.recommendation()[["pair", "combined_throughput", "colocate", "jaccard", "chosen", "reason"]]
          .round(3).to_string(index=False))
    print(result.memory_recommendation().to_string(index=False))
    print("\ndocument 004's conclusions here")
    print(result.principles()[["item", "measured", "agrees"]].to_string(index=False))
    if len(result.errors):
        print("\nerrors\n" + result.errors.to_string(index=False))


def _compare(results: list, path: Path) -> None:
    table = sharing.compare_runs([r for r, _, _ in results])
    runs = [c for c in table.columns if c.startswith("run")]
    print("\nconsistency of r between runs")
    print(table.round(3).to_string(index=False))
    within = int((table["relative_spread"] <= 0.10).sum())
    print(f"{within} of {len(table)} r values agree within 10%; largest spread {table['relative_spread'].max():.1%}")
    first = results[0][0].meta
    summary = {"device": first["device"], "device_name": first["device_name"], "size": first["size"],
               "versions": first["versions"], "gpu_results": first["gpu_results"],
               "started_at": [r.meta["started_at"] for r, _, _ in results],
               "runs": [p.name for _, p, _ in results], "wall_s": [round(e, 1) for _, _, e in results],
               "within_10_percent": within, "values": len(table),
               "largest_relative_spread": float(table["relative_spread"].max()),
               "r": [{"job": row.job, "partner": row.partner, **{run: float(getattr(row, run)) for run in runs},
                      "relative_spread": float(row.relative_spread)} for row in table.itertuples()]}
    path.write_text(json.dumps(summary, indent=1) + "\n", encoding="utf-8")
    print(f"saved {path}")


if __name__ == "__main__":
    main()
