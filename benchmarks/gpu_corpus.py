"""The promise on a GPU at the sizes people train: every quick plan, its peak, its gradients and its time.

For each model of CORPUS (CNNs at 224 px and batch >= 64, vision transformers, GPT-2 and a Llama-style
decoder in bf16-mixed at 1024 tokens with AdamW, a LoRA fine-tune), in its own child process with a time
limit (one hang or crash loses one model):

1. trace the step and simulate it on the profile this machine resolves to (``hardware=None``);
2. two eager steps from the same state: the control (gradients that differ between them name the
   nondeterministic kernels, and excuse differences under a plan no larger than the largest between them),
   the keep-all peak against the
   trace, the keep-all step time (the fastest of the steps after the first) against the simulator;
3. ``ul.profile`` of the step (each op timed alone, and the scratch each takes: cuDNN's workspaces, NOTE
   [simulated streams] 8); the plans below are made and simulated with it where its ops are the trace's
   (``PLAN_WITH_PROFILE``), else on the machine's profile, and each row says which;
4. each policy of POLICIES at each budget of BUDGETS (midway between its minimum and the keep-all peak,
   50% of the keep-all peak, its minimum + 5%): a fresh copy, one step compared with eager bit for bit,
   then steps for the time; measured peak against the budget and the simulated peak, step against the
   simulated step. Budgets go in turn (every policy at midway, then at 50%, then at minimum + 5%), so a model
   stopped at its time limit has tried each policy;
5. last, once every comparison is made: each policy planned again for its budget in reserved bytes (what an
   out-of-memory error counts) and run on a device of that size (two steps under
   ``set_per_process_memory_fraction``), and keep-all on a device of its predicted reserved peak, a row each with
   ``"check": "capped"``. Last because a run near the cap leaves cuDNN's smaller-workspace convolutions cached
   for the rest of the process.

The keep-all row says where the model's time went (``phase_s``), each policy's first row its ``min_budget_s``. On a
GPU it also holds the step traced as on a machine without one (``stand_in_peak_bytes``, ``stand_in_peak_error``
against the trace made with CUDA's kernels, and the first ops where the two part).

Every row on a GPU also holds the caching allocator's side: the reserved bytes the first step added from an
emptied cache against what the allocator model predicts for the plan's step, and what the process held outside
the allocator (the device's used memory less memory_reserved: the CUDA context, libraries' workspaces), which
``benchmarks/gpu_errors.py`` turns into the error distribution of allocated and reserved predictions.

Diagnostics, so that a machine without a GPU can work from them (under ``<out>/gpu_corpus/``): for a run
over budget or off by more than 1% (peak) the allocator's history of one more step
(``torch.cuda.memory._snapshot()``, gzip'd pickle, stacks included: memory_viz reads it); the keep-all step's
per-op measured curve beside the predicted one when its peak is off by more than 1%; kernel times by op and
input shapes (``torch.profiler``) of the keep-all step and of one recompute plan's step; ``ul.profile`` of the
keep-all step (every op timed alone, the host's time to issue each op too), which ``benchmarks/fit_rates.py`` turns
into the machine's rate curve; the traced graph and each plan's file, from which ``benchmarks/gpu_resimulate.py``
simulates every run again on a machine without a GPU, with the simulator of its day.

Rows go to ``<out>/gpu_corpus.jsonl`` one line per run as they finish. Without a CUDA device it says so and
exits 0 unless ``--device cpu`` asks for a dry run of the same code on small sizes (no peaks there).

    python benchmarks/gpu_corpus.py [--models resnet50 gpt2] [--total-s 360] [--resume] [--out DIR]
    python benchmarks/gpu_corpus.py --device cpu --small --models resnet50   # the code path, on this CPU
"""

from __future__ import annotations

import argparse
import copy
import gc
import gzip
import json
import math
import os
import pickle
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.corpus.promise import describe  # noqa: E402  (one line per error, where it was raised)

POLICIES = ("auto", "vdnn++", "recompute")
BUDGETS = ("midway", "50%", "min+5%")
SEED_POLICIES = ("vdnn-all", "vdnn-conv", "vdnn++")  # the vDNN papers' figures: VGG-16 at batch 128 and 256
# after the compared step; the step time is the fastest of them (on an H200 ConvNeXt-T's second step still
# took 2.05 s, its third 0.097 s: a median of two read 1.08 s)
TIMED_STEPS = 2
PEAK_TOLERANCE = 0.01
TIME_TOLERANCE = 0.10
SNAPSHOTS_PER_MODEL = 3  # allocator histories kept for one model (each a few MB compressed)
PLAN_WITH_PROFILE = True  # plan with the step's own ul.profile where it matches the trace (step 3 of the docstring)
LLAMA_STYLE = {"hidden_size": 2048, "intermediate_size": 8192, "num_attention_heads": 16, "num_key_value_heads": 8,
               "num_hidden_layers": 4}


@dataclass(frozen=True)
class Case:
    """One model of the corpus at the size people train it, and a small size for a dry run on a CPU."""

    name: str
    model: str
    batch: int
    small_batch: int
    options: dict = field(default_factory=dict)
    input_shape: tuple[int, ...] | None = None  # a torchvision or timm factory's one example
    policies: tuple[str, ...] = POLICIES

    def workload(self, device: torch.device, small: bool):
        import udnn_lab as ul

        options = dict(self.options)
        if small and self.model.startswith("hf:"):
            options = {k: v for k, v in options.items() if k != "config_overrides"} | {"small": True, "seq_len": 64}
        if small and self.input_shape is None and not self.model.startswith("hf:"):
            options["image_size"] = 64
        shape = self.input_shape
        if small and shape is not None:
            shape = (shape[0], 64, 64)
        return ul.zoo.get(self.model, batch=self.small_batch if small else self.batch, device=device,
                          input_shape=shape, **options)


_BF16_1024 = {"precision": "bf16-mixed", "seq_len": 1024}
CORPUS = (
    Case("resnet50", "resnet50", 256, 2),
    Case("llama-style", "hf:llama-3-8b", 4, 1, {**_BF16_1024, "config_overrides": LLAMA_STYLE}),
    Case("gpt2", "hf:gpt2", 8, 1, _BF16_1024),
    Case("swin_t", "torchvision.models:swin_t", 64, 2, input_shape=(3, 224, 224)),
    Case("vit_b_16", "torchvision.models:vit_b_16", 64, 2, input_shape=(3, 224, 224)),
    Case("vgg16", "vgg16", 128, 2, policies=SEED_POLICIES + ("auto",)),
    Case("convnext_tiny", "torchvision.models:convnext_tiny", 64, 2, input_shape=(3, 224, 224)),
    # a LoRA fine-tune as its recipes run it: without the key and value cache (NOTE [known values])
    Case("llama-style-lora", "hf:llama-3-8b", 4, 1,
         {**_BF16_1024, "config_overrides": {**LLAMA_STYLE, "use_cache": False}, "lora_rank": 16}),
    Case("mobilenet_v3_large", "torchvision.models:mobilenet_v3_large", 128, 2, input_shape=(3, 224, 224)),
    Case("efficientnet_b0", "torchvision.models:efficientnet_b0", 64, 2, input_shape=(3, 224, 224)),
    Case("densenet121", "densenet121", 64, 2),
    Case("bert-base", "hf:bert-base", 16, 1, {"precision": "bf16-mixed", "seq_len": 512}),
    Case("vgg16-b256", "vgg16", 256, 2, policies=SEED_POLICIES),
    Case("maxvit", "timm.models:maxvit_tiny_tf_224", 32, 2, input_shape=(3, 224, 224)),
)


# --- one model, in its own process -----------------------------------------------------------------------------

@dataclass
class Outcome:
    grads: list = field(default_factory=list)
    peaks: list = field(default_factory=list)  # bytes above what the step started with, per step
    # the caching allocator's reserved bytes added during each step (max_memory_reserved less memory_reserved at
    # its start): the first step's starts from an emptied cache, as a fresh process's does
    reserved_growth: list = field(default_factory=list)
    outside_allocator_bytes: int | None = None  # the device's used memory less what the allocator reserves
    left_behind: list = field(default_factory=list)  # per step: allocated bytes it left beyond its gradients
    seconds: list = field(default_factory=list)
    error: str = ""
    traceback: str = ""

    @property
    def first_peak(self) -> int | None:
        """The first step's peak: with what a process allocates once (library workspaces) when it is the first."""
        return self.peaks[0] if self.peaks else None

    @property
    def steady_peak(self) -> int | None:
        """The peak of the steps after the first: what every step of a training run needs."""
        later = [p for p in self.peaks[1:] if p is not None]
        return max(later) if later else self.first_peak


class Model:
    """One case's workload, graph and eager outcome, and what its runs write."""

    def __init__(self, case: Case, device: torch.device, small: bool, out: Path) -> None:
        import udnn_lab as ul

        self.case, self.device, self.out = case, device, out
        self.batch = case.small_batch if small else case.batch
        self.diagnostics = out / "gpu_corpus"
        self.diagnostics.mkdir(parents=True, exist_ok=True)
        self.snapshots_left = SNAPSHOTS_PER_MODEL
        started = time.perf_counter()
        self.work = case.workload(device, small)
        self.build_s = time.perf_counter() - started
        started = time.perf_counter()
        self.graph = ul.trace(self.work)
        self.trace_s = time.perf_counter() - started
        self.keep_all_sim = ul.simulate(self.graph, None)
        self.profile = None  # the step's own ul.profile once taken, where its ops are the trace's (op_profile)
        started = time.perf_counter()
        self.eager = self.steps(None)
        self.eager_s = time.perf_counter() - started

    def row(self, **fields: Any) -> dict:
        return {"model": self.case.name, "workload": self.work.name, "batch": self.batch,
                "device": torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "cpu",
                "hardware": self.keep_all_sim.hardware, **fields}

    def steps(self, runtime, count: int = 1 + TIMED_STEPS, cap_bytes: int | None = None, compared: bool = True,
              after_step: Callable[[], Any] | None = None) -> Outcome:
        """``count`` steps on a fresh copy from the same state; the first step's gradients kept where ``compared``.

        The first step runs with deterministic kernels where PyTorch has them (``warn_only``), so that its
        gradients can be held to eager's bit for bit (``compared``); the others run as users run them, and
        ``after_step`` is called after each (a profiler's step). ``cap_bytes``: the
        process may hold what it held outside the step plus this much (``set_per_process_memory_fraction``),
        as on a device of that size: cuDNN then picks convolutions whose workspace fits, or the step runs out.
        """
        from udnn_lab.analysis.step import ensure_optimizer_state, grad_scaler, run_step, split_input
        from udnn_lab.workload import optimizer_like

        model = copy.deepcopy(self.work.model)
        optimizer = None
        if self.work.optimizer is not None:
            optimizer = optimizer_like(self.work.optimizer, model.parameters())
            ensure_optimizer_state(optimizer)
        args, kwargs = split_input(self.work.example_input)
        options = self.work.step_options
        scaler = grad_scaler(options, self.device) if options.scales_loss else None
        outcome = Outcome()
        try:
            if cap_bytes is not None and self.device.type == "cuda":
                outside = self._allocated() - self._step_resident(model, optimizer)
                torch.cuda.empty_cache()
                total = torch.cuda.get_device_properties(self.device).total_memory
                torch.cuda.set_per_process_memory_fraction(min(1.0, (outside + cap_bytes) / total), self.device)
            for index in range(count):
                model.zero_grad(set_to_none=True)  # the last step's gradients are not the next step's to count
                torch.manual_seed(0)
                before = self._allocated()
                self._reset_peak()
                reserved_before = self._reserved()
                if index == 0 and self.device.type == "cuda":
                    free, total = torch.cuda.mem_get_info(self.device)
                    outcome.outside_allocator_bytes = total - free - reserved_before
                torch.use_deterministic_algorithms(compared and index == 0, warn_only=True)
                started = time.perf_counter()
                # view replay where the step's ops need it (NOTE [view replay] 4): the runtime turns it on for a
                # plan whose step does, and an eager step runs as the trace saw it
                followed = runtime is not None and runtime.enabled
                with runtime.for_model(model) if runtime is not None else nullcontext():
                    _, loss = run_step(model, args, kwargs, loss_fn=self.work.loss_fn, target=self.work.target,
                                       optimizer=optimizer, options=options, scaler=scaler,
                                       replay_views=self.graph.rebuilds_views and not followed)
                self._sync()
                outcome.seconds.append(time.perf_counter() - started)
                peak = self._peak()
                outcome.peaks.append(None if peak is None else peak - before + self._step_resident(model, optimizer))
                if self.device.type == "cuda":
                    outcome.reserved_growth.append(torch.cuda.max_memory_reserved(self.device) - reserved_before)
                del loss
                outcome.left_behind.append(self._left_behind(model, before))
                if index == 0 and compared:  # else no copy of the gradients takes room from the steps after
                    outcome.grads = [None if p.grad is None else p.grad.detach().clone() for p in model.parameters()]
                if after_step is not None:
                    after_step()
        except Exception as err:  # a finding, recorded with the row
            outcome.error = describe(err)
            outcome.traceback = traceback.format_exc()[-2500:]
        finally:
            torch.use_deterministic_algorithms(False)
            del model, optimizer
            gc.collect()
            if self.device.type == "cuda":
                torch.cuda.set_per_process_memory_fraction(1.0, self.device)
                torch.cuda.empty_cache()
        return outcome

    def parameter_names(self, indices: list[int], at_most: int = 12) -> list[str]:
        names = [name for name, _ in self.work.model.named_parameters()]
        return [names[i] for i in indices[:at_most]]

    def _step_resident(self, model, optimizer) -> int:
        """What the trace counts from its first op (parameters, buffers, optimizer state, the batch), as blocks."""
        from udnn_lab.analysis.step import input_tensors, split_input
        from udnn_lab.units import cuda_block_bytes

        state = [v for s in (optimizer.state.values() if optimizer else ()) for v in s.values()
                 if isinstance(v, torch.Tensor)]
        args, kwargs = split_input(self.work.example_input)
        tensors = [*model.parameters(), *model.buffers(), *state, *input_tensors(args, kwargs),
                   *input_tensors((self.work.target,), {})]
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors
                    if t.device.type == "cuda"}
        return sum(cuda_block_bytes(n) for n in storages.values())

    def _left_behind(self, model, before: int) -> int | None:
        """Allocated bytes a step left beyond its gradients: what a library allocated once through the caching
        allocator and keeps (cuBLAS's workspaces, per handle and stream, are the suspects)."""
        from udnn_lab.units import cuda_block_bytes

        if self.device.type != "cuda":
            return None
        grads = {p.grad.untyped_storage().data_ptr(): p.grad.untyped_storage().nbytes() for p in model.parameters()
                 if p.grad is not None}
        return self._allocated() - before - sum(cuda_block_bytes(n) for n in grads.values())

    def _allocated(self) -> int:
        return torch.cuda.memory_allocated(self.device) if self.device.type == "cuda" else 0

    def _reserved(self) -> int:
        return torch.cuda.memory_reserved(self.device) if self.device.type == "cuda" else 0

    def reserved_fields(self, plan, simulation, outcome: Outcome) -> dict:
        """The caching allocator model's reserved bytes for the step against what the first step reserved."""
        from udnn_lab.allocator import events_from_simulation, replay
        from udnn_lab.planning.reserved import allocated_peak_bytes

        if self.device.type != "cuda":
            return {}
        frame = replay(events_from_simulation(self.graph, plan, simulation)).frame
        # the peak as torch.cuda.max_memory_allocated counts it, with the blocks handed out whole (NOTE [whole
        # blocks]): what ul.plan holds a plan that moves tensors to
        counted = allocated_peak_bytes(self.graph, plan, simulation, replayed=frame)
        before_step = frame.loc[frame["op"] < 0, "reserved_bytes"]
        predicted = int(frame["reserved_bytes"].max()) - (int(before_step.iloc[-1]) if len(before_step) else 0)
        measured = outcome.reserved_growth[0] if outcome.reserved_growth else None
        return {"predicted_reserved_peak_bytes": int(frame["reserved_bytes"].max()),
                "predicted_reserved_growth_bytes": predicted, "measured_reserved_growth_bytes": measured,
                "measured_reserved_growths": outcome.reserved_growth,
                "reserved_growth_error": _ratio(measured, predicted),
                "outside_allocator_bytes": outcome.outside_allocator_bytes,
                "whole_blocks_bytes": counted - simulation.peak_bytes,
                "allocated_peak_with_whole_blocks_bytes": counted}

    def _reset_peak(self) -> None:
        if self.device.type == "cuda":
            self._sync()
            torch.cuda.reset_peak_memory_stats(self.device)

    def _peak(self) -> int | None:
        return torch.cuda.max_memory_allocated(self.device) if self.device.type == "cuda" else None

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    # --- diagnostics ---

    def save_graph(self) -> str:
        """The traced graph (gzip'd pickle of ul.Graph), which with the profile and each plan's file lets a machine
        without a GPU simulate every run again (``benchmarks/gpu_resimulate.py``)."""
        path = self.diagnostics / f"{self.case.name}-graph.pickle.gz"
        with gzip.open(path, "wb", compresslevel=9) as file:
            pickle.dump(self.graph, file)
        return path.name

    def save_plan(self, plan, label: str) -> str:
        path = plan.save(self.diagnostics / f"{self.case.name}-{label}-plan.json")
        return path.name

    def snapshot(self, runtime, label: str) -> str | None:
        """One more step with the allocator's history recorded; the gzip'd snapshot's file name."""
        if self.device.type != "cuda" or self.snapshots_left <= 0:
            return None
        self.snapshots_left -= 1
        torch.cuda.memory._record_memory_history(max_entries=200_000, stacks="python")
        try:
            self.steps(runtime, count=1)
            snapshot = torch.cuda.memory._snapshot()
        finally:
            torch.cuda.memory._record_memory_history(enabled=None)
        path = self.diagnostics / f"{self.case.name}-{label}-snapshot.pickle.gz"
        with gzip.open(path, "wb", compresslevel=6) as file:
            pickle.dump(snapshot, file)
        return path.name

    def kernel_times(self, runtime, label: str) -> str | None:
        """One step under torch.profiler, the second of a copy (the first allocates libraries' workspaces and, in
        ``steps``, runs deterministic kernels): device and host time by op and input shapes."""
        from torch.profiler import ProfilerActivity, profile, schedule

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
        averages: list = []  # the active step's, handed over when it ends
        with profile(activities=activities, record_shapes=True, schedule=schedule(wait=0, warmup=1, active=1, repeat=1),
                     on_trace_ready=lambda done: averages.extend(done.key_averages(group_by_input_shape=True))) as prof:
            self.steps(runtime, count=2, compared=False, after_step=prof.step)
        if not averages:
            raise RuntimeError("the profiler handed over no step: the steps stopped early")
        rows = []
        for event in averages:
            rows.append({"op": event.key, "shapes": str(event.input_shapes), "count": event.count,
                         "device_us": getattr(event, "device_time_total", 0.0),
                         "host_us": event.cpu_time_total, "self_host_us": event.self_cpu_time_total})
        rows.sort(key=lambda r: -(r["device_us"] or r["host_us"]))
        path = self.diagnostics / f"{self.case.name}-{label}-kernels.json.gz"
        with gzip.open(path, "wt") as file:
            json.dump(rows[:400], file)
        return path.name

    def op_profile(self) -> str:
        """``ul.profile`` of the step (each op timed alone, two repeats): what ``benchmarks/fit_rates.py`` fits a
        rate curve for this machine's profile from."""
        import dataclasses

        import udnn_lab as ul
        from udnn_lab.cost.model import _compute_dtype

        found = ul.profile(self.work, repeats=2, warmup=1)
        same_ops = tuple(op.name for op in self.graph.ops) == found.ops
        if same_ops and PLAN_WITH_PROFILE:
            self.profile = found
        dtypes = [_compute_dtype(self.graph, op) for op in self.graph.ops] if same_ops else None
        path = self.diagnostics / f"{self.case.name}-profile.json.gz"
        with gzip.open(path, "wt") as file:
            json.dump({**dataclasses.asdict(found), "compute_dtypes": dtypes}, file)
        return path.name

    def measured_curve(self) -> str | None:
        """The keep-all step's live bytes per op, measured beside predicted (ul.measure)."""
        import udnn_lab as ul

        measured = ul.measure(self.work, graph=self.graph, progress=False)
        frame = measured.compare(self.graph)
        if measured.cuda is not None:
            frame["max_allocated_bytes"] = list(measured.cuda.max_allocated)
        path = self.diagnostics / f"{self.case.name}-keep-all-curve.json.gz"
        with gzip.open(path, "wt") as file:
            frame.to_json(file, orient="records")
        return path.name


def _same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    return (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))


def _differing(a: list, b: list) -> set[int]:
    return {i for i, (x, y) in enumerate(zip(a, b)) if not _same(x, y)}


def _relative(a: torch.Tensor | None, b: torch.Tensor | None) -> float:
    """The largest difference between two gradients over the largest magnitude of the first (inf: one is None)."""
    if a is None or b is None:
        return math.inf
    scale = float(a.abs().max()) if a.numel() else 0.0
    return float((a.float() - b.float()).abs().max()) / scale if scale else math.inf


@dataclass(frozen=True)
class Control:
    """What two eager steps from the same state differ in: the nondeterministic kernels' reach and size."""

    differing: frozenset[int]
    largest: float  # the largest relative difference between them (0: none)

    @classmethod
    def of(cls, eager: list, control: list) -> Control:
        differing = _differing(eager, control)
        return cls(frozenset(differing), max((_relative(eager[i], control[i]) for i in differing), default=0.0))

    def unexplained(self, eager: list, other: list) -> tuple[set[int], float]:
        """(the gradients a plan's step differs in beyond what these kernels explain, its largest relative
        difference): where the control differs, no larger a difference is theirs (atomic sums in another
        order spread to every layer before), else any difference is the plan's."""
        differing = _differing(eager, other)
        relative = {i: _relative(eager[i], other[i]) for i in differing}
        return {i for i in differing if relative[i] > self.largest}, max(relative.values(), default=0.0)


def _ratio(measured: float | None, predicted: float | None) -> float | None:
    return None if not measured or predicted is None else predicted / measured - 1


def run_model(case: Case, device: torch.device, small: bool, out: Path, emit) -> None:
    import udnn_lab as ul

    started = time.perf_counter()
    try:
        subject = Model(case, device, small, out)
    except Exception as err:
        emit({"model": case.name, "policy": "keep-all", "status": "setup error", "error": describe(err),
              "seconds": time.perf_counter() - started})
        return
    phase_started = time.perf_counter()
    control = subject.steps(None, count=1)  # eager again, from the same state: its compared step is what counts
    phases = {"build": subject.build_s, "trace": subject.trace_s, "eager": subject.eager_s,
              "control": time.perf_counter() - phase_started}
    eager = subject.eager
    nondeterministic = Control.of(eager.grads, control.grads)
    control.grads = []  # compared: its copy of the gradients would stay on the device through every run below
    measured = eager.steady_peak
    predicted = subject.graph.cuda_peak_bytes if device.type == "cuda" else subject.graph.peak_bytes
    step_s = min(eager.seconds[1:]) if len(eager.seconds) > 1 else None
    row = subject.row(policy="keep-all", budget_kind=None, budget_bytes=None, status="ok",
                      error=eager.error or control.error, build_s=subject.build_s, trace_s=subject.trace_s,
                      ops=len(subject.graph.ops), simulated_peak_bytes=predicted, measured_peak_bytes=measured,
                      measured_peaks=eager.peaks, first_step_peak_bytes=eager.first_peak,
                      peak_error=_ratio(measured, predicted),
                      simulated_step_s=subject.keep_all_sim.step_time_s, measured_step_s=step_s,
                      measured_steps_s=eager.seconds, step_error=_ratio(step_s, subject.keep_all_sim.step_time_s),
                      nondeterministic_grads=len(nondeterministic.differing),
                      nondeterministic_names=subject.parameter_names(sorted(nondeterministic.differing)),
                      nondeterministic_largest=nondeterministic.largest, parameters=len(eager.grads),
                      left_behind_bytes=eager.left_behind)
    if eager.error:
        row.update(status="eager error", traceback=eager.traceback)
    else:
        try:
            phase_started = time.perf_counter()
            row["kernels"] = subject.kernel_times(None, "keep-all")
            phases["kernels"] = time.perf_counter() - phase_started
            phase_started = time.perf_counter()
            row["profile"] = subject.op_profile()
            phases["profile"] = time.perf_counter() - phase_started
            row["graph"] = subject.save_graph()
            # with the profile's op scratch (cuDNN's workspaces), where its ops are the trace's
            profiled = ul.simulate(subject.graph, None, profile=subject.profile) if subject.profile is not None \
                else subject.keep_all_sim
            row.update(subject.reserved_fields(ul.Plan.keep_all(subject.graph), profiled, eager))
            if row["peak_error"] is not None and abs(row["peak_error"]) > PEAK_TOLERANCE:
                row["curve"] = subject.measured_curve()
        except Exception as err:
            row["diagnostics_error"] = describe(err)
    if device.type == "cuda":
        phase_started = time.perf_counter()
        row.update(_stand_in(case, small, subject.graph))
        phases["stand_in"] = time.perf_counter() - phase_started
    row["seconds"] = time.perf_counter() - started
    row["phase_s"] = phases  # where a model's time goes, to keep the check within its limits
    emit(row)
    if not eager.error:
        _plan_runs(subject, predicted, nondeterministic, emit)


def _stand_in(case: Case, small: bool, on_cuda) -> dict:
    """The step traced as on a machine without a GPU (CPU kernels standing in, NOTE [stand-in attention]) against the
    trace made here with CUDA's own: its peak and op count, and the first ops where the two part."""
    from unittest import mock

    import udnn_lab as ul

    try:
        with mock.patch("torch.cuda.is_available", return_value=False):
            graph = ul.trace(case.workload(torch.device("meta"), small), device="cuda")
    except Exception as err:
        return {"stand_in_error": describe(err)}

    def made(g, op) -> list:
        return [(g.tensors[t].dtype, g.tensors[t].nbytes) for t in op.allocated]

    parted = [f"op {a.index} {a.name} made {made(graph, a)}; CUDA's {b.name} made {made(on_cuda, b)}"
              for a, b in zip(graph.ops, on_cuda.ops) if a.name != b.name or made(graph, a) != made(on_cuda, b)]
    return {"stand_in_peak_bytes": graph.cuda_peak_bytes, "stand_in_ops": len(graph.ops),
            "stand_in_peak_error": _ratio(on_cuda.cuda_peak_bytes, graph.cuda_peak_bytes), "stand_in_parts": parted[:8]}


def _plan_runs(subject: Model, predicted: int, nondeterministic: Control, emit) -> None:
    """Every policy at every budget kind, compared with eager; then each on a device of its budget's size.

    The plans are made in planner processes, all at once, while this one runs them on the device: finding a
    policy's smallest budget and planning take seconds of CPU each (about 12 s and 5 s for ``auto`` on ResNet-50
    at batch 256), and made one after another they had the device idle for most of a model's time limit."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    # Every run on a device of a budget's size comes after every compared run. Near the cap a convolution's
    # first-choice workspace does not fit and PyTorch caches the algorithm that did for that shape, for the rest of
    # the process: on an H200 every ResNet-50 and VGG-16 plan run after such a run differed from eager in every
    # parameter, deterministic kernels and all, where eager run twice was bitwise equal.
    on_cuda = subject.device.type == "cuda"
    capped: list[tuple[str, str | None, Any]] = [("keep-all", None, predicted)] if on_cuda else []
    profiled_recompute = False
    order = _plan_order(subject.case)
    said_min_budget: set[str] = set()  # a policy's first row says what finding its smallest budget took
    workers = max(1, min(len(order), (os.cpu_count() or 2) // 2))
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as planners:
        pending = {(policy, kind): planners.submit(_planned, subject.graph, subject.profile, policy, kind, predicted,
                                                   on_cuda) for policy, kind in order}
        for policy, kind in order:
            made = pending.pop((policy, kind)).result()
            if "min_budget_error" in made:
                if policy not in said_min_budget:
                    emit(subject.row(policy=policy, status="min_budget error", error=made["min_budget_error"]))
                said_min_budget.add(policy)
                continue
            low, budget = made["low"], made["budget"]
            min_budget_s = 0.0 if policy in said_min_budget else made["min_budget_s"]
            said_min_budget.add(policy)
            if budget is not None and budget < low:
                emit(subject.row(policy=policy, budget_kind=kind, budget_bytes=budget, min_budget_bytes=low,
                                 status="below the policy's minimum"))
                continue
            plan = _run_plan(subject, policy, kind, budget, low, made, subject.eager, nondeterministic, emit,
                             profile=policy == "recompute" and not profiled_recompute, min_budget_s=min_budget_s)
            profiled_recompute |= policy == "recompute" and plan is not None
            if plan is not None and budget is not None and on_cuda:
                capped.append((policy, kind, made))
    # every comparison is made: eager's copy of the gradients leaves the device, as a training job would not hold it
    subject.eager.grads = []
    gc.collect()
    for capped_policy, capped_kind, capped_made in capped:
        _run_capped(subject, capped_policy, capped_kind, capped_made, emit)


def _budget(kind: str, low: int, predicted: int) -> int | None:
    return {"midway": (low + predicted) // 2, "50%": predicted // 2, "min+5%": int(low * 1.05)}.get(kind)


def _planned(graph, profile, policy: str, kind: str, predicted: int, reserved: bool) -> dict:
    """In a planner process (``_plan_runs``): the policy's smallest budget, and its plan for the budget ``kind``
    names, in allocated bytes and (``reserved``) in reserved bytes, with the seconds each took or its error."""
    import udnn_lab as ul

    torch.set_num_threads(1)
    started = time.perf_counter()
    try:
        low = ul.min_budget(graph, policy, profile=profile)
    except Exception as err:
        return {"min_budget_error": describe(err), "min_budget_s": time.perf_counter() - started}
    made: dict[str, Any] = {"low": low, "min_budget_s": time.perf_counter() - started,
                            "budget": _budget(kind, low, predicted)}
    if made["budget"] is not None and made["budget"] < low:
        return made
    for counts in ("allocated", "reserved") if reserved and made["budget"] is not None else ("allocated",):
        started = time.perf_counter()
        try:
            made[counts] = ul.plan(graph, made["budget"], policy, profile=profile, counts=counts)
        except Exception as err:
            made[f"{counts}_error"] = describe(err)
        made[f"{counts}_s"] = time.perf_counter() - started
    return made


def _plan_order(case: Case) -> list[tuple[str, str]]:
    """(policy, budget kind) in the order they run: each budget for every policy before the next budget, so that a
    model stopped at its time limit has tried every policy; the seed policies at their one budget first."""
    seeds = [(policy, "none") for policy in case.policies if policy in SEED_POLICIES and policy != "vdnn++"]
    return seeds + [(policy, kind) for kind in BUDGETS for policy in case.policies
                    if policy not in SEED_POLICIES or policy == "vdnn++"]


def _run_capped(subject: Model, policy: str, kind: str | None, made: Any, emit) -> None:
    """Two steps on a device of the budget's size (``set_per_process_memory_fraction``): does the step run there?
    Keep-all is capped at the caching allocator's reserved peak the allocator model predicts for it (``made``: the
    simulated peak); a policy runs the plan made for the budget in reserved bytes (``counts="reserved"``), as a plan
    for a device of that size is."""
    import udnn_lab as ul
    from udnn_lab.planning.reserved import reserved_peak_bytes

    started = time.perf_counter()
    row = subject.row(policy=policy, budget_kind=kind, check="capped")
    runtime = None
    try:
        if policy == "keep-all":
            budget = reserved_peak_bytes(subject.graph, ul.Plan.keep_all(subject.graph), subject.keep_all_sim)
            row.update(budget_bytes=budget, planned_in="the allocator model's reserved peak as the cap")
        else:
            budget = made["budget"]
            row.update(budget_bytes=budget, planned_in="reserved bytes", plan_s=made.get("reserved_s"))
            if "reserved_error" in made:
                row.update(status="no plan in reserved bytes", error=made["reserved_error"],
                           seconds=time.perf_counter() - started)
                emit(row)
                return
            plan = made["reserved"]
            sim = ul.simulate(subject.graph, plan, profile=subject.profile)
            row.update(offloads=len(plan.offloads), recomputes=len(plan.recomputes),
                       simulated_peak_bytes=sim.peak_bytes,
                       predicted_reserved_peak_bytes=reserved_peak_bytes(subject.graph, plan, sim))
            runtime = ul.OffloadRuntime(plan)
    except Exception as err:
        row.update(status="capped check error", error=describe(err), seconds=time.perf_counter() - started)
        emit(row)
        return
    try:
        # not compared: a copy of the first step's gradients would hold its bytes through the second, beyond the cap
        capped = subject.steps(runtime, count=2, cap_bytes=budget, compared=False)
    finally:
        if runtime is not None:
            runtime.release()
    fits = not capped.error
    row.update(status="runs on a device of its budget" if fits else "runs out of memory on a device of its budget",
               capped_runs=fits, capped_error=capped.error, measured_peaks=capped.peaks,
               capped_step_s=capped.seconds[-1] if len(capped.seconds) == 2 else None,
               seconds=time.perf_counter() - started)
    emit(row)


def _run_plan(subject: Model, policy: str, kind: str, budget: int | None, low: int, made: dict, eager: Outcome,
              nondeterministic: Control, emit, profile: bool, min_budget_s: float = 0.0):
    import udnn_lab as ul

    started = time.perf_counter()
    row = subject.row(policy=policy, budget_kind=kind, budget_bytes=budget, min_budget_bytes=low, status="ok",
                      min_budget_s=min_budget_s, plan_s=made.get("allocated_s"))
    if "allocated_error" in made:
        row.update(status="plan error", error=made["allocated_error"], seconds=time.perf_counter() - started)
        emit(row)
        return None
    try:
        plan = made["allocated"]
        row["planned_with"] = "the step's own ul.profile (op times, op scratch)" if subject.profile is not None \
            else "this machine's hardware profile"
        sim = ul.simulate(subject.graph, plan, profile=subject.profile)
        keep_all = ul.simulate(subject.graph, None, profile=subject.profile)
        runtime = ul.OffloadRuntime(plan)
    except Exception as err:
        row.update(status="plan error", error=describe(err), seconds=time.perf_counter() - started)
        emit(row)
        return None
    try:
        _measure_plan(subject, row, plan, runtime, sim, keep_all, budget, eager, nondeterministic, profile)
    finally:
        runtime.release()  # the host pool, pinned once for every run of this plan
    row["seconds"] = time.perf_counter() - started
    emit(row)
    return plan


def _measure_plan(subject: Model, row: dict, plan, runtime, sim, keep_all, budget: int | None, eager: Outcome,
                  nondeterministic: Control, profile: bool) -> None:
    outcome = subject.steps(runtime)
    differing = _differing(eager.grads, outcome.grads) if not outcome.error else set()
    unexplained, largest = nondeterministic.unexplained(eager.grads, outcome.grads) if not outcome.error \
        else (set(), 0.0)
    measured = outcome.steady_peak
    step_s = min(outcome.seconds[1:]) if len(outcome.seconds) > 1 else None
    row.update(offloads=len(plan.offloads), recomputes=len(plan.recomputes), followed_by=runtime.follows,
               simulated_peak_bytes=sim.peak_bytes, measured_peak_bytes=measured, measured_peaks=outcome.peaks,
               first_step_peak_bytes=outcome.first_peak,
               peak_error=_ratio(measured, sim.peak_bytes), simulated_step_s=sim.step_time_s,
               measured_step_s=step_s, measured_steps_s=outcome.seconds,
               step_error=_ratio(step_s, sim.step_time_s), simulated_slowdown=sim.step_time_s /
               keep_all.step_time_s, grads_differ=len(differing),
               grads_differ_unexplained=len(unexplained), grads_differ_largest=largest,
               grads_differ_names=subject.parameter_names(sorted(unexplained)),
               error=outcome.error, traceback=outcome.traceback, runtime=_stats(runtime),
               left_behind_bytes=outcome.left_behind)
    kinds = _judged(row, outcome, budget)
    if not outcome.error:
        try:
            row.update(subject.reserved_fields(plan, sim, outcome))
        except Exception as err:
            row["reserved_error"] = describe(err)
    row["status"] = ", ".join(kinds) or "ok"
    label = f"{row['policy']}-{row['budget_kind']}"
    try:
        row["plan"] = subject.save_plan(plan, label)
        if measured is not None and ("over budget" in kinds or "peak off" in kinds):
            row["snapshot"] = subject.snapshot(runtime, label)
        if profile:
            row["kernels"] = subject.kernel_times(runtime, label)
    except Exception as err:
        row["diagnostics_error"] = describe(err)


def _judged(row: dict, outcome: Outcome, budget: int | None) -> list[str]:
    """The ways a plan's run broke the promise, from its row."""
    kinds = []
    if outcome.error:
        kinds.append("runtime error")
    if row["grads_differ_unexplained"]:
        kinds.append("grads differ")
    measured = row["measured_peak_bytes"]
    if measured is not None and budget is not None and measured > budget:
        kinds.append("over budget")
    elif outcome.first_peak is not None and budget is not None and outcome.first_peak > budget:
        kinds.append("first step over budget")
    if row["peak_error"] is not None and abs(row["peak_error"]) > PEAK_TOLERANCE:
        kinds.append("peak off")
    if row["step_error"] is not None and abs(row["step_error"]) > TIME_TOLERANCE:
        kinds.append("step off")
    return kinds


def _stats(runtime) -> dict | None:
    import dataclasses

    stats = runtime.last_step
    return None if stats is None else {k: v for k, v in dataclasses.asdict(stats).items()
                                       if isinstance(v, (int, float, str, bool)) or v is None}


# --- the corpus, one child per model ----------------------------------------------------------------------------

def _emitter(path: Path, echo: bool):
    def emit(row: dict) -> None:
        with path.open("a") as file:
            file.write(json.dumps(row, default=str) + "\n")
        if echo:
            print(_line(row), flush=True)
    return emit


def _line(row: dict) -> str:
    def mib(value):
        return "-" if value is None else f"{value / 2**20:,.0f}"

    def pct(value):
        return "-" if value is None else f"{value:+.1%}"

    return (f"{row.get('model', ''):18s} {row.get('policy', ''):10s} {str(row.get('budget_kind') or ''):7s} "
            f"budget {mib(row.get('budget_bytes')):>7s} sim {mib(row.get('simulated_peak_bytes')):>7s} "
            f"meas {mib(row.get('measured_peak_bytes')):>7s} MiB (peak {pct(row.get('peak_error')):>7s}, "
            f"step {pct(row.get('step_error')):>7s}) {row.get('status', '')} {row.get('error') or ''}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=[case.name for case in CORPUS],
                        choices=[case.name for case in CORPUS])
    parser.add_argument("--out", type=Path, default=ROOT / "data" / "benchmarks" / "gpu")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--small", action="store_true", help="small sizes (a dry run of the code path)")
    parser.add_argument("--total-s", type=float, default=360.0, help="time for the whole corpus")
    parser.add_argument("--model-s", type=float, default=90.0, help="time for one model at most")
    parser.add_argument("--resume", action="store_true", help="skip the models <out>/gpu_corpus.jsonl already has")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # the child: one model
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_corpus: skipped, this machine has no CUDA device (nothing run, nothing written)")
        return
    args.out.mkdir(parents=True, exist_ok=True)
    rows = args.out / "gpu_corpus.jsonl"
    if args.one:
        import warnings

        warnings.filterwarnings("ignore", message=".*deterministic.*")  # warn_only: said once in the row, not per op
        torch.set_num_threads(min(4, os.cpu_count() or 1))
        device = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
        case = next(c for c in CORPUS if c.name == args.one)
        run_model(case, device, args.small, args.out, _emitter(rows, echo=True))
        return
    deadline = time.monotonic() + args.total_s
    done_before = set()
    if args.resume and rows.exists():
        done_before = {json.loads(line)["model"] for line in rows.read_text().splitlines()
                       if '"policy": "keep-all"' in line}
    for name in args.models:
        if name in done_before:
            print(f"  ({name}: in {rows.name} already)", flush=True)
            continue
        left = deadline - time.monotonic()
        if left < 10:
            _emitter(rows, echo=True)({"model": name, "status": "not run: the corpus's time was spent"})
            continue
        limit = min(args.model_s, left)
        command = [sys.executable, __file__, "--one", name, "--out", str(args.out), "--device", args.device,
                   *(["--small"] if args.small else [])]
        started = time.perf_counter()
        # deterministic cuBLAS for the compared step (set before the child's first cuBLAS call)
        env = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8", **os.environ, "PYTHONUNBUFFERED": "1"}
        try:
            done = subprocess.run(command, env=env, timeout=limit, capture_output=True, text=True)
            if done.returncode != 0:
                _emitter(rows, echo=True)({"model": name, "status": f"crashed (exit {done.returncode})",
                                           "error": done.stderr[-3000:]})
            print(done.stdout, end="", flush=True)
        except subprocess.TimeoutExpired as stopped:
            out = stopped.stdout.decode() if isinstance(stopped.stdout, bytes) else (stopped.stdout or "")
            print(out, end="", flush=True)
            _emitter(rows, echo=True)({"model": name, "status": f"stopped at its limit of {limit:.0f} s"})
        print(f"  ({name}: {time.perf_counter() - started:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
