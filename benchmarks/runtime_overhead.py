"""Host time the offload runtime adds to a step, against eager and PyTorch's save_on_cpu, in one run.

ResNet-50 at batch 2 and 64x64 on one thread (a step small enough that per-op host time
shows): eager; the runtime with a plan that offloads 10 tensors (every op still goes
through its dispatch mode); torch.autograd.graph.save_on_cpu. Each is the median of --repeats steps after warm-up.
Target (issue 12): at most 2 us of host time per op, or 3% of the eager step.

    python benchmarks/runtime_overhead.py [--device cpu] [--repeats 30] [--out data/benchmarks/runtime_overhead.json]
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import statistics
import sys
import time
from contextlib import nullcontext
from dataclasses import replace
from datetime import datetime, timezone
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import udnn_lab as ul  # noqa: E402
from udnn_lab.analysis.step import compute_loss, split_input  # noqa: E402
from udnn_lab.devices import device_name  # noqa: E402

TARGET_US_PER_OP = 2.0
TARGET_FRACTION = 0.03


def _timed(work, make_context, repeats: int, device: torch.device) -> list[float]:
    model = copy.deepcopy(work.model)
    args, kwargs = split_input(work.example_input)
    times = []
    for index in range(repeats + 3):  # three warm-up steps
        model.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        with make_context():
            compute_loss(model(*args, **kwargs), work.loss_fn, work.target).backward()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if index >= 3:
            times.append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--out", type=Path, default=ROOT / "data" / "benchmarks" / "runtime_overhead.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    device = torch.device(args.device)
    work = ul.zoo.get("resnet50", batch=2, image_size=64, device=device, optimizer="none")
    graph = ul.trace(work)
    hardware = "h100-sxm" if device.type == "cuda" else "cpu-amd-epyc-2cpu"
    everything = ul.plan(graph, None, "vdnn-all", hardware=hardware)
    ten = replace(everything, offloads=everything.offloads[:10]).located(graph)
    forward_backward = sum(op.phase != "optimizer" for op in graph.ops)
    runtime = ul.OffloadRuntime(ten)  # one runtime across steps, as in training: its pool is allocated once
    methods = {
        "eager": nullcontext,
        "udnn_lab runtime, 10 offloads": lambda: runtime,
        "save_on_cpu": lambda: torch.autograd.graph.save_on_cpu(pin_memory=device.type == "cuda"),
    }
    rows = []
    for name, make in methods.items():
        times = _timed(work, make, args.repeats, device)
        rows.append({"method": name, "step_time_s": statistics.median(times), "step_times_s": times})
    eager = rows[0]["step_time_s"]
    for row in rows:
        extra = row["step_time_s"] - eager
        row.update(overhead_s=extra, overhead_fraction=extra / eager, overhead_us_per_op=extra / forward_backward * 1e6)
    ours = rows[1]
    document = {
        "benchmark": "runtime_overhead", "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": {"device": device.type, "device_name": device_name(device), "torch": torch.__version__,
                    "python": platform.python_version(), "threads": 1},
        "model": "resnet50, batch 2, 64x64", "ops_forward_backward": forward_backward,
        "target": {"us_per_op": TARGET_US_PER_OP, "fraction_of_eager": TARGET_FRACTION},
        "meets_target": ours["overhead_us_per_op"] <= TARGET_US_PER_OP
        or ours["overhead_fraction"] <= TARGET_FRACTION,
        "rows": rows,
    }
    print(f"{'method':32s} {'step':>10s} {'overhead':>10s} {'per op':>10s}")
    for row in rows:
        print(f"{row['method']:32s} {row['step_time_s'] * 1e3:8.1f}ms {row['overhead_fraction']:+9.1%} "
              f"{row['overhead_us_per_op']:8.1f}us")
    print(f"target: <= {TARGET_US_PER_OP} us per op or <= {TARGET_FRACTION:.0%} of eager; "
          f"met: {document['meets_target']}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(document, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
