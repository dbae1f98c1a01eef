"""How far the GPU corpus's predictions were from what its runs measured: the distribution of the errors of the
allocated peak (the simulation against torch.cuda.max_memory_allocated) and of the caching allocator's reserved
bytes (its model against max_memory_reserved, as the first step from an emptied cache added them), with the
underestimates counted and the margin that would have left none; and what the process held outside the
allocator (the CUDA context, libraries' workspaces), which a budget counted in reserved bytes adds; and how many
plan runs, and models, had their step simulated within 10% (the promise on step time), the runs off the most first.

An error is predicted / measured - 1: below zero the prediction was short, the case that runs out of memory.
Reads ``gpu_corpus*.jsonl`` (``benchmarks/gpu_corpus.py``'s records) from files or folders; runs anywhere.

    python benchmarks/gpu_errors.py data/benchmarks/gpu/<run> [--out errors.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

MIB = 2**20
STEP_TOLERANCE = 0.10  # a plan's simulated step against its measured one (the GPU check's promise)
MEASURES = {"allocated peak": "peak_error", "with whole blocks": "whole_blocks_error",
            "reserved growth": "reserved_growth_error"}


def records(sources: list[Path]) -> list[dict]:
    files = [f for source in sources for f in (sorted(source.glob("gpu_corpus*.jsonl")) if source.is_dir()
                                                 else [source])]
    if not files:
        raise SystemExit(f"no gpu_corpus*.jsonl in {', '.join(map(str, sources))}: give the folder a GPU run wrote")
    # a second call with --resume appends to the first call's file: a row copied into both counts once
    lines = dict.fromkeys(line for f in files for line in f.read_text().splitlines() if line.strip())
    rows = [json.loads(line) for line in lines]
    for row in rows:  # the simulated peak with the allocator model's whole blocks (NOTE [whole blocks])
        predicted, measured = row.get("allocated_peak_with_whole_blocks_bytes"), row.get("measured_peak_bytes")
        if isinstance(predicted, int) and measured:
            row["whole_blocks_error"] = predicted / measured - 1
    return rows


def distribution(values: list[float]) -> dict:
    """Quantiles of the errors, how many were short (below zero), and the margin that would leave none."""
    if not values:
        return {"runs": 0}
    ordered = sorted(values)
    at = lambda share: ordered[min(len(ordered) - 1, int(share * (len(ordered) - 1) + 0.5))]  # noqa: E731
    short = [v for v in ordered if v < 0]
    return {"runs": len(ordered), "min": ordered[0], "p10": at(0.1), "median": statistics.median(ordered),
            "p90": at(0.9), "max": ordered[-1], "underestimates": len(short),
            "margin_for_none_short": -ordered[0] if short else 0.0}


def summary(rows: list[dict]) -> dict:
    found = {name: distribution([r[key] for r in rows if isinstance(r.get(key), (int, float))])
             for name, key in MEASURES.items()}
    outside = sorted(r["outside_allocator_bytes"] for r in rows if isinstance(r.get("outside_allocator_bytes"), int))
    found["outside allocator"] = {"runs": len(outside), "min_bytes": outside[0], "max_bytes": outside[-1]} \
        if outside else {"runs": 0}
    capped = [r for r in rows if r.get("check") == "capped" and isinstance(r.get("capped_runs"), bool)]
    found["capped"] = {"runs": len(capped), "ran": sum(r["capped_runs"] for r in capped),
                       "out_of_memory": [f"{r['model']} {r['policy']} {r.get('budget_kind') or ''}".strip()
                                         for r in capped if not r["capped_runs"]]}
    # what the first step of a process left allocated beyond its gradients (libraries' workspaces)
    first = sorted(r["left_behind_bytes"][0] for r in rows if r.get("policy") == "keep-all"
                   and r.get("left_behind_bytes") and isinstance(r["left_behind_bytes"][0], int))
    found["left behind"] = {"runs": len(first), "min_bytes": first[0], "max_bytes": first[-1]} if first \
        else {"runs": 0}
    planned = [r for r in rows if r.get("budget_kind") and r.get("check") != "capped"
               and isinstance(r.get("measured_peak_bytes"), int) and isinstance(r.get("budget_bytes"), int)]
    over = [r for r in planned if r["measured_peak_bytes"] > r["budget_bytes"]]
    found["over budget"] = {
        "runs": len(planned), "over": len(over),
        "most_bytes": max((r["measured_peak_bytes"] - r["budget_bytes"] for r in over), default=0),
        "flagged_by_whole_blocks": sum(r.get("allocated_peak_with_whole_blocks_bytes", 0) > r["budget_bytes"]
                                       for r in over),
        "with_whole_blocks": sum("allocated_peak_with_whole_blocks_bytes" in r for r in over)}
    found["plan steps"] = _steps([r for r in rows if r.get("budget_kind") and r.get("check") != "capped"
                                  and isinstance(r.get("step_error"), (int, float))])
    return found


def _steps(rows: list[dict]) -> dict:
    """Plan runs whose simulated step is within STEP_TOLERANCE of the measured one, the models all of whose plan runs
    are (the GPU check's target: at least 12 architectures), and the runs off the most."""
    within = lambda r: abs(r["step_error"]) <= STEP_TOLERANCE  # noqa: E731
    models: dict[str, bool] = {}
    for r in rows:
        models[r["model"]] = models.get(r["model"], True) and within(r)
    off = sorted((r for r in rows if not within(r)), key=lambda r: -abs(r["step_error"]))
    return {"runs": len(rows), "within": sum(map(within, rows)), "models": len(models),
            "models_within": sum(models.values()),
            "largest": [f"{r['model']} {r['policy']} {r['budget_kind']} {r['step_error']:+.1%}" for r in off[:8]]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("sources", type=Path, nargs="+", help="gpu_corpus*.jsonl files, or folders holding them")
    parser.add_argument("--out", type=Path, help="also write the summary as JSON here")
    args = parser.parse_args()
    rows = records(args.sources)
    found = summary(rows)
    print(f"{'measure':18s} {'runs':>5s} {'min':>8s} {'p10':>8s} {'median':>8s} {'p90':>8s} {'max':>8s} "
          f"{'short':>6s} {'margin':>8s}")
    for name in MEASURES:
        d = found[name]
        if not d["runs"]:
            print(f"{name:18s} {0:5d}  not recorded by this run")
            continue
        print(f"{name:18s} {d['runs']:5d} " + " ".join(f"{d[k]:+8.2%}" for k in ("min", "p10", "median", "p90", "max"))
              + f" {d['underestimates']:6d} {d['margin_for_none_short']:8.2%}")
    over = found["over budget"]
    if over["runs"]:
        print(f"over budget: {over['over']} of {over['runs']} plan runs, by up to {over['most_bytes'] / MIB:,.1f} MiB"
              + (f"; the simulated peak with the allocator model's whole blocks is over the budget in "
                 f"{over['flagged_by_whole_blocks']} of the {over['with_whole_blocks']} that record it"
                 if over["with_whole_blocks"] else ""))
    outside = found["outside allocator"]
    if outside["runs"]:
        print(f"outside the allocator: {outside['min_bytes'] / MIB:,.0f} to {outside['max_bytes'] / MIB:,.0f} MiB "
              f"over {outside['runs']} runs")
    capped = found["capped"]
    if capped["runs"]:
        print(f"on a device of the budget's size: {capped['ran']} of {capped['runs']} ran"
              + (f"; out of memory: {', '.join(capped['out_of_memory'])}" if capped["out_of_memory"] else ""))
    steps = found["plan steps"]
    if steps["runs"]:
        print(f"plan steps within {STEP_TOLERANCE:.0%} of simulated: {steps['within']} of {steps['runs']} runs; "
              f"every plan of a model within it: {steps['models_within']} of {steps['models']} models"
              + (f"; off most: {', '.join(steps['largest'])}" if steps["largest"] else ""))
    left = found["left behind"]
    if left["runs"]:
        print(f"left allocated by a process's first step beyond its gradients: {left['min_bytes'] / MIB:,.1f} to "
              f"{left['max_bytes'] / MIB:,.1f} MiB over {left['runs']} models")
    if args.out:
        args.out.write_text(json.dumps({"rows": len(rows), **found}, indent=1))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
