"""Simulated against measured step time on this CPU, for every quick policy: the host-bound proxy of a GPU run.

On a GPU, the host work a plan adds per op (a Python dispatch mode when the runtime follows a step op by
op) becomes the step once ops are small. On one CPU thread, with small inputs, the same host work shows
directly. For each workload (ResNet-50 batch 2 at 64x64, the zoo transformer, a small GPT-2 decoder):
``ul.profile`` measures every op and what a pass-through dispatch mode costs that step per op; each
quick policy is planned at a budget midway between its smallest and the keep-all peak, at 50% of
that peak where it fits, and 5% above its smallest (as the GPU check plans), and simulated with that
profile; then eager steps and steps under the runtime are timed in turn. The figure compared is the
slowdown against eager, measured and simulated, with the simulation also shown without the host work
priced (the dispatch mode, and the runtime's hook calls, offload actions, its work once per step and
replays its host probes measured: what it said before it priced them). The hook-call and offload
figures are measured in the same run, on its thread, by the runtime's host probe, and, where they show
above the step's variation, on the workload's own step (with its work per step) by its step probe, which also
times the step under recomputations the runtime records and replays (of the middle half of the forward, of nearly
all of it and of several short pieces spread over it) for what each re-run op, each recomputation and a step that
records cost it (else a replay's stand-in on the workload's own forward), and under a re-run of each call of its
repeated block for what each re-run call costs, and
the copies the runtime makes in the step (a CPU's copies run from its caches or from memory: not at the machine
profile's largest-copy rate), within ``ul.profile`` (NOTE [host probes] 4). Within a round the
steps run in a shuffled order (a step right after a longer one runs at another pace). Steps are run as
``run_step`` runs them, the step a profile times.
Target: every plan's measured slowdown within 3% of its simulated one.

Then each workload against torch.utils.checkpoint over its blocks (a ResNet's stages, the zoo
transformer's layers, a Hugging Face model's own gradient checkpointing; non-reentrant), timed on
one thread: ours, the ``recompute`` and ``auto`` plans for the peak checkpoint measured, at that
peak or lower. Target: ours no slower than checkpoint at an equal or lower peak.

    python benchmarks/host_proxy.py [--quick] [--repeats 15] [--out data/benchmarks/host_proxy.json]
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import os
import platform
import random
import statistics
import sys
import time
from contextlib import nullcontext
from datetime import datetime, timezone
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import udnn_lab as ul  # noqa: E402
from benchmarks.offload_vs_peers import Bench, checkpointed, on_model, ours  # noqa: E402
from udnn_lab.analysis.step import run_step, split_input  # noqa: E402
from udnn_lab.devices import device_name  # noqa: E402
from udnn_lab.errors import PlanInfeasible  # noqa: E402
from udnn_lab.hardware.host_probes import host_probes  # noqa: E402

TARGET = 0.03
ROUNDS_S = 30.0  # what the timed rounds of one workload's plans may take, where its steps are short
# GPT-2 without its key and value cache: a training step never reads it, transformers' own gradient checkpointing
# (the peer below) passes its blocks none, and a block that takes a cache is not re-run. Every step here is traced
# as it runs (ul.trace(..., fake=False)), the step ul.profile measures
WORKLOADS = [("resnet50", {"batch": 2, "image_size": 64}), ("transformer", {"batch": 2}),
             ("hf:gpt2", {"batch": 2, "small": True, "seq_len": 64, "config_overrides": {"use_cache": False}})]
QUICK_WORKLOADS = [("resnet18", {"batch": 16, "image_size": 32})]
POLICIES = ("auto", "vdnn++", "recompute", "checkpoint-segments", "pin-greedy")


def _steps(work: ul.Workload, contexts: dict, repeats: int, models: dict | None = None) -> dict[str, float]:
    """Median CPU seconds of forward and backward under each context, taken in turn, in an order shuffled each round
    (a change in load hits all alike):
    ``repeats`` rounds, or as many as ROUNDS_S allows where a round is short (up to 10 times as many: a step of a few
    milliseconds varies by a few percent); ``models``: a model of its own for some contexts (by default each runs a
    copy of the workload's)."""
    own = models or {}
    models = {name: own[name] if name in own else copy.deepcopy(work.model) for name in contexts}
    args, kwargs = split_input(work.example_input)
    times: dict[str, list[float]] = {name: [] for name in contexts}
    rounds, index = repeats + 2, 0
    order = random.Random(0)
    while index < rounds:
        started = time.perf_counter()
        # in a new order each round: a step right after a longer one runs at another pace (the caches it left)
        for name in order.sample(list(contexts), len(contexts)):
            context, model = contexts[name], models[name]
            start = time.process_time()
            with on_model(context(), model):  # the step as a profile times it: as a training loop runs it
                run_step(model, args, kwargs, loss_fn=work.loss_fn, target=work.target, replay_views=False)
            if index >= 2:  # two warm-up rounds
                times[name].append(time.process_time() - start)
        if index == 1:
            rounds = 2 + max(repeats, min(10 * repeats, int(ROUNDS_S / (time.perf_counter() - started))))
        index += 1
    return {name: statistics.median(values) for name, values in times.items()}


def _budgets(graph: ul.Graph, policy: str, hardware: ul.Hardware, profile: ul.Profile) -> dict[str, int]:
    try:
        smallest = ul.min_budget(graph, policy, hardware, profile)
    except PlanInfeasible:
        return {}
    budgets = {"midway": (smallest + graph.peak_bytes) // 2}
    if smallest <= graph.peak_bytes // 2:
        budgets["50%"] = graph.peak_bytes // 2
    if int(smallest * 1.05) < budgets["midway"]:  # the GPU check's third budget: where plans do the most
        budgets["min+5%"] = int(smallest * 1.05)
    return budgets


def _rows(name: str, options: dict, repeats: int) -> list[dict]:
    work = ul.zoo.get(name, optimizer="none", **options)
    profile = ul.profile(work, repeats=repeats)
    graph = ul.trace(work, fake=False)
    unpriced = dataclasses.replace(profile, dispatch_mode_op_s=None, replay_op_s=None, replay_recompute_s=None,
                                   recording_step_s=None, rerun_call_s=None, hook_call_s=None, offload_action_s=None,
                                   runtime_step_s=None)
    hardware = ul.Hardware.load("cpu-amd-epyc-2cpu")
    # the runtime's host figures measured now, on this run's thread, as the step's own figures are (Hardware.measure's
    # probes: NOTE [host probes]); the shipped profile's were measured on another day, on two threads
    figures: dict[str, float] = {}
    for probe in host_probes():
        figures.update(probe(torch.device("cpu"), repeats, {}).figures)
    hardware = dataclasses.replace(hardware, dispatch_mode_op_s=None, device_names=(profile.device_name,), **figures)
    bare = dataclasses.replace(hardware, hook_call_s=None, offload_action_s=None, replay_op_s=None)
    keep_all = ul.simulate(graph, hardware=hardware, profile=profile).step_time_s
    plans = {}
    for policy in POLICIES:
        for kind, budget in _budgets(graph, policy, hardware, profile).items():
            plan = ul.plan(graph, budget, policy, hardware=hardware, profile=profile)
            if plan.offloads or plan.recomputes:
                plans[f"{policy} {kind}"] = plan
    runtimes = {label: ul.OffloadRuntime(plan) for label, plan in plans.items()}
    measured = _steps(work, {"eager": nullcontext, **{label: (lambda r=r: r) for label, r in runtimes.items()}},
                      repeats)
    rows = []
    for label, plan in plans.items():
        simulated = ul.simulate(graph, plan, hardware=hardware, profile=profile).step_time_s / keep_all
        before = ul.simulate(graph, plan, hardware=bare, profile=unpriced).step_time_s / keep_all
        slowdown = measured[label] / measured["eager"]
        rows.append({
            "workload": name, "options": options, "ops": len(graph.ops), "plan": label,
            "budget_bytes": plan.budget_bytes, "offloads": len(plan.offloads),
            "recomputes": len(plan.recomputes), "followed_by": runtimes[label].follows,
            "dispatch_mode_op_s": profile.dispatch_mode_op_s, "hook_call_s": profile.hook_call_s,
            "machine_hook_call_s": hardware.hook_call_s,
            "offload_action_s": profile.offload_action_s, "machine_offload_action_s": hardware.offload_action_s,
            "runtime_step_s": profile.runtime_step_s, "replay_op_s": profile.replay_op_s,
            "replay_recompute_s": profile.replay_recompute_s, "recording_step_s": profile.recording_step_s,
            "rerun_call_s": profile.rerun_call_s,
            "machine_replay_op_s": hardware.replay_op_s, "copy_bytes_per_s": profile.copy_bytes_per_s,
            "machine_copy_bytes_per_s": hardware.d2h_pinned_bytes_per_s,
            "hook_calls": sum(plan.hook_calls(graph).values()), "rerun_ops": sum(len(r.ops) for r in plan.recomputes),
            "eager_s": measured["eager"],
            "step_s": measured[label], "measured_slowdown": slowdown, "simulated_slowdown": simulated,
            "simulated_slowdown_unpriced": before, "error": slowdown / simulated - 1,
            "error_unpriced": slowdown / before - 1, "within_target": abs(slowdown / simulated - 1) <= TARGET,
        })
    return rows


def _against_checkpoint(name: str, options: dict, repeats: int) -> list[dict]:
    """torch.utils.checkpoint over the model's blocks, then our plans for the peak it measured (module docstring).

    Peaks are counted by the benchmark's live-bytes counter; times are taken apart from it (its dispatch
    mode would cost each op more than some of these ops take, and checkpoint runs more ops), on one
    thread, every method in turn as the rows above are."""
    batch = options["batch"]
    # forward and backward only, as the rows above and as the peak is counted (no optimizer step)
    bench = Bench(name, batch, {**{k: v for k, v in options.items() if k != "batch"}, "optimizer": "none"},
                  torch.device("cpu"), 3, fake=False)
    base = {"workload": name, "options": options}
    model = checkpointed(copy.deepcopy(bench.work.model))
    if model is None:
        return [{**base, "method": "torch.utils.checkpoint", "note": "no blocks to checkpoint in this model"}]
    eager = bench.measure(nullcontext)
    peer = bench.measure(nullcontext, model)
    # the peak here counts the step's storages from the first op; the plan's budget is in the graph's accounting:
    # checkpoint's peak in that accounting is its own plus what the graph counts beyond the eager step measured here
    budget = peer["peak_bytes"] + bench.predicted_peak - eager["peak_bytes"]
    ours_rows, contexts = [], {"eager": nullcontext, "torch.utils.checkpoint": nullcontext}
    for policy in ("recompute", "auto"):
        row = {**base, "method": f"udnn_lab {policy} at checkpoint's peak", "budget_bytes": budget}
        try:
            factory, _ = ours(bench, policy, budget)
        except PlanInfeasible as err:  # checkpoint goes lower than this policy: compared at the least it meets
            smallest = ul.min_budget(bench.graph, policy, hardware=bench.hardware)
            row = {**row, "method": f"udnn_lab {policy} at its smallest budget", "budget_bytes": smallest,
                   "note": str(err).splitlines()[0]}
            factory, _ = ours(bench, policy, smallest)
        ours_rows.append({**row, "peak_bytes": bench.measure(factory)["peak_bytes"]})
        contexts[row["method"]] = factory
    seconds = _steps(bench.work, contexts, repeats, models={"torch.utils.checkpoint": model})
    rows = [{**base, "method": "torch.utils.checkpoint", "step_s": seconds["torch.utils.checkpoint"],
             "peak_bytes": peer["peak_bytes"], "slowdown": seconds["torch.utils.checkpoint"] / seconds["eager"],
             "eager_s": seconds["eager"], "eager_peak_bytes": eager["peak_bytes"],
             "predicted_keep_all_peak_bytes": bench.predicted_peak}]
    for row in ours_rows:
        step_s = seconds[row["method"]]
        rows.append({**row, "step_s": step_s, "slowdown": step_s / seconds["eager"],
                     "speedup_over_checkpoint": seconds["torch.utils.checkpoint"] / step_s,
                     "at_most_its_peak": row["peak_bytes"] <= peer["peak_bytes"],
                     "no_slower": step_s <= seconds["torch.utils.checkpoint"]})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="one small workload (CI)")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--out", type=Path, default=ROOT / "data" / "benchmarks" / "host_proxy.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = []
    for name, options in QUICK_WORKLOADS if args.quick else WORKLOADS:
        rows.extend(_rows(name, options, args.repeats))
    print(f"{'workload':12s} {'plan':28s} {'follows':10s} {'measured':>9s} {'simulated':>9s} {'error':>7s} "
          f"{'unpriced':>9s} {'error':>7s}")
    for row in rows:
        print(f"{row['workload']:12s} {row['plan']:28s} {row['followed_by'][:10]:10s} "
              f"{row['measured_slowdown']:8.3f}x {row['simulated_slowdown']:8.3f}x {row['error']:+7.1%} "
              f"{row['simulated_slowdown_unpriced']:8.3f}x {row['error_unpriced']:+7.1%}")
    met = bool(rows) and all(row["within_target"] for row in rows)
    print(f"target: every plan's measured slowdown within {TARGET:.0%} of its simulated one; met: {met} "
          f"({sum(r['within_target'] for r in rows)} of {len(rows)})")
    against = [row for name, options in (QUICK_WORKLOADS if args.quick else WORKLOADS)
               for row in _against_checkpoint(name, options, args.repeats)]
    print(f"\n{'workload':12s} {'method':40s} {'slowdown':>9s} {'peak':>10s} {'vs checkpoint':>14s}")
    for row in against:
        if "step_s" not in row:
            print(f"{row['workload']:12s} {row['method']:40s} {row['note']}")
            continue
        if "note" in row:
            print(f"{'':12s} {row['note']}")
        versus = f"{row['speedup_over_checkpoint']:.3f}x faster" if "speedup_over_checkpoint" in row else ""
        print(f"{row['workload']:12s} {row['method']:40s} {row['slowdown']:8.3f}x {row['peak_bytes'] / 2**20:9.1f}M "
              f"{versus:>14s}")
    ours_rows = [row for row in against if "no_slower" in row and row["method"].startswith("udnn_lab recompute")]
    checkpoint_met = bool(ours_rows) and all(row["no_slower"] and row["at_most_its_peak"] for row in ours_rows)
    print(f"target: the recompute plan no slower than torch.utils.checkpoint at an equal or lower peak; met: "
          f"{checkpoint_met} ({sum(r['no_slower'] and r['at_most_its_peak'] for r in ours_rows)} of {len(ours_rows)})")
    document = {
        "benchmark": "host_proxy", "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": {"device": "cpu", "device_name": device_name(torch.device("cpu")), "torch": torch.__version__,
                    "python": platform.python_version(), "threads": 1, "cores": os.cpu_count(),
                    "load_average_1min": os.getloadavg()[0]},
        "target": {"error_at_most": TARGET, "judged_on": "CPU time of the process, medians of steps taken in turn"},
        "meets_target": met, "rows": rows,
        "against_checkpoint": {"target": "the recompute plan's step no slower than torch.utils.checkpoint's at a "
                                         "measured peak at most checkpoint's (wall time, one thread, medians)",
                               "meets_target": checkpoint_met, "rows": against},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(document, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
