"""Every GPU test and GPU benchmark in one command: the raw results as one JSON per run.

Steps (each a child process with its own time limit, so one hang or crash does not lose the rest):

    corpus     benchmarks/gpu_corpus.py: 14 models at the sizes people train, every quick policy at three budgets
               (peak against budget and simulation, gradients against eager with an eager control, step time,
               allocator snapshots and kernel times where a run is off; reserved bytes against the allocator
               model's, for benchmarks/gpu_errors.py)
    tests      pytest -m gpu, one record per test (outcome, seconds, failure text) as each ends
               (<out>/pytest-gpu.jsonl, the whole output in <out>/pytest-gpu.log); a test that kills the
               process is recorded as crashed and the rest run on; among them NCCL ranks trained with
               ul.train(..., parallel=...) against their traces (one rank per GPU)
    hardware   Hardware.measure("cuda"): copy sweeps both ways, pinned and pageable, FLOP rates
    peaks      benchmarks/cuda_peaks_probe.py: measured against simulated peaks per policy
    peers      benchmarks/offload_vs_peers.py --device cuda --models resnet50 transformer
               (step time and peak under budgets, largest batch under a cap; about 5 minutes)
    sharing    benchmarks/sharing_study.py --device cuda --size small (co-training study)
    trainers   benchmarks/trainer_callbacks.py --device cuda: the Hugging Face and Lightning callbacks on GPT-2,
               ResNet-50 and Swin-T at the sizes people train (parameters against eager's, peaks from CUDA)

Writes <out>/gpu_check-<device>-<date>.json (machine, versions, date, every step's output,
exit status and seconds), again after every step, so a run cut short keeps what it finished, and each
step's own JSON beside it. Without a CUDA device each step says it was skipped and the command exits 0:
nothing here is ever estimated.

    python benchmarks/gpu_check.py [--steps tests hardware peers sharing] [--out data/benchmarks/gpu] [--total-s 530]
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import platform
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run as a script from a checkout, installed or not
STEPS = ("corpus", "tests", "hardware", "peaks", "peers", "sharing", "trainers")
# within 10 minutes on one H100 or H200 (one call); the corpus takes two such runs into one folder to finish
DEFAULT_STEPS = ("tests", "corpus")  # the tests first: they are quick, and a second call resumes the corpus
WHEELS = ROOT / ".whl"  # made by `make gpu-wheels`, carried to a GPU image that lacks them
EXTRAS = {"altair": "altair", "vl_convert": "vl-convert-python", "nbformat": "nbformat", "nbclient": "nbclient",
          "ipywidgets": "ipywidgets", "anywidget": "anywidget", "highspy": "highspy", "lightning": "lightning",
          "lightning_utilities": "lightning-utilities", "torchmetrics": "torchmetrics"}  # module -> package
LIMIT_S = {"corpus": 420, "tests": 180, "hardware": 120, "peaks": 150, "peers": 420, "sharing": 240, "trainers": 300}


def _machine() -> dict:
    from udnn_lab.measurement import nvml

    props = torch.cuda.get_device_properties(0)
    reading = nvml.read(0)
    return {"device_name": props.name, "total_memory_bytes": props.total_memory,
            "multiprocessors": props.multi_processor_count, "capability": f"{props.major}.{props.minor}",
            "nvml": dataclasses.asdict(reading), "torch": torch.__version__,
            "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version(),
            "python": platform.python_version(), "platform": platform.platform(), "cpu_cores": os.cpu_count(),
            "host_memory": _meminfo()}


def _meminfo() -> dict:
    """Host memory as the kernel reports it: the pinned pool is capped by what is available."""
    try:
        lines = Path("/proc/meminfo").read_text().splitlines()
    except OSError:
        return {}
    wanted = ("MemTotal", "MemAvailable", "MemFree", "Cached")
    return {k: int(v.split()[0]) * 1024 for k, v in (line.split(":", 1) for line in lines) if k in wanted}


def _run(command: list[str], limit_s: int, env: dict[str, str] | None = None, log: Path | None = None) -> dict:
    """``command`` as a child with ``env`` added (a PYTHONPATH beside the checkout's); ``log``: its whole output
    appended there."""
    print(f"\n$ {' '.join(command)}  (limit {limit_s} s)", flush=True)
    started = time.perf_counter()
    added = dict(env or {})
    paths = [str(ROOT), added.pop("PYTHONPATH", ""), os.environ.get("PYTHONPATH", "")]
    child_env = {**os.environ, **added, "PYTHONPATH": os.pathsep.join(p for p in paths if p), "PYTHONUNBUFFERED": "1"}
    try:
        done = subprocess.run(command, cwd=ROOT, env=child_env, capture_output=True, text=True, timeout=limit_s)
        status, out = done.returncode, done.stdout + done.stderr
    except subprocess.TimeoutExpired as stopped:
        status = "timeout"
        out = "".join(part.decode() if isinstance(part, bytes) else (part or "")
                      for part in (stopped.stdout, stopped.stderr))
    seconds = time.perf_counter() - started
    if log is not None:
        with log.open("a") as whole:
            whole.write(f"$ {' '.join(command)}\n{out}\n-> exit {status} after {seconds:.1f} s\n")
    print(out[-6000:], flush=True)
    print(f"-> exit {status} after {seconds:.1f} s", flush=True)
    return {"command": command, "exit": status, "seconds": seconds, "output_tail": out[-20000:]}


def _extras() -> dict:
    """Install from .whl/ the packages the tests import that this Python lacks; what was missing and what came of it."""
    missing = [package for module, package in EXTRAS.items() if importlib.util.find_spec(module) is None]
    if not missing:
        return {"missing": []}
    if not WHEELS.is_dir():
        return {"missing": missing, "installed": False, "why": "no .whl/ here: run make gpu-wheels and carry .whl"}
    result = _run([sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--find-links", str(WHEELS),
                   *missing], 120)
    return {"missing": missing, "installed": result["exit"] == 0, **result}


def _tests(out: Path, limit_s: int, selection: tuple[str, ...] = ("-m", "gpu")) -> dict:
    """pytest -m gpu; where a test kills the process (a segmentation fault in a kernel), it is recorded as crashed and
    the tests not yet run go on in a new process, while the step's time lasts."""
    lines = out / "pytest-gpu.jsonl"
    lines.unlink(missing_ok=True)
    deadline = time.perf_counter() + limit_s
    runs: list[dict] = []
    crashed: dict[str, str] = {}
    while (left := int(deadline - time.perf_counter())) >= 30:
        started = {record["test"] for record in _lines(lines) if record["event"] == "start"}
        result = _run([sys.executable, "-m", "pytest", *selection, "-p", "no:cacheprovider", "-p", "pytest_lines",
                       "-q", "-rfEs", *(["--timeout=90"] if importlib.util.find_spec("pytest_timeout") else []),
                       "--continue-on-collection-errors", *(f"--deselect={test}" for test in sorted(started))],
                      left, {"UDNN_TEST_LINES": str(lines), "PYTHONPATH": str(ROOT / "benchmarks")},
                      out / "pytest-gpu.log")
        runs.append({key: value for key, value in result.items() if key != "output_tail"})
        records = _lines(lines)
        ended = {record["test"] for record in records if record["event"] != "start"}
        dying = [record["test"] for record in records if record["event"] == "start" and record["test"] not in ended]
        if not (isinstance(result["exit"], int) and result["exit"] < 0 and dying):
            break
        crashed[dying[-1]] = result["output_tail"][-4000:]
    return {"runs": runs, "exit": _exit(runs, crashed), "seconds": sum(run["seconds"] for run in runs),
            "output_tail": result["output_tail"] if runs else "", "tests": _cases(_lines(lines), crashed)}


def _lines(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _cases(records: list[dict], crashed: dict[str, str]) -> list[dict]:
    """One record per test: its outcome (a failed setup or teardown counts as an error), seconds and failure text."""
    cases: dict[str, dict] = {}
    for record in records:
        if record["event"] == "start":
            cases.setdefault(record["test"], {"test": record["test"], "outcome": "passed", "seconds": 0.0,
                                              "message": ""})
            continue
        case = cases[record["test"]]
        case["seconds"] += record["seconds"]
        if record["outcome"] != "passed" and case["outcome"] == "passed":
            case["outcome"] = {"skipped": "skipped"}.get(record["outcome"],
                                                         "failed" if record["event"] == "call" else "error")
            case["message"] = record["message"]
    for test, output in crashed.items():
        cases[test].update(outcome="crashed", message=output)
    return list(cases.values())


def _exit(runs: list[dict], crashed: dict[str, str]) -> int | str:
    if crashed:
        return "crashed"
    return runs[-1]["exit"] if runs else "no time"


def _hardware(out: Path, limit_s: int) -> dict:
    code = ("import json, sys, udnn_lab as ul\n"
            "profile, sweep = ul.Hardware.measure_with_sweep('cuda', progress=False)\n"
            f"profile.save({str(out / 'hardware-measured.json')!r})\n"
            f"sweep.to_json({str(out / 'hardware-sweep.json')!r}, orient='records', indent=1)\n"
            "print(json.dumps(profile.to_dict(), indent=1, default=str))\n")
    return _run([sys.executable, "-c", code], limit_s)


def _corpus(out: Path, limit_s: int) -> dict:
    # --resume: a second run into the same folder (the next call in one lease) goes on with the models not done
    return _run([sys.executable, "benchmarks/gpu_corpus.py", "--out", str(out), "--resume", "--total-s",
                 str(max(limit_s - 15, 10))], limit_s)


def _peaks(out: Path, limit_s: int) -> dict:
    return _run([sys.executable, "benchmarks/cuda_peaks_probe.py", "--out", str(out / "cuda_peaks_probe.json")],
                limit_s)


def _peers(out: Path, limit_s: int) -> dict:
    return _run([sys.executable, "benchmarks/offload_vs_peers.py", "--device", "cuda", "--models", "resnet50",
                 "transformer", "--out", str(out / "offload_vs_peers-cuda.json")], limit_s)


def _sharing(out: Path, limit_s: int) -> dict:
    return _run([sys.executable, "benchmarks/sharing_study.py", "--device", "cuda", "--size", "small",
                 "--out", str(out / "sharing")], limit_s)


def _trainers(out: Path, limit_s: int) -> dict:
    return _run([sys.executable, "benchmarks/trainer_callbacks.py", "--device", "cuda", "--models", "hf:gpt2",
                 "resnet50", "swin_t", "--out", str(out / "trainer_callbacks-cuda.json")], limit_s)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", nargs="+", default=list(DEFAULT_STEPS), choices=STEPS)
    parser.add_argument("--out", type=Path, default=ROOT / "data" / "benchmarks" / "gpu")
    parser.add_argument("--total-s", type=float, help="seconds for every step together (a lease's call): each step "
                        "gets its own limit or what is left, whichever is less")
    args = parser.parse_args()
    deadline = None if args.total_s is None else time.monotonic() + args.total_s
    if not torch.cuda.is_available():
        for step in args.steps:
            print(f"gpu-check: {step}: skipped, this machine has no CUDA device (nothing run, nothing written)")
        return
    args.out.mkdir(parents=True, exist_ok=True)
    date = datetime.now(timezone.utc)
    machine = {**_machine(), "extras": _extras()}
    print(json.dumps(machine, indent=1), flush=True)
    slug = machine["device_name"].lower().replace("nvidia ", "").replace(" ", "-")
    path = args.out / f"gpu_check-{slug}-{date:%Y%m%dT%H%M%S}.json"
    steps: dict[str, dict] = {}
    for step in args.steps:
        limit_s = LIMIT_S[step]
        if deadline is not None:
            left = int(deadline - time.monotonic())
            if left < 30:
                steps[step] = {"exit": "not run", "seconds": 0, "output_tail": f"{left} s of --total-s were left"}
                continue
            limit_s = min(limit_s, left)
        steps[step] = {"corpus": _corpus, "tests": _tests, "hardware": _hardware, "peaks": _peaks, "peers": _peers,
                       "sharing": _sharing, "trainers": _trainers}[step](args.out, limit_s)
        document = {"check": "gpu_check", "date": date.isoformat(timespec="seconds"), "machine": machine,
                    "steps": steps, "steps_left": args.steps[len(steps):]}
        path.write_text(json.dumps(document, indent=1, default=str))  # as it goes: a run cut short keeps these
    print(f"\nwrote {path}")
    failed = [name for name, step in steps.items() if step["exit"] not in (0, "not run")]
    print("all steps passed" if not failed else f"steps that failed: {', '.join(failed)}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
