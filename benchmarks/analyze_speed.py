"""Time udnn_lab's analysis against PyTorch's MemTracker, both under FakeTensorMode.

Each (tool, model) pair runs in a fresh Python process so neither inherits the other's
fake-tensor caches; inside it, the step is analyzed twice: 'cold' is the first analysis
in the process (fake-mode start-up included), 'warm' the second. Prints a table and
writes JSON with the machine, versions, date and every timing.

    python benchmarks/analyze_speed.py [--repeats 3] [--out data/benchmarks/analyze_speed.json]

``--suite hf`` times udnn_lab on full-size Hugging Face models built on the meta device
(float32, AdamW, SDPA attention; one also with PEFT LoRA adapters of rank 16): the model's build from its
config, then its trace, cold and warm, against the targets (Llama-3-8B at 4096 tokens in 10 s, Llama-3-70B
at 8192 in 30 s); and MemTracker on the same step of Llama-3-8B without LoRA (the model built under
FakeTensorMode, two steps, the second timed as "warm"; PEFT cannot wrap a model under FakeTensorMode);
Llama-3-70B is left to udnn_lab alone (MemTracker takes about 45 s a step at 8B). It writes
data/benchmarks/analyze_speed_hf.json (needs udnn_lab[hf]).

    python benchmarks/analyze_speed.py --suite hf [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

CASES = {  # name: (zoo name, batch)
    "densenet201": ("densenet201", 64),
    "resnet152": ("resnet152", 64),
    "resnet1001": ("resnet1001", 64),
}
MEMTRACKER_REPEATS = {"resnet1001": 1}  # MemTracker's cost grows with the module count: one run is minutes
HF_CASES = {  # name: (zoo name, batch, sequence length, target seconds for the trace)
    "llama-3-8b@4096": ("hf:llama-3-8b", 1, 4096, 10.0),
    "llama-3-8b-lora16@4096": ("hf:llama-3-8b", 1, 4096, 10.0),
    "llama-3-70b@8192": ("hf:llama-3-70b", 1, 8192, 30.0),
}
HF_OPTIONS = {"llama-3-8b-lora16@4096": {"lora_rank": 16}}  # zoo.get's options beyond the size
HF_MEMTRACKER_CASES = ("llama-3-8b@4096",)  # PEFT cannot wrap a model under FakeTensorMode (its .to() swap fails)
TARGET_SPEEDUP = 6.0
TARGET_RESNET1001_S = 5.0


def worker(tool: str, case: str) -> dict:
    import torch

    torch.set_num_threads(2)
    name, batch = CASES[case]
    timings, peak, detail = [], None, None
    if tool == "udnn_lab":
        import udnn_lab as ul

        work = ul.zoo.get(name, batch=batch, device="meta")
        for _ in range(2):
            start = time.perf_counter()
            graph = ul.trace(work)
            curve = graph.memory_curve()
            timings.append(time.perf_counter() - start)
        peak, detail = graph.peak_bytes, len(curve)
    else:
        peak, detail = _memtracker(name, batch, timings)
    return {"tool": tool, "case": case, "cold_s": timings[0], "warm_s": timings[1], "peak_bytes": peak,
            "rows_of_detail": detail}


def hf_worker(case: str) -> dict:
    import torch

    import udnn_lab as ul

    torch.set_num_threads(2)
    name, batch, seq_len, _ = HF_CASES[case]
    start, start_cpu = time.perf_counter(), time.process_time()
    work = ul.zoo.get(name, batch=batch, seq_len=seq_len, device="meta", **HF_OPTIONS.get(case, {}))
    build_s, build_cpu_s = time.perf_counter() - start, time.process_time() - start_cpu
    timings, cpu_timings = [], []
    for _ in range(2):
        start, start_cpu = time.perf_counter(), time.process_time()
        graph = ul.trace(work)
        graph.memory_curve()
        timings.append(time.perf_counter() - start)
        cpu_timings.append(time.process_time() - start_cpu)
    # CPU seconds as well as wall seconds: on a shared machine the wall clock counts the other users' work too
    return {"tool": "udnn_lab", "case": case, "build_s": build_s, "cold_s": timings[0], "warm_s": timings[1],
            "build_cpu_s": build_cpu_s, "cold_cpu_s": cpu_timings[0], "warm_cpu_s": cpu_timings[1],
            "peak_bytes": graph.peak_bytes, "ops": len(graph.ops)}


def hf_memtracker_worker(case: str) -> dict:
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker

    import udnn_lab as ul

    torch.set_num_threads(2)
    name, batch, seq_len, _ = HF_CASES[case]
    timings, cpu_timings = [], []
    with FakeTensorMode():
        start = time.perf_counter()
        work = ul.zoo.get(name, batch=batch, seq_len=seq_len, device="cpu", **HF_OPTIONS.get(case, {}))
        build_s = time.perf_counter() - start
        for _ in range(2):  # the second step has optimizer state, as udnn_lab's steady-state step
            start, start_cpu = time.perf_counter(), time.process_time()
            tracker = MemTracker()  # one tracker a step: MemTracker tracks a single iteration
            tracker.track_external(work.model, work.optimizer, work.example_input)
            with tracker:
                work.loss_fn(work.model(**work.example_input)).backward()
                work.optimizer.step()
                work.optimizer.zero_grad()
            timings.append(time.perf_counter() - start)
            cpu_timings.append(time.process_time() - start_cpu)
        peak = tracker.get_tracker_snapshot("peak")
    return {"tool": "memtracker", "case": case, "build_s": build_s, "cold_s": timings[0], "warm_s": timings[1],
            "cold_cpu_s": cpu_timings[0], "warm_cpu_s": cpu_timings[1],
            "peak_bytes": int(sum(v.get("Total", 0) for v in peak.values()))}


def run_hf(repeats: int, out: Path) -> dict:
    rows, load_before = [], os.getloadavg()  # the machine may be shared: its load says how far timings can be trusted
    for repeat in range(repeats):  # the cases take turns, so that a change in the machine's load falls on each
        for case in HF_CASES:
            print(f"  {case:22s} run {repeat + 1}/{repeats} ...", file=sys.stderr, flush=True)
            done = subprocess.run([sys.executable, __file__, "--hf-worker", case], check=True, capture_output=True,
                                  text=True, env={**os.environ, "OMP_NUM_THREADS": "2"})
            rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
    tracked = []  # MemTracker once per case: a step takes it most of a minute
    for case in HF_MEMTRACKER_CASES:
        print(f"  {case:22s} MemTracker ...", file=sys.stderr, flush=True)
        done = subprocess.run([sys.executable, __file__, "--hf-worker", case, "--tools", "memtracker"], check=True,
                              capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "2"})
        tracked.append(json.loads(done.stdout.strip().splitlines()[-1]))
    summary = []
    for case, (name, batch, seq_len, target) in HF_CASES.items():
        runs = [r for r in rows if r["case"] == case]
        summary.append({"case": case, "model": name, "batch": batch, "seq_len": seq_len,
                        "options": HF_OPTIONS.get(case, {}), "target_trace_s": target,
                        **{key: statistics.median(r[key] for r in runs)
                           for key in ("build_s", "cold_s", "warm_s", "build_cpu_s", "cold_cpu_s", "warm_cpu_s")},
                        "peak_bytes": runs[0]["peak_bytes"], "ops": runs[0]["ops"],
                        "memtracker": next((r for r in tracked if r["case"] == case), None)})
    document = {"benchmark": "analyze_speed_hf", "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                "machine": _machine(), "load_average_1_5_15_min": {"before": load_before, "after": os.getloadavg()},
                "repeats": repeats, "summary": summary, "runs": rows + tracked}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(document, indent=1))
    print(f"\n{'model':22s} {'ops':>7s} {'build':>7s} {'trace cold':>11s} {'trace warm':>11s} {'(CPU s)':>14s} "
          f"{'target':>7s} {'peak':>10s}")
    for row in summary:
        print(f"{row['case']:22s} {row['ops']:7d} {row['build_s']:6.1f}s {row['cold_s']:10.1f}s {row['warm_s']:10.1f}s "
              f"{row['cold_cpu_s']:6.1f} {row['warm_cpu_s']:6.1f} {row['target_trace_s']:6.0f}s "
              f"{row['peak_bytes'] / 2**30:7.1f}GiB")
        if row["memtracker"] is not None:
            mt = row["memtracker"]
            print(f"{'  MemTracker, same step':22s} {'':>7s} {mt['build_s']:6.1f}s {mt['cold_s']:10.1f}s "
                  f"{mt['warm_s']:10.1f}s {mt['cold_cpu_s']:6.1f} {mt['warm_cpu_s']:6.1f} "
                  f"{'':>7s} {mt['peak_bytes'] / 2**30:7.1f}GiB")
    print(f"\nwrote {out}")
    return document


def _memtracker(name: str, batch: int, timings: list) -> tuple[int, int]:
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker

    import udnn_lab as ul

    with FakeTensorMode():
        work = ul.zoo.get(name, batch=batch, device="cpu")  # built under fake mode: no real weights
        for _ in range(2):  # the second step has optimizer state, as udnn_lab's steady-state step
            start = time.perf_counter()
            tracker = MemTracker()  # one tracker a step: MemTracker tracks a single iteration
            tracker.track_external(work.model, work.optimizer, work.example_input)
            with tracker:
                loss = work.loss_fn(work.model(work.example_input), work.target)
                loss.backward()
                work.optimizer.step()
                work.optimizer.zero_grad()
            timings.append(time.perf_counter() - start)
        peak = tracker.get_tracker_snapshot("peak")
        module_snapshots = sum(len(taken) for stats in tracker.memory_tracking.values()
                               for taken in stats.snapshots.values())
    total = sum(v.get("Total", 0) for v in peak.values())
    return int(total), module_snapshots


def run(repeats: int, out: Path, tools: list[str]) -> dict:
    """Runs already in ``<out>.runs.jsonl`` (from an interrupted run) are kept, not repeated; so are the
    runs in ``out`` of tools not asked for (to re-time udnn_lab alone after a change)."""
    log = out.with_suffix(".runs.jsonl")
    rows = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    if out.exists():
        rows += [r for r in json.loads(out.read_text())["runs"] if r["tool"] not in tools]
    for case in CASES:
        for tool in tools:
            wanted = MEMTRACKER_REPEATS.get(case, repeats) if tool == "memtracker" else repeats
            for repeat in range(sum(r["case"] == case and r["tool"] == tool for r in rows), wanted):
                print(f"  {case:12s} {tool:10s} run {repeat + 1}/{wanted} ...", file=sys.stderr, flush=True)
                done = subprocess.run([sys.executable, __file__, "--worker", tool, case], check=True,
                                      capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "2"})
                rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
                out.parent.mkdir(parents=True, exist_ok=True)
                with log.open("a") as appended:
                    appended.write(json.dumps(rows[-1]) + "\n")
    summary = _summarize(rows)
    document = {
        "benchmark": "analyze_speed", "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": _machine(), "repeats": repeats, "targets": {"speedup": TARGET_SPEEDUP,
                                                              "resnet1001_seconds": TARGET_RESNET1001_S},
        "summary": summary, "runs": rows,
    }
    out.write_text(json.dumps(document, indent=1))
    log.unlink()
    _print(summary)
    print(f"\nwrote {out}")
    return document


def _summarize(rows: list[dict]) -> list[dict]:
    summary = []
    for case in CASES:
        ours = [r for r in rows if r["case"] == case and r["tool"] == "udnn_lab"]
        theirs = [r for r in rows if r["case"] == case and r["tool"] == "memtracker"]
        ours_cold = statistics.median(r["cold_s"] for r in ours)
        theirs_cold = statistics.median(r["cold_s"] for r in theirs)
        ours_warm = statistics.median(r["warm_s"] for r in ours)
        theirs_warm = statistics.median(r["warm_s"] for r in theirs)
        summary.append({
            "case": case, "udnn_lab_cold_s": ours_cold, "memtracker_cold_s": theirs_cold,
            "udnn_lab_warm_s": ours_warm, "memtracker_warm_s": theirs_warm,
            "speedup_cold": theirs_cold / ours_cold, "speedup_warm": theirs_warm / ours_warm,
            "udnn_lab_peak_bytes": ours[0]["peak_bytes"], "memtracker_peak_bytes": theirs[0]["peak_bytes"],
            "udnn_lab_rows": ours[0]["rows_of_detail"], "memtracker_rows": theirs[0]["rows_of_detail"],
        })
    return summary


def _print(summary: list[dict]) -> None:
    print(f"\n{'model':12s} {'udnn_lab cold':>14s} {'MemTracker cold':>16s} {'speedup':>8s} "
          f"{'udnn_lab warm':>14s} {'MemTracker warm':>16s} {'speedup':>8s} {'peak udnn_lab':>14s} {'MemTracker':>11s}")
    for row in summary:
        print(f"{row['case']:12s} {row['udnn_lab_cold_s']:13.2f}s {row['memtracker_cold_s']:15.2f}s "
              f"{row['speedup_cold']:7.1f}x {row['udnn_lab_warm_s']:13.2f}s {row['memtracker_warm_s']:15.2f}s "
              f"{row['speedup_warm']:7.1f}x {row['udnn_lab_peak_bytes'] / 2**30:12.2f}GiB "
              f"{row['memtracker_peak_bytes'] / 2**30:9.2f}GiB")
    print(f"targets: speedup >= {TARGET_SPEEDUP}x (per-op detail); resnet1001 under {TARGET_RESNET1001_S} s")


def _machine() -> dict:
    import torch

    cpu = platform.processor()
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {"device": "cpu", "cpu": cpu, "cores": os.cpu_count(), "threads_used": 2,
            "python": platform.python_version(), "torch": torch.__version__, "platform": platform.platform()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent.parent / "data" / "benchmarks"
                        / "analyze_speed.json")
    parser.add_argument("--tools", nargs="+", default=["udnn_lab", "memtracker"], choices=["udnn_lab", "memtracker"],
                        help="tools to time now; the others' runs are kept from --out")
    parser.add_argument("--suite", choices=["zoo", "hf"], default="zoo",
                        help="zoo: udnn_lab against MemTracker; hf: full-size Hugging Face models (and MemTracker "
                             "on the 8B ones)")
    parser.add_argument("--worker", nargs=2, metavar=("TOOL", "CASE"), help=argparse.SUPPRESS)
    parser.add_argument("--hf-worker", metavar="CASE", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(*args.worker)))
    elif args.hf_worker:
        measure = hf_memtracker_worker if args.tools == ["memtracker"] else hf_worker
        print(json.dumps(measure(args.hf_worker)))
    elif args.suite == "hf":
        run_hf(args.repeats, args.out.with_name("analyze_speed_hf.json"))
    else:
        run(args.repeats, args.out, args.tools)


if __name__ == "__main__":
    main()
