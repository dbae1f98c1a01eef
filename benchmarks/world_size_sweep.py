"""The world-size sweep of Llama-3-8B: one rank's peak, step time and collectives under DDP, FSDP2 and FSDP2 with
udnn_lab's plan, for 1 to 1024 ranks, and what the whole sweep costs on this machine.

``ul.sweep(work, budgets, world_sizes=...)`` traces one rank per world size and setup (a fake process group, fake
tensors, the model on the meta device: no GPU, no weights) and simulates it on the h100-sxm profile: the figures
are predictions, the seconds are measured here. Batch 1 per rank, 4096 tokens, bf16-mixed, AdamW. Prints the
table and writes JSON.

    python benchmarks/world_size_sweep.py [--worlds 1 2 4 ... 1024] [--workers N] [--out data/benchmarks/...json]

The ranks are traced in up to one process per core (NOTE [sweep processes]); the table's trace and plan seconds
are each rank's own, so on several processes they add up to more than the sweep took. A rank made from traced ones
rather than traced (DDP at every size from one; FSDP2 where the traced sizes' shard rows span its own: NOTE [FSDP
ranks across world sizes]) shows a trace of 0 s.
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
from udnn_lab.fitting._sweep_processes import processes_for

MODEL, BATCH, SEQ_LEN, PRECISION, HARDWARE = "hf:llama-3-8b", 1, 4096, "bf16-mixed", "h100-sxm"
BUDGETS = ("80GB", "40GiB")
SETUPS = ("DDP", "FSDP2", "FSDP2+offload")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worlds", type=int, nargs="+", default=[2 ** k for k in range(11)])
    parser.add_argument("--workers", type=int, default=None,
                        help="processes tracing ranks, this one included (default: one per core)")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent.parent / "data" / "benchmarks"
                        / "world_size_sweep.json")
    args = parser.parse_args()
    torch.set_num_threads(2)
    hardware = ul.Hardware.load(HARDWARE)
    budgets = [hardware.memory_bytes if b == "80GB" else ul.parse_bytes(b) for b in BUDGETS]
    work = ul.zoo.get(MODEL, batch=BATCH, seq_len=SEQ_LEN, device="meta", precision=PRECISION, optimizer="adamw")
    start = time.perf_counter()
    table = ul.sweep(work, budgets, world_sizes=args.worlds, hardware=hardware, setups=list(SETUPS), progress=True,
                     workers=args.workers)
    total_s = time.perf_counter() - start
    ranks = table.drop_duplicates(["world_size", "spec"])
    traces, made = ranks[ranks.trace_s > 0], ranks[ranks.trace_s == 0]  # made: from traced ranks, not traced
    processes = processes_for(len(ranks), args.workers)
    print(f"{MODEL}, batch {BATCH} x {SEQ_LEN} tokens per rank, {PRECISION}, AdamW, on {HARDWARE} (predicted); "
          f"{len(traces)} traces ({traces.trace_s.sum():.1f} s), {len(made)} ranks made from them (DDP: "
          f"{', '.join(map(str, made[made.setup == 'DDP'].world_size))}; FSDP2: "
          f"{', '.join(map(str, made[made.setup == 'FSDP2'].world_size))}), {int((table.plan_s > 0).sum())} plans "
          f"({table.plan_s.sum():.1f} s) in up to {processes} processes: the whole sweep {total_s:.1f} s on this "
          "machine")
    print(f"{'world':>6} {'setup':<14} {'budget':>10} {'fits':>5} {'peak/rank':>11} {'step':>9} {'collectives':>11} "
          f"{'exposed':>8} {'trace':>6} {'plan':>6}")
    for row in table.itertuples():
        step = f"{row.step_time_s * 1e3:7.0f}ms" if row.step_time_s == row.step_time_s else "      -"
        comm = f"{row.communication_s * 1e3:9.0f}ms" if row.communication_s == row.communication_s else "        -"
        exposed = f"{row.exposed_communication_s * 1e3:6.0f}ms" if row.exposed_communication_s == \
            row.exposed_communication_s else "     -"
        print(f"{row.world_size:>6} {row.setup:<14} {ul.format_bytes(row.budget_bytes):>10} {str(row.fits):>5} "
              f"{ul.format_bytes(row.peak_bytes):>11} {step:>9} {comm:>11} {exposed:>8} {row.trace_s:5.1f}s "
              f"{row.plan_s:5.1f}s")
    document = {"benchmark": "world_size_sweep", "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                "machine": {"python": platform.python_version(), "torch": torch.__version__,
                            "cpu": device_name("cpu"), "threads": torch.get_num_threads()},
                "model": MODEL, "batch": BATCH, "seq_len": SEQ_LEN, "precision": PRECISION, "hardware": HARDWARE,
                "predicted": True, "sweep_s": total_s, "traces": len(traces), "made_from_traces": len(made),
                "processes": processes,
                "rows": json.loads(table.to_json(orient="records"))}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(document, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
