"""Our runtime against its peers: step time and measured peak under memory budgets, in one process.

Methods: the unconstrained step; ours (auto, vdnn-all, vdnn++ plans run by OffloadRuntime);
PyTorch's torch.autograd.graph.save_on_cpu(pin_memory=True); torchtune's OffloadActivations
when it is installed (pip install -e '.[peers]'); torch.utils.checkpoint over the model's top-level
stages (a Hugging Face model's own gradient checkpointing), and PyTorch's selective activation
checkpointing inside them (matmuls and convolutions saved); torch.compile with
activation_memory_budget (PyTorch's own recompute planner; not with --quick). After each peer, ours (auto)
planned for the peak that peer measured: the two at equal memory. For each
model and budget (a fraction of the keep-all peak): step time relative to unconstrained,
measured peak against the budget, and (ours) predicted against measured. Then the largest
batch each method fits under a fixed memory cap. On CUDA, peaks are
torch.cuda.max_memory_allocated and the cap is set_per_process_memory_fraction; on a CPU
(small models, so CI can run it) peaks are live storages counted step by step and the cap
is a budget the methods are checked against. Prints tables and writes JSON.

    python benchmarks/offload_vs_peers.py [--quick] [--out data/benchmarks/offload_vs_peers-<device>.json]
"""

from __future__ import annotations

import argparse
import copy
import functools
import gc
import json
import platform
import statistics
import sys
import time
from contextlib import nullcontext
from datetime import datetime, timezone
from pathlib import Path

import torch
from torch import nn

import udnn_lab as ul
from udnn_lab.analysis.step import compute_loss, input_tensors, split_input
from udnn_lab.devices import device_name
from udnn_lab.errors import HostMemoryTooSmall
from udnn_lab.planning import PlanInfeasible, host
from udnn_lab.runtime import HostMemoryError
from udnn_lab.runtime.live_bytes import LiveBytes
from udnn_lab.runtime.pinned_pool import empty_pinned_cache
from udnn_lab.units import cuda_block_bytes
from udnn_lab.workload import optimizer_like

GPU_CASES = [("resnet50", 256, {}), ("vgg16", 128, {}), ("densenet201", 128, {}), ("transformer", 64, {})]
CPU_CASES = [("resnet18", 16, {"image_size": 64}), ("vgg11", 8, {"image_size": 64}), ("mlp5", 256, {}),
             ("transformer", 8, {"input_shape": (64,)})]
QUICK_CASES = [("resnet18", 8, {"image_size": 32}), ("mlp5", 64, {})]  # CI: a minute on two cores
FRACTIONS = (1.0, 0.7, 0.5, 0.35)


class Bench:
    """Runs steps of one workload by each method and measures them."""

    def __init__(self, name: str, batch: int, options: dict, device: torch.device, steps: int,
                 fake: bool = True) -> None:
        """``fake=False``: trace the step as it runs (where fake tensors would take another path, a data-dependent
        check in the model's code)."""
        self.name, self.batch, self.options, self.device, self.steps = name, batch, options, device, steps
        self.work = ul.zoo.get(name, batch=batch, device=device, **options)
        self.graph = ul.trace(self.work, fake=fake)
        self.cuda = device.type == "cuda"
        self.hardware = _hardware(device)

    @property
    def predicted_peak(self) -> int:
        return self.graph.cuda_peak_bytes if self.cuda else self.graph.peak_bytes

    def measure(self, context_factory, model: nn.Module | None = None) -> dict:
        """Median step time and peak over ``steps`` steps after one warm-up, each inside ``context_factory()``."""
        model = model or copy.deepcopy(self.work.model)
        optimizer = optimizer_like(self.work.optimizer, model.parameters()) if self.work.optimizer else None
        args, kwargs = split_input(self.work.example_input)
        times, peaks = [], []
        for index in range(self.steps + 1):
            model.zero_grad(set_to_none=True)
            held = [*model.parameters(), *model.buffers(), *_state(optimizer), *input_tensors(args, kwargs),
                    *([self.work.target] if isinstance(self.work.target, torch.Tensor) else [])]
            counter = None if self.cuda else LiveBytes(held)
            self._sync(reset=True)
            outside = self._outside(model, optimizer)
            start = time.perf_counter()
            context = on_model(context_factory(), model)
            if hasattr(context, "observer"):  # our runtime: prefetched and recomputed storages are made out of sight
                context.observer = counter
            with counter or nullcontext(), context:
                loss = compute_loss(model(*args, **kwargs), self.work.loss_fn, self.work.target)
                loss.backward()
            if hasattr(context, "observer"):
                context.observer = None
            if optimizer is not None:
                optimizer.step()
            self._sync()
            if index:  # the first step warms up caches and creates optimizer state
                times.append(time.perf_counter() - start)
                peaks.append(torch.cuda.max_memory_allocated(self.device) - outside if self.cuda else counter.peak)
        release = getattr(context_factory(), "release", None)  # our runtime: pinned memory back to the machine
        if release is not None:
            release()
        if self.cuda:  # save_on_cpu's pinned copies are cached by PyTorch too
            empty_pinned_cache()
        return {"step_time_s": statistics.median(times), "step_times_s": times, "peak_bytes": max(peaks)}

    def _outside(self, model: nn.Module, optimizer) -> int:
        """CUDA bytes held outside this step (the workload's own model, earlier methods' leftovers): not its peak."""
        if not self.cuda:
            return 0
        tensors = [*model.parameters(), *model.buffers(), *_state(optimizer), self.work.example_input, self.work.target]
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors if t.is_cuda}
        return torch.cuda.memory_allocated(self.device) - sum(cuda_block_bytes(n) for n in storages.values())

    def _sync(self, reset: bool = False) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)
            if reset:
                torch.cuda.reset_peak_memory_stats(self.device)


def _state(optimizer) -> list[torch.Tensor]:
    if optimizer is None:
        return []
    return [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]


def _hardware(device: torch.device) -> ul.Hardware:
    from udnn_lab.simulation.simulator import resolve_hardware

    try:
        return resolve_hardware(None, device.type)
    except ValueError:
        return ul.Hardware.load("h100-sxm" if device.type == "cuda" else "cpu-amd-epyc-2cpu")


def on_model(context, model: nn.Module):
    """``context`` for the copy of the model a step runs: our runtime hooks that copy's modules (NOTE [hook
    points] 8)."""
    return context.for_model(model) if isinstance(context, ul.OffloadRuntime) else context


def ours(bench: Bench, policy: str, budget: int | None):
    """Plan under ``budget`` less what the unconstrained run showed beyond the prediction (workspaces)."""
    chosen = ul.plan(bench.graph, budget, policy, hardware=bench.hardware)
    runtime = ul.OffloadRuntime(chosen)
    predicted = ul.simulate(bench.graph, chosen, hardware=bench.hardware)
    return (lambda: runtime), predicted


def save_on_cpu(bench: Bench):
    return lambda: torch.autograd.graph.save_on_cpu(pin_memory=bench.cuda)


def torchtune_offload():
    try:
        from torchtune.training import OffloadActivations
    except ImportError as err:
        return None, f"torchtune is not installed ({err}): pip install -e '.[peers]'"
    return (lambda: OffloadActivations()), ""


def checkpointed(model: nn.Module, selective: bool = False) -> nn.Module | None:
    """The model's top-level stages under torch.utils.checkpoint, for models whose forward is a chain of them.
    ``selective``: PyTorch's selective activation checkpointing inside each stage (matmuls and convolutions
    saved, the rest recomputed)."""
    if getattr(model, "supports_gradient_checkpointing", False):  # Hugging Face: its own blocks, as its users do
        from torch.utils.checkpoint import create_selective_checkpoint_contexts

        extra = {"context_fn": functools.partial(create_selective_checkpoint_contexts, _selective_policy)} \
            if selective else {}
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False, **extra})
        return model
    stages = _stages(model)
    if stages is None:
        return None
    return _Checkpointed(stages, selective)


_SAVED_BY_SELECTIVE = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
                       torch.ops.aten.convolution.default, torch.ops.aten._scaled_dot_product_flash_attention.default,
                       torch.ops.aten._scaled_dot_product_efficient_attention.default}


def _selective_policy(ctx, op, *args, **kwargs):
    from torch.utils.checkpoint import CheckpointPolicy

    return CheckpointPolicy.MUST_SAVE if op in _SAVED_BY_SELECTIVE else CheckpointPolicy.PREFER_RECOMPUTE


class _Checkpointed(nn.Module):
    def __init__(self, stages: list[nn.Module], selective: bool = False) -> None:
        super().__init__()
        self.stages = nn.ModuleList(stages)
        self.selective = selective

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

        extra = {"context_fn": functools.partial(create_selective_checkpoint_contexts, _selective_policy)} \
            if self.selective else {}
        for stage in self.stages[:-1]:
            x = checkpoint(stage, x, use_reentrant=False, **extra)
        return self.stages[-1](x)


def _stages(model: nn.Module) -> list[nn.Module] | None:
    import torchvision

    if isinstance(model, torchvision.models.ResNet):
        stem = nn.Sequential(model.conv1, model.bn1, model.relu, model.maxpool)
        return [stem, model.layer1, model.layer2, model.layer3, model.layer4,
                nn.Sequential(model.avgpool, nn.Flatten(), model.fc)]
    if isinstance(model, torchvision.models.VGG):
        return [*_grouped(model.features.children()), nn.Sequential(model.avgpool, nn.Flatten(), model.classifier)]
    if isinstance(model, torchvision.models.DenseNet):
        return [*_grouped(model.features.children()), nn.Sequential(nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                                                                     model.classifier)]
    if isinstance(model, ul.zoo.MLP):
        return list(_grouped(model.net.children()))
    if isinstance(model, ul.zoo.TransformerClassifier):
        norm = [model.encoder.norm] if model.encoder.norm is not None else []
        return [model.embed, *model.encoder.layers, *norm, _MeanHead(model.fc)]
    return None


class _MeanHead(nn.Module):
    """The zoo transformer's head: the mean over tokens, then its classifier."""

    def __init__(self, fc: nn.Module) -> None:
        super().__init__()
        self.fc = fc

    def forward(self, x):
        return self.fc(x.mean(dim=1))


def _grouped(modules) -> list[nn.Module]:
    """Stages that never start with an in-place module (checkpoint must not hand one its input)."""
    stages: list[list[nn.Module]] = []
    for module in modules:
        if stages and getattr(module, "inplace", False):
            stages[-1].append(module)
        else:
            stages.append([module])
    return [nn.Sequential(*stage) for stage in stages]


def budgets_for(bench: Bench, unconstrained: dict, quick: bool) -> list[dict]:
    rows = []
    overhead = max(0, unconstrained["peak_bytes"] - bench.predicted_peak)  # workspaces the graph does not show
    for fraction in FRACTIONS[:2] if quick else FRACTIONS:
        budget = int(bench.predicted_peak * fraction)
        for policy in ("auto", "vdnn-all", "vdnn++"):
            row = {"model": bench.name, "batch": bench.batch, "fraction": fraction, "budget_bytes": budget,
                   "method": f"udnn_lab {policy}"}
            try:
                factory, predicted = ours(bench, policy, max(budget - overhead, 1) if policy != "vdnn-all" else None)
            except PlanInfeasible as err:
                rows.append({**row, "fits": False, "note": str(err)})
                continue
            try:
                measured = bench.measure(factory)
            except HostMemoryError as err:  # the plan is valid; this machine's host memory is not enough
                rows.append({**row, "fits": False, "note": f"host memory: {err}"})
                continue
            rows.append({**row, **measured, "fits": measured["peak_bytes"] <= budget,
                         "relative_step_time": measured["step_time_s"] / unconstrained["step_time_s"],
                         "predicted_step_time_s": predicted.step_time_s, "predicted_peak_bytes": predicted.peak_bytes})
    return rows


def peers(bench: Bench, unconstrained: dict, quick: bool = False) -> list[dict]:
    """Each peer's step, then ours (auto) planned for the peak that peer measured: the two at equal memory."""
    rows = []
    base = {"model": bench.name, "batch": bench.batch}
    factory, why = torchtune_offload()
    candidates = [("save_on_cpu", save_on_cpu(bench), None, ""),
                  ("torchtune OffloadActivations", factory, None, why),
                  ("torch.utils.checkpoint", nullcontext, checkpointed(copy.deepcopy(bench.work.model)),
                   NO_STAGES),
                  ("selective activation checkpointing", nullcontext,
                   checkpointed(copy.deepcopy(bench.work.model), selective=True), NO_STAGES)]
    if not quick:  # compiling takes a minute or more per model
        budget = COMPILE_MEMORY_BUDGET
        candidates.append((f"torch.compile activation_memory_budget={budget}", _compile_budget(budget),
                           torch.compile(copy.deepcopy(bench.work.model)), ""))
    for method, context, model, why_not in candidates:
        if context is None or (model is None and why_not == NO_STAGES):
            rows.append({**base, "method": method, "note": why_not})
            continue
        try:
            measured = bench.measure(context, model)
        except Exception as err:  # a peer that cannot run this model is a row saying why, not a stopped benchmark
            rows.append({**base, "method": method, "note": f"{type(err).__name__}: {str(err).splitlines()[0]}"})
            continue
        rows.append({**base, "method": method, **measured,
                     "relative_step_time": measured["step_time_s"] / unconstrained["step_time_s"]})
        rows.append(_ours_at(bench, method, measured))
    return rows


NO_STAGES = "no chain of top-level stages to checkpoint in this model"
COMPILE_MEMORY_BUDGET = 0.5  # torch._functorch.config.activation_memory_budget: PyTorch's own recompute planner


def _compile_budget(budget: float):
    return lambda: torch._functorch.config.patch(activation_memory_budget=budget)


def _ours_at(bench: Bench, peer: str, measured: dict) -> dict:
    """auto planned for the peak a peer measured, and how its step compares with the peer's."""
    row = {"model": bench.name, "batch": bench.batch, "method": f"udnn_lab auto at {peer}'s peak",
           "budget_bytes": measured["peak_bytes"]}
    if not _fits(bench, measured["peak_bytes"]):
        return {**row, "note": "no plan fits that peak"}
    try:
        ours_equal = bench.measure(ours(bench, "auto", measured["peak_bytes"])[0])
    except HostMemoryError as err:
        return {**row, "note": f"host memory: {err}"}
    return {**row, **ours_equal, "speedup_over_peer": measured["step_time_s"] / ours_equal["step_time_s"],
            "fits": ours_equal["peak_bytes"] <= measured["peak_bytes"]}


def _fits(bench: Bench, budget: int) -> bool:
    try:
        ul.plan(bench.graph, budget, "auto", hardware=bench.hardware)
        return True
    except PlanInfeasible:
        return False


def largest_batch(name: str, batch: int, options: dict, device: torch.device, cap: int, quick: bool) -> list[dict]:
    """The largest batch each method trains under ``cap`` bytes, and its time per sample.

    Each size is checked against this machine's host memory before it is built (``_host_check``): a search that
    would take more stops there and says so in its row's ``stopped``, rather than the machine running out."""
    rows = []
    for method in ("unconstrained", "udnn_lab auto", "save_on_cpu", "torch.utils.checkpoint"):
        attempt = _Attempts(method, name, options, device, cap, quick)
        best, per_sample, size, failed = None, None, batch, None
        while size <= batch * (2 if quick else 32) and failed is None and not attempt.stopped:
            result = attempt(size)
            if result is None:
                failed = size
            else:
                best, per_sample = size, result["step_time_s"] / size
                size *= 2
        if best is not None and failed is not None and not quick:  # refine between the last fit and the first miss
            low, high = best, failed
            while high - low > max(1, low // 8) and not attempt.stopped:
                middle = (low + high) // 2
                result = attempt(middle)
                low, high = (middle, high) if result else (low, middle)
                if result:
                    best, per_sample = middle, result["step_time_s"] / middle
        rows.append({"model": name, "method": method, "cap_bytes": cap, "largest_batch": best,
                     "time_per_sample_s": per_sample, **({"stopped": attempt.stopped} if attempt.stopped else {})})
    base = next(r for r in rows if r["method"] == "unconstrained")
    for row in rows:
        if base["largest_batch"] and row["largest_batch"]:
            row["batch_ratio"] = row["largest_batch"] / base["largest_batch"]
            row["overhead"] = row["time_per_sample_s"] / base["time_per_sample_s"] - 1
    return rows


class _Attempts:
    """Tries of one method at the sizes asked, each checked against the host's memory first; ``stopped`` says why
    the search must end (the next size would need more host memory than this machine has), once it must."""

    def __init__(self, method: str, name: str, options: dict, device: torch.device, cap: int, quick: bool) -> None:
        self.method, self.name, self.options, self.device, self.cap, self.quick = method, name, options, device, cap, \
            quick
        self.stopped = ""

    def __call__(self, size: int) -> dict | None:
        try:
            _host_check(self.method, self.name, size, self.options, self.device)
        except HostMemoryTooSmall as error:
            self.stopped = str(error)
            print(f"    {self.method}: {error}", file=sys.stderr, flush=True)
            return None
        return _try(self.method, self.name, size, self.options, self.device, self.cap, self.quick)


def _host_check(method: str, name: str, size: int, options: dict, device: torch.device) -> None:
    """Raise HostMemoryTooSmall when a try at ``size`` would need more host memory (or, for save_on_cpu's pinned
    copies, more pinned memory) than this machine has, reckoned from the step traced on meta (no memory taken).

    Every try builds its model and batch on the host first (the batch twice: made, then cast or moved); on a CPU
    the whole step lives there. save_on_cpu copies every saved tensor to the host, pinned on CUDA: the step's
    peak bounds them. Our runtime's pool is held to the host budget by ul.plan itself."""
    work = ul.zoo.get(name, batch=size, device="meta", **options)
    graph = ul.trace(work, device=device.type)
    batch_bytes = sum(t.numel() * t.element_size()
                      for t in [*input_tensors(*split_input(work.example_input)), work.target]
                      if isinstance(t, torch.Tensor))
    weights = sum(p.numel() * p.element_size() for p in work.model.parameters())
    on_host = 2 * batch_bytes + weights + (0 if device.type == "cuda" else int(graph.peak_bytes))
    saved = int(graph.peak_bytes) if method == "save_on_cpu" else 0
    advice = "lower the largest batch tried, or run on a machine with more host memory"
    what = f"{method} at batch {size} of {name}"
    if device.type == "cuda":
        host.require_host(on_host, what, advice)
        host.require_host(saved, f"{what} (its saved tensors, pinned)", advice, pinned=True)
    else:
        host.require_host(on_host + saved, what, advice)


def _try(method: str, name: str, batch: int, options: dict, device: torch.device, cap: int,
         quick: bool) -> dict | None:
    cuda = device.type == "cuda"
    if cuda:
        gc.collect()  # the last try's model and batch
        torch.cuda.empty_cache()
        torch.cuda.set_per_process_memory_fraction(cap / torch.cuda.get_device_properties(device).total_memory, device)
    try:
        bench = Bench(name, batch, options, device, steps=1 if quick else 2)
        own = bench.work.model  # trained in place: a copy would count against the cap
        if method == "unconstrained":
            result = bench.measure(nullcontext, own)
        elif method == "udnn_lab auto":
            result = bench.measure(ours(bench, "auto", int(cap * 0.9))[0], own)
        elif method == "save_on_cpu":
            result = bench.measure(save_on_cpu(bench), own)
        else:
            model = checkpointed(own)
            if model is None:
                return None
            result = bench.measure(nullcontext, model)
    except (torch.cuda.OutOfMemoryError, PlanInfeasible, HostMemoryError):
        return None
    finally:
        if cuda:
            torch.cuda.set_per_process_memory_fraction(1.0, device)
            torch.cuda.empty_cache()
    return result if result["peak_bytes"] <= cap else None


def run(device: torch.device, quick: bool, models: list[str] | None = None) -> dict:
    cases = GPU_CASES if device.type == "cuda" else CPU_CASES
    cases = QUICK_CASES if quick else cases
    if models:
        unknown = set(models) - {name for name, _, _ in cases}
        if unknown:
            raise SystemExit(f"no case named {', '.join(sorted(unknown))}: choose from "
                             f"{', '.join(name for name, _, _ in cases)}")
        cases = [case for case in cases if case[0] in models]
    results, batches = [], []
    for name, batch, options in cases:
        print(f"  {name} (batch {batch}) ...", file=sys.stderr, flush=True)
        began = time.perf_counter()
        bench = Bench(name, batch, options, device, steps=1 if quick else 5)
        unconstrained = bench.measure(nullcontext)
        results.append({"model": name, "batch": batch, "method": "unconstrained", **unconstrained,
                        "predicted_peak_bytes": bench.predicted_peak})
        results += budgets_for(bench, unconstrained, quick)
        results += peers(bench, unconstrained, quick)
        cap = int(unconstrained["peak_bytes"] * 1.1)  # the unconstrained step fits its own batch, no more
        del bench  # its model and batch would count against the cap below
        gc.collect()
        print(f"    budgets and peers done in {time.perf_counter() - began:.0f} s", file=sys.stderr, flush=True)
        batches += largest_batch(name, batch, options, device, cap, quick)
        print(f"    largest batches done in {time.perf_counter() - began:.0f} s", file=sys.stderr, flush=True)
    return {"rows": results, "largest_batch": batches}


def _print_batches(rows: list[dict]) -> None:
    print(f"\n{'model':12s} {'method':28s} {'cap':>9s} {'batch':>6s} {'x':>6s} {'overhead':>9s}")
    for row in rows:
        ratio = f"{row['batch_ratio']:5.1f}x" if "batch_ratio" in row else ""
        overhead = f"{row['overhead']:+8.1%}" if "overhead" in row else ""
        print(f"{row['model']:12s} {row['method']:28s} {row['cap_bytes'] / 2**20:8.0f}M "
              f"{str(row['largest_batch']):>6s} {ratio:>6s} {overhead:>9s}")
    print("targets: auto within 5% of unconstrained at 50% budget (CNNs); >= 1.5x faster than save_on_cpu at equal "
          "memory; measured peak never above budget; largest batch >= 3x at <= 15% overhead")


def _print(document: dict) -> None:
    print(f"\n{'model':12s} {'method':58s} {'budget':>7s} {'step':>9s} {'rel':>6s} {'peak':>10s} {'fits':>5s}")
    for row in document["rows"]:
        budget = f"{row['fraction']:.0%}" if "fraction" in row else ""
        step = f"{row['step_time_s'] * 1e3:8.1f}ms" if "step_time_s" in row else "        -"
        rel = f"{row['relative_step_time']:5.2f}x" if "relative_step_time" in row else \
            f"/{row['speedup_over_peer']:4.2f}" if "speedup_over_peer" in row else ""
        peak = f"{row['peak_bytes'] / 2**20:9.1f}M" if "peak_bytes" in row else ""
        print(f"{row['model']:12s} {row['method']:58s} {budget:>7s} {step} {rel:>6s} {peak:>10s} "
              f"{str(row.get('fits', '')):>5s} {row.get('note', '')[:60]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="two small cases, two budgets, one step (for CI)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--models", nargs="+", help="only these of the device's cases (default: all)")
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:  # the memory-fraction calls want an index
        device = torch.device("cuda", torch.cuda.current_device())
    torch.set_num_threads(2)
    document = {"benchmark": "offload_vs_peers", "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                "machine": {"device": device.type, "device_name": device_name(device), "torch": torch.__version__,
                            "python": platform.python_version()}, "quick": args.quick,
                **run(device, args.quick, args.models)}
    _print(document)
    _print_batches(document["largest_batch"])
    out = args.out or Path(__file__).resolve().parent.parent / "data" / "benchmarks" \
        / f"offload_vs_peers-{device.type}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(document, indent=1, default=str))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
