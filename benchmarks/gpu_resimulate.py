"""Every run of a committed GPU corpus run simulated again here, with today's simulator, on a machine without a GPU.

The GPU corpus (``benchmarks/gpu_corpus.py``) saves under its diagnostics each model's traced graph, its
``ul.profile`` (op times, op scratch, the host's time to issue each op) and every plan it ran. This reads them
from the run's ``diagnostics-*.tgz`` (or an extracted folder), simulates keep-all and each plan again with the
profile, and prints and writes the measured step and peak beside what the run simulated then and what the
simulator gives now: a change to the cost model or the simulator is judged on the GPU's own measurements.

    python benchmarks/gpu_resimulate.py data/benchmarks/gpu/<run>/ [--out resimulated.json]

The graphs are pickles: read only those the GPU check wrote into this repository.
"""

from __future__ import annotations

import argparse
import gzip
import json
import pickle
import statistics
import sys
import tarfile
import tempfile
from pathlib import Path

from fit_rates import profiles

import udnn_lab as ul


def _rows(run: Path) -> list[dict]:
    """The run's rows, a resumed call's copies of earlier rows once."""
    seen, rows = set(), []
    for path in sorted(run.glob("gpu_corpus*.jsonl")):
        for line in path.read_text().splitlines():
            if not line.strip():
                continue
            row = json.loads(line)
            key = (row.get("model"), row.get("policy"), row.get("budget_kind"), row.get("check"))
            if key not in seen:
                seen.add(key)
                rows.append(row)
    return rows


def _diagnostics(run: Path, into: Path) -> Path:
    """A folder holding the run's diagnostics files, extracted from its tarballs where it has them."""
    tarballs = sorted(run.glob("diagnostics*.tgz"))
    if not tarballs:
        return run / "gpu_corpus" if (run / "gpu_corpus").is_dir() else run
    for tarball in tarballs:
        with tarfile.open(tarball) as archive:
            archive.extractall(into, filter="data")
    found = [p.parent for p in into.rglob("*-graph.pickle.gz")]
    return found[0] if found else into


def resimulated(run: Path, folder: Path) -> list[dict]:
    out = []
    profiled = dict(profiles(folder))  # model -> its ul.profile (fit_rates.py reads them alike)
    graphs: dict[str, ul.Graph] = {}
    for row in _rows(run):
        name = row.get("model")
        graph_file = folder / f"{name}-graph.pickle.gz"
        if row.get("check") or not row.get("measured_step_s") or not graph_file.exists():
            continue
        if name not in graphs:
            with gzip.open(graph_file, "rb") as file:
                graphs[name] = pickle.load(file)
        graph = graphs[name]
        profile = profiled[name].profile if name in profiled else None
        if profile is not None and profile.ops != tuple(op.name for op in graph.ops):
            profile = None
        if row["policy"] == "keep-all":
            plan = None
        elif row.get("plan") and (folder / row["plan"]).exists():
            plan = ul.Plan.load(folder / row["plan"], graph)
        else:
            continue
        sim = ul.simulate(graph, plan, hardware=row.get("hardware"), profile=profile)
        measured = row["measured_step_s"]
        out.append({"model": name, "policy": row["policy"], "budget_kind": row.get("budget_kind"),
                    "with_profile": profile is not None, "measured_step_s": measured,
                    "simulated_then_s": row.get("simulated_step_s"), "simulated_now_s": sim.step_time_s,
                    "error_then": _error(row.get("simulated_step_s"), measured),
                    "error_now": _error(sim.step_time_s, measured),
                    "measured_peak_bytes": row.get("measured_peak_bytes"), "simulated_peak_bytes": sim.peak_bytes})
    return out


def _error(simulated: float | None, measured: float) -> float | None:
    return None if simulated is None else simulated / measured - 1


def _table(rows: list[dict]) -> str:
    lines = [f"{'model':20s} {'plan':18s} {'measured':>9s} {'then':>9s} {'now':>9s} {'err then':>9s} {'err now':>9s}"]
    for r in rows:
        then = "" if r["error_then"] is None else f"{r['error_then']:+.1%}"
        lines.append(f"{r['model']:20s} {r['policy'] + ' ' + str(r['budget_kind'] or ''):18s} "
                     f"{r['measured_step_s'] * 1e3:8.1f}ms {(r['simulated_then_s'] or 0) * 1e3:8.1f}ms "
                     f"{r['simulated_now_s'] * 1e3:8.1f}ms {then:>9s} {r['error_now']:+9.1%}")
    for label in ("error_then", "error_now"):
        errors = [abs(r[label]) for r in rows if r[label] is not None]
        if errors:
            within = sum(e <= 0.10 for e in errors)
            lines.append(f"{label}: median |error| {statistics.median(errors):.1%}, within 10%: {within} of "
                         f"{len(errors)}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", type=Path, help="a folder of data/benchmarks/gpu/")
    parser.add_argument("--out", type=Path, help="write the rows as JSON here")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as scratch:
        folder = _diagnostics(args.run, Path(scratch))
        rows = resimulated(args.run, folder)
    if not rows:
        print(f"{args.run}: no run with a saved graph and plan (GPU runs before the corpus saved them have none)")
        return 0
    print(_table(rows))
    if args.out is not None:
        args.out.write_text(json.dumps({"run": args.run.name, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
