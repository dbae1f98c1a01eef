"""Today's training steps, family by precision, on this machine's CPU: trace, plan, simulate, train.

For a small config (2 layers, hidden 64) of each Hugging Face family and each precision:
the step traced on the meta device against the same step measured here (peak and every op's
live bytes, exact or not); a plan under ``auto``, ``vdnn-all`` and ``recompute`` at a budget
midway between the policy's smallest budget and the keep-all peak, simulated (does it fit?) and
measured under the runtime (the measured peak against the budget); and two training steps under
each plan against two plain ones (``ul.train``; parameters ``torch.equal``). A setup the
step cannot take (a float32 MoE on fake tensors) is a row that says why. Prints the table and
writes JSON.

    python benchmarks/step_matrix.py [--quick] [--out data/benchmarks/step_matrix.json]
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import time
import warnings
from datetime import datetime, timezone
from pathlib import Path

import torch

import udnn_lab as ul
from udnn_lab import zoo
from udnn_lab.devices import device_name
from udnn_lab.errors import UdnnLabError

FAMILIES = ("hf:gpt2", "hf:llama-3-8b", "hf:mistral-7b", "hf:qwen2.5-7b", "hf:bert-base", "hf:vit-b-16",
            "hf:qwen1.5-moe-a2.7b", "hf:mixtral-8x7b")
PRECISIONS = ("32-true", "bf16-mixed", "16-mixed", "bf16-true")
POLICIES = ("auto", "vdnn-all", "recompute")
QUICK = (("hf:llama-3-8b", "bf16-mixed"),)
HARDWARE = ul.Hardware.load("cpu-amd-epyc-2cpu")


def _options(name: str, precision: str) -> dict:
    length = {} if "vit" in name else {"seq_len": 32}
    return {"batch": 2, "small": True, "precision": precision, **length}


def _train(work: ul.Workload, model: torch.nn.Module, plan: ul.Plan | None) -> list[torch.Tensor]:
    optimizer = type(work.optimizer)(model.parameters(), lr=1e-3)
    torch.manual_seed(0)  # the same dropout masks in both runs
    ul.train(model, [(work.example_input, work.target)] * 2, optimizer, loss_fn=work.loss_fn, plan=plan,
             progress=False, precision=work.step_options.precision)
    return [p.detach().clone() for p in model.parameters()]


def case(name: str, precision: str) -> list[dict]:
    base = {"model": name, "precision": precision}
    try:
        graph = ul.trace(zoo.get(name, device="meta", **_options(name, precision)))
    except UdnnLabError as error:
        return [{**base, "traced": False, "why": str(error).split("\n")[0][:300]}]
    work = zoo.get(name, **_options(name, precision))
    summary = ul.measure(work, graph=graph, progress=False).summary(graph)
    plain = _train(work, copy.deepcopy(work.model), None)
    rows = []
    for policy in POLICIES:
        minimum = ul.min_budget(graph, policy, hardware=HARDWARE)
        budget = (minimum + graph.peak_bytes) // 2
        started = time.perf_counter()
        chosen = ul.plan(graph, budget, policy, hardware=HARDWARE)
        simulation = ul.simulate(graph, chosen, hardware=HARDWARE)
        measured = ul.measure(work, graph=graph, plan=chosen, progress=False).summary(graph)
        planned = _train(work, copy.deepcopy(work.model), chosen)
        rows.append({**base, "traced": True, "ops": len(graph.ops), "peak_bytes": graph.peak_bytes,
                     "measured_peak_bytes": summary["measured_peak_bytes"],
                     "trace_exact": summary["peak_relative_error"] == 0 and summary["max_step_relative_error"] == 0,
                     "policy": policy, "budget_bytes": budget, "plan_seconds": time.perf_counter() - started,
                     "offloads": len(chosen.offloads), "recomputed": sum(len(r.tensors) for r in chosen.recomputes),
                     "simulated_peak_bytes": simulation.peak_bytes, "simulated_fits": simulation.fits,
                     "measured_planned_peak_bytes": measured["measured_peak_bytes"],
                     "measured_fits": measured["measured_peak_bytes"] <= budget,
                     "training_equal": all(torch.equal(a, b) for a, b in zip(plain, planned))})
    return rows


def _print(rows: list[dict]) -> None:
    print(f"{'model':<22} {'precision':<11} {'trace':<6} {'policy':<10} {'budget':>10} {'sim peak':>10} "
          f"{'meas peak':>10} {'fits':<5} {'train ==':<8}")
    for r in rows:
        if not r["traced"]:
            print(f"{r['model']:<22} {r['precision']:<11} not traced: {r['why'][:90]}")
            continue
        print(f"{r['model']:<22} {r['precision']:<11} {'exact' if r['trace_exact'] else 'OFF':<6} {r['policy']:<10} "
              f"{ul.format_bytes(r['budget_bytes']):>10} {ul.format_bytes(r['simulated_peak_bytes']):>10} "
              f"{ul.format_bytes(r['measured_planned_peak_bytes']):>10} {r['measured_fits']!s:<5} "
              f"{r['training_equal']!s:<8}")
    done = [r for r in rows if r["traced"]]
    print(f"\n{len({(r['model'], r['precision']) for r in done})} setups traced; "
          f"trace exact: {sum(r['trace_exact'] for r in done)}/{len(done)}; plans fit when measured: "
          f"{sum(r['measured_fits'] for r in done)}/{len(done)}; training equal: "
          f"{sum(r['training_equal'] for r in done)}/{len(done)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="one family at one precision")
    parser.add_argument("--out", type=Path, default=Path("data/benchmarks/step_matrix.json"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", category=FutureWarning)
    cases = QUICK if args.quick else [(name, precision) for name in FAMILIES for precision in PRECISIONS]
    rows = []
    for name, precision in cases:
        started = time.perf_counter()
        found = case(name, precision)
        rows += found
        print(f"{name} {precision}: {time.perf_counter() - started:.1f} s", flush=True)
    _print(rows)
    document = {"machine": {"device": device_name("cpu"), "torch": torch.__version__,
                            "python": platform.python_version(),
                            "date": datetime.now(timezone.utc).isoformat(timespec="seconds")},
                "hardware_profile": HARDWARE.name, "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(document, indent=1, default=str) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
