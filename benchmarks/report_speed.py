"""Time ``udnn-lab report`` end to end, with ``udnn-lab analyze`` of the same model for comparison.

Each run is the command in a fresh Python process (``python -m udnn_lab.cli``), timed from
start to exit: wall time, and the CPU time of the process and its children (the report's
kernel included). Runs alternate between the commands (and the source trees), so that a
machine shared with others loads them alike; the load average before each run is recorded
beside it, and the 1, 5 and 15-minute load averages at the start and the end. Prints a table
of medians and writes JSON with the machine, versions, date and every run.

    python benchmarks/report_speed.py [--repeats 5] [--model resnet18 --batch 8 --budget 1GiB]
        [--compare ../other-checkout] [--out data/benchmarks/report_speed.json]

``--compare DIR`` times the udnn_lab in another source tree too (put first on PYTHONPATH), e.g.
a checkout of the commit before a change.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TARGET_REPORT_S = 8.0


def commands(model: str, batch: int, budget: str, out: Path) -> dict[str, list[str]]:
    return {"report": ["report", model, "--batch", str(batch), "--budget", budget, "--out", str(out)],
            "analyze": ["analyze", model, "--batch", str(batch)]}


def time_once(tree: Path, words: list[str], scratch: Path) -> dict:
    """One run of ``udnn-lab WORDS`` with ``tree`` first on the path: wall and CPU seconds, the load before it.

    It runs in ``scratch``: ``python -m`` puts the working directory before PYTHONPATH, so a run
    started in a checkout would import that checkout's udnn_lab whatever the tree asked for.
    """
    env = _env(tree)
    load = os.getloadavg()[0]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "udnn_lab.cli", *words], capture_output=True, text=True, env=env,
                          cwd=scratch)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        raise SystemExit(f"udnn-lab {' '.join(words)} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {"wall_s": wall, "cpu_s": cpu, "load_before": load, "warned_about_encryption":
            "without encryption" in done.stderr}


def run(trees: dict[str, Path], repeats: int, model: str, batch: int, budget: str, out: Path) -> dict:
    rows = []
    load_at_start = _load_averages()
    with tempfile.TemporaryDirectory(prefix="report-speed-") as scratch:
        cases = commands(model, batch, budget, Path(scratch) / "report.html")
        _check_imports(trees, Path(scratch))
        for repeat in range(repeats):
            for label, tree in trees.items():
                for command, words in cases.items():
                    if command == "analyze" and label != "this tree":
                        continue  # analyze is the yardstick: timed in this tree only
                    print(f"  {label:10s} {command:8s} run {repeat + 1}/{repeats} ...", file=sys.stderr, flush=True)
                    rows.append({"tree": label, "command": command, **time_once(tree, words, Path(scratch))})
    summary = []
    for label in trees:
        for command in cases:
            runs = [r for r in rows if r["tree"] == label and r["command"] == command]
            if runs:
                walls = [r["wall_s"] for r in runs]
                summary.append({"tree": label, "command": command, "median_wall_s": statistics.median(walls),
                                "min_wall_s": min(walls), "max_wall_s": max(walls),
                                "median_cpu_s": statistics.median(r["cpu_s"] for r in runs),
                                "median_load_before": statistics.median(r["load_before"] for r in runs)})
    document = {"benchmark": "report_speed", "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                "machine": _machine(), "case": {"model": model, "batch": batch, "budget": budget},
                "trees": {label: _describe(tree) for label, tree in trees.items()}, "repeats": repeats,
                "load_average_at_start": load_at_start, "load_average_at_end": _load_averages(),
                "target_report_s": TARGET_REPORT_S, "summary": summary, "runs": rows}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(document, indent=1))
    _print(document)
    print(f"\nwrote {out}")
    return document


def _load_averages() -> dict[str, float]:
    """The machine's load averages (runnable processes, others' included) over the last 1, 5 and 15 minutes."""
    return dict(zip(("1min", "5min", "15min"), os.getloadavg()))


def _env(tree: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(tree), os.environ.get("PYTHONPATH")]))}


def _check_imports(trees: dict[str, Path], scratch: Path) -> None:
    """Each tree's run imports that tree's udnn_lab."""
    for label, tree in trees.items():
        found = subprocess.run([sys.executable, "-c", "import udnn_lab; print(udnn_lab.__file__)"], cwd=scratch,
                               env=_env(tree), capture_output=True, text=True, check=True).stdout.strip()
        if not Path(found).resolve().is_relative_to(tree.resolve()):
            raise SystemExit(f"{label}: python imports udnn_lab from {found}, not from {tree}")


def _print(document: dict) -> None:
    case = document["case"]
    start, end = document["load_average_at_start"], document["load_average_at_end"]
    print(f"\n{case['model']}, batch {case['batch']}, budget {case['budget']}; {document['repeats']} runs each, "
          f"{document['machine']['cores']} cores; load average (1, 5, 15 min) {start['1min']:.2f} "
          f"{start['5min']:.2f} {start['15min']:.2f} at the start, {end['1min']:.2f} {end['5min']:.2f} "
          f"{end['15min']:.2f} at the end")
    print(f"{'tree':30s} {'command':8s} {'wall median':>12s} {'min':>7s} {'max':>7s} {'CPU median':>11s} "
          f"{'load before':>12s}")
    for row in document["summary"]:
        tree = f"{row['tree']} ({document['trees'][row['tree']]['commit']})"
        print(f"{tree:30s} {row['command']:8s} {row['median_wall_s']:11.2f}s {row['min_wall_s']:6.2f}s "
              f"{row['max_wall_s']:6.2f}s {row['median_cpu_s']:10.2f}s {row['median_load_before']:12.2f}")
    print(f"target: report within {document['target_report_s']:.0f} s of wall time. CPU is the commands' own and "
          "their children's (the report's kernel); the load average is the machine's, others' work included")


def _describe(tree: Path) -> dict:
    commit = subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run(["git", "-C", str(tree), "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True)
    name = commit.stdout.strip() or "unknown"
    return {"commit": name + ("+changes" if dirty.stdout.strip() else "")}


def _machine() -> dict:
    import torch

    cpu = platform.processor()
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
            "python": platform.python_version(), "torch": torch.__version__, "platform": platform.platform()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--model", default="resnet18")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--budget", default="1GiB")
    parser.add_argument("--compare", type=Path, help="another source tree whose report is timed alongside")
    parser.add_argument("--out", type=Path, default=ROOT / "data" / "benchmarks" / "report_speed.json")
    args = parser.parse_args()
    trees = {"this tree": ROOT}
    if args.compare is not None:
        if not (args.compare / "udnn_lab" / "report").is_dir():
            parser.error(f"--compare {args.compare}: no udnn_lab/report there; give the root of a udnn_lab checkout")
        trees["compared"] = args.compare.resolve()
    run(trees, args.repeats, args.model, args.batch, args.budget, args.out)


if __name__ == "__main__":
    main()
