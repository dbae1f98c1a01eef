"""The ``udnn-lab`` command: analyze a model's training step from the shell.

Startup time: ``udnn-lab --help`` answers before torch loads. The names the options accept
(policies, hardware profiles, dtypes, optimizers) come from their registries, loaded only once
a command is named; each command loads its stage (and torch) when it runs. ``report`` starts its
notebook's kernel before all that, so that the kernel's imports run while this process loads its own.
"""

from __future__ import annotations

import argparse
import gc
import json
import re
import sys
import time
import traceback
import warnings
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, replace
from itertools import repeat
from pathlib import Path
from typing import Any

from udnn_lab.errors import ModelFactoryError, UdnnLabError
from udnn_lab.units import format_bytes, format_seconds
from udnn_lab.vocabulary import ATTENTION_IMPLEMENTATIONS, PHASES, PRECISIONS

COMMANDS = {
    "analyze": "memory of one training step: breakdown, peak, curve",
    "report": "an HTML report: peak, breakdown, curve, the plan at a budget",
    "zoo": "list the models the zoo can build",
    "max-batch": "the largest batch size whose training step fits a budget",
    "max-seq-len": "the longest sequence (hf: models) whose training step fits a budget",
    "train": "train a few steps for real, in one process or over DDP/FSDP ranks, and print each step",
}
MODEL_HELP = "a zoo name (see 'udnn-lab zoo') or package.module:factory, a callable returning your nn.Module"
THIS_GPU = "this machine's GPU's profile, else the closest shipped one, named in a warning"
# their values may start with '-' ('-1GB'): the size says what is wrong
SIZE_OPTIONS = ("--budget", "--host-budget", "--outside")
# errors that end a command with one line (the traceback with --debug): udnn_lab's, bad input, out of memory
ONE_LINE_ERRORS = (UdnnLabError, ValueError, TypeError, ImportError, MemoryError, RuntimeError)


@dataclass(frozen=True)
class Names:
    """What the options accept, from the registries."""

    policies: tuple[str, ...]
    hardware: tuple[str, ...]
    dtypes: tuple[str, ...]
    optimizers: tuple[str, ...]
    attention: tuple[str, ...] = ()  # attention implementations of hf: models


def main(argv: list[str] | None = None) -> int:
    argv = _joined_size_values(sys.argv[1:] if argv is None else list(argv))
    with _report_kernel(argv) as kernel, warnings.catch_warnings():
        warnings.showwarning = _show_warning
        parser = _parser(registered_names() if _command_named(argv) else None)
        args = parser.parse_args(argv)
        if args.command is None:
            parser.print_help()
            return 2
        args.kernel = kernel
        try:
            return args.run(args)
        except ModelFactoryError as err:  # the user's code failed: one line, the traceback with --debug
            return _fail(err, args.debug, 2)
        except ONE_LINE_ERRORS as err:
            return _fail(err, args.debug, 1)


def _fail(err: BaseException, debug: bool, code: int) -> int:
    """One line: the error's first (its messages say what was wrong and what to do there); all of it with --debug."""
    if debug:
        traceback.print_exception(err)
        print(f"udnn-lab: error: {err}", file=sys.stderr)
        return code
    lines = str(err).strip().splitlines() or [type(err).__name__]
    print(f"udnn-lab: error: {lines[0]} (--debug shows {'more' if len(lines) > 1 else 'the traceback'})",
          file=sys.stderr)
    return code


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """A warning as one line, as errors are."""
    print(f"udnn-lab: warning: {str(message).strip().splitlines()[0] if str(message).strip() else category.__name__}",
          file=sys.stderr)


def _joined_size_values(argv: list[str]) -> list[str]:
    """``--budget -1GB`` as ``--budget=-1GB``: argparse takes a value starting with '-' for an option, and the size
    itself then says what is wrong with it."""
    joined: list[str] = []
    words = iter(argv)
    for word in words:
        if word in SIZE_OPTIONS:
            value = next(words, None)
            negative = value is not None and value.startswith("-") and not value.startswith("--")
            joined.extend([f"{word}={value}"] if negative else [word] if value is None else [word, value])
        else:
            joined.append(word)
    return joined


def _command_named(argv: list[str]) -> str | None:
    first = next((word for word in argv if not word.startswith("-")), None)
    return first if first in COMMANDS else None


def _report_kernel(argv: list[str]) -> AbstractContextManager[Any]:
    """For ``report`` (not its help), the notebook's kernel, started before anything else: it spends seconds loading
    torch and altair, meanwhile this process loads its own and checks the request. For the others, nothing."""
    if _command_named(argv) != "report" or {"-h", "--help"} & set(argv):
        return nullcontext()
    # startup time: the kernel's module loads no torch, so the kernel starts at once
    from udnn_lab.report.kernel import kernel_started, without_iri_format_checks

    without_iri_format_checks()  # this process is the command's own: it writes the report, checks no 'iri's
    return kernel_started()


def registered_names() -> Names:
    # startup time: torch and the registries load here, once a command is named, not for --help
    from udnn_lab import zoo
    from udnn_lab.hardware import Hardware
    from udnn_lab.planning.registry import POLICIES  # (as above)

    return Names(policies=tuple(POLICIES), hardware=tuple(Hardware.names()), dtypes=tuple(zoo.DTYPES),
                 optimizers=tuple(zoo.OPTIMIZERS), attention=ATTENTION_IMPLEMENTATIONS)


def input_shape(text: str) -> tuple[int, ...]:
    """One example's shape as typed: '3x224x224', '3,224,224' or '784'."""
    words = re.split(r"\s*[x,×]\s*", text.strip().lower())
    if not all(word.isdigit() and int(word) > 0 for word in words):
        raise argparse.ArgumentTypeError(f"cannot read {text!r} as a shape: give positive sizes separated by 'x' "
                                         "or ',', e.g. 3x224x224 or 3,224,224")
    return tuple(int(word) for word in words)


def _positive_int(text: str) -> int:
    if not text.strip().isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a positive whole number, got {text!r}")
    return int(text)


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive number, e.g. 1.0, got {text!r}")
    return value


def _parser(names: Names | None = None) -> argparse.ArgumentParser:
    """The command line; without ``names`` (no command given) the options list no choices."""
    parser = argparse.ArgumentParser(prog="udnn-lab", description="How much memory a training step needs, from the "
                                     "shell: analyze a model, write a report at a budget, list the zoo.")
    parser.add_argument("--debug", action="store_true", help="on an error, print the whole traceback")
    common = argparse.ArgumentParser(add_help=False)  # --debug after the command too; SUPPRESS keeps one given before
    common.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                        help="on an error, print the whole traceback")
    commands = parser.add_subparsers(dest="command")
    step = argparse.ArgumentParser(add_help=False)
    step.add_argument("model", help=MODEL_HELP)
    step.add_argument("--batch", type=int, default=8, help="batch size (default 8)")
    step.add_argument("--image-size", type=int, help="side of image inputs (zoo default: 224, 299 for Inception)")
    step.add_argument("--input-shape", type=input_shape,
                      help="one example's shape, for your own module: 3x224x224 or 3,224,224")
    step.add_argument("--optimizer", default="default", choices=("default", *names.optimizers) if names else None,
                      help="optimizer of the step (default: the zoo's own, SGD with momentum, AdamW for hf: models; "
                           "none: forward and backward only)")
    step.add_argument("--dtype", default="float32", choices=names.dtypes if names else None,
                      help="dtype of the weights and the batch (default float32)")
    step.add_argument("--seq-len", type=int, help="tokens per example, for hf: models (default 512)")
    step.add_argument("--attn-implementation", choices=names.attention if names else None,
                      help="attention of hf: models (default: what transformers picks, sdpa where torch has it)")
    step.add_argument("--lora-rank", type=int,
                      help="train LoRA adapters of this rank (PEFT, on PEFT's default modules) on the frozen hf: model")
    step.add_argument("--precision", choices=PRECISIONS,
                      help="the step's precision, named as PyTorch Lightning names it (default: --dtype's, "
                           "32-true): -mixed runs autocast over float32 weights, 16-mixed with a GradScaler; "
                           "-true trains weights and optimizer state in that dtype")
    step.add_argument("--grad-accumulation", type=_positive_int, default=1, metavar="N",
                      help="micro-batches of --batch examples whose gradients add up before each optimizer "
                           "step (default 1)")
    step.add_argument("--clip-grad-norm", type=_positive_float, metavar="MAX_NORM",
                      help="clip the gradients' total norm to MAX_NORM before the optimizer step (default: no "
                           "clipping)")

    analyze = commands.add_parser("analyze", parents=[step, common], help=COMMANDS["analyze"])
    analyze.add_argument("--device", default="cpu", help="device whose step is predicted: cpu or cuda (default cpu)")
    analyze.add_argument("--out", type=Path, help="write the memory curve to OUT.csv and OUT.json")
    analyze.add_argument("--measure", action="store_true", help="also run the step for real here and compare")
    analyze.set_defaults(run=_analyze)

    report = commands.add_parser("report", parents=[step, common], help=COMMANDS["report"])
    report.add_argument("--budget", required=True,
                        help="device memory to fit into, e.g. 6GiB, '300 MiB', 339.7MiB, 4GB or bytes")
    hardware = f" ({', '.join(names.hardware)})" if names else ""
    report.add_argument("--hardware",
                        help=f"a hardware profile name{hardware} or a profile .json (default: {THIS_GPU})")
    report.add_argument("--policy", default="auto", choices=names.policies if names else None,
                        help="planning policy (default auto: the fastest that fits)")
    report.add_argument("--out", type=Path, default=Path("report.html"),
                        help="HTML file to write (default report.html)")
    report.add_argument("--snapshot", help="a memory snapshot of a real run of this step (the file "
                                           "torch.cuda.memory._dump_snapshot writes): laid over the prediction")
    report.set_defaults(run=_report)

    train = commands.add_parser("train", parents=[step, common], help=COMMANDS["train"],
                                description="Train MODEL for real on the zoo's random example batch (the same "
                                            "batch every step), printing each step as it ends; with --parallel, "
                                            "over --world-size rank processes started here, each training on its "
                                            "share of the batch. Ctrl-C ends every rank.")
    train.add_argument("--steps", type=_positive_int, default=5, help="optimizer steps to run (default 5)")
    train.add_argument("--parallel", choices=("ddp", "fsdp"),
                       help="spread the run over ranks: ddp (DistributedDataParallel) or fsdp (FSDP2); gloo on "
                            "cpu, NCCL with one GPU per rank on cuda (default: one process)")
    train.add_argument("--world-size", type=_positive_int, default=2,
                       help="ranks of --parallel (default 2); --batch must be a multiple of it")
    train.add_argument("--device", default="cpu", help="where the model trains: cpu or cuda (default cpu)")
    train.add_argument("--policy", choices=names.policies if names else None,
                       help="run every step under this planning policy's plan (for --parallel, each rank's own)")
    train.add_argument("--budget", help="device memory the plan fits into, e.g. 6GiB (with --policy; alone it "
                                        "plans with auto)")
    train.add_argument("--hardware", help=f"the hardware profile the plan is made for{hardware} (default: the profile "
                                          "of this machine's --device)")
    train.set_defaults(run=_train)

    listing = commands.add_parser("zoo", parents=[common], help=COMMANDS["zoo"])
    listing.set_defaults(run=_zoo)
    _add_fit_commands(commands, common, names)
    return parser


def _add_fit_commands(commands, common: argparse.ArgumentParser, names: Names | None) -> None:
    """max-batch and max-seq-len: the same search over the batch size or the sequence length."""
    fit = argparse.ArgumentParser(add_help=False)
    fit.add_argument("model", help=MODEL_HELP)
    fit.add_argument("--budget", help="device memory to fit into, e.g. 80GiB or bytes (default: all the hardware's)")
    hardware = f" ({', '.join(names.hardware)})" if names else ""
    fit.add_argument("--hardware", help=f"a hardware profile name{hardware} or a profile .json (default: {THIS_GPU})")
    fit.add_argument("--policy", default="keep-all", choices=names.policies if names else None,
                     help="fit with every tensor kept (keep-all, the default) or under a planning policy")
    fit.add_argument("--optimizer", default="default", choices=("default", *names.optimizers) if names else None,
                     help="optimizer of the step (default: the zoo's own)")
    fit.add_argument("--dtype", default="float32", choices=names.dtypes if names else None,
                     help="dtype of the weights and the batch (default float32)")
    fit.add_argument("--start", type=int, default=1, help="the first size to try (default 1)")
    fit.add_argument("--limit", type=int, help="the largest size to try")
    fit.add_argument("--multiple-of", type=int, default=1, help="try only multiples of this (default 1)")
    fit.add_argument("--host-budget", default="local",
                     help="host memory a plan's offloads may take, e.g. 512GiB; 'local': half of what this machine "
                          "has available (the default), 'none': not checked")
    fit.add_argument("--counts", default="allocated", choices=("allocated", "reserved"),
                     help="what the budget counts: live tensors' bytes (allocated, the default), or what the caching "
                          "allocator reserves plus --outside (reserved: the number an out-of-memory error is about)")
    fit.add_argument("--outside", default="0",
                     help="with --counts reserved: what the process holds outside the allocator (the CUDA context, "
                          "libraries' workspaces), e.g. 600MiB: the device's used memory less memory_reserved()")

    batch = commands.add_parser("max-batch", parents=[fit, common], help=COMMANDS["max-batch"])
    batch.add_argument("--seq-len", type=int, help="sequence length of an hf: model (default 512)")
    batch.add_argument("--image-size", type=int, help="side of image inputs (zoo default: 224, 299 for Inception)")
    batch.add_argument("--input-shape", type=input_shape,
                       help="one example's shape, for your own module: 3x224x224 or 3,224,224")
    batch.set_defaults(run=_max_size, dimension="batch")

    length = commands.add_parser("max-seq-len", parents=[fit, common], help=COMMANDS["max-seq-len"])
    length.add_argument("--batch", type=int, default=1, help="batch size (default 1)")
    length.set_defaults(run=_max_size, dimension="seq_len")


def _zoo(args: argparse.Namespace) -> int:
    # startup time: each command loads its stage when it runs (see the module docstring)
    from udnn_lab import zoo

    for name, description in zoo.describe().items():
        print(f"{name:16s} {description}")
    return 0


def _analyze(args: argparse.Namespace) -> int:
    # startup time: each command loads its stage when it runs (see the module docstring)
    from udnn_lab.analysis import trace

    work = _workload(args, device="meta")
    optimizer = type(work.optimizer).__name__ if work.optimizer is not None else "none"
    accumulation = f", {work.grad_accumulation} micro-batches" if work.grad_accumulation > 1 else ""
    clipping = f", clip grad norm {work.clip_grad_norm:g}" if work.clip_grad_norm is not None else ""
    print(f"tracing {work.name} (batch {args.batch}{accumulation}, precision {work.precision}, optimizer "
          f"{optimizer}{clipping}) ...", file=sys.stderr)
    start = time.perf_counter()
    graph = trace(work, device=args.device)
    _print_summary(graph, time.perf_counter() - start)
    if args.out is not None:
        _write_curve(graph, work, args, args.out, optimizer)
    if args.measure:
        _measure_here(args, graph)
    return 0


def _measure_here(args: argparse.Namespace, graph) -> None:
    # startup time: each command loads its stage when it runs (see the module docstring)
    import torch

    from udnn_lab.measurement import measure  # (as above)

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("--measure --device cuda needs a CUDA device, and this machine has none")
    real = _workload(args, device=args.device)
    print(f"measuring one real step on {args.device} ...", file=sys.stderr)
    summary = measure(real, graph=graph).summary(graph)
    print(f"\nmeasured peak {format_bytes(summary['measured_peak_bytes'])}  predicted "
          f"{format_bytes(summary['predicted_peak_bytes'])}  (peak error {summary['peak_relative_error']:.3%}, "
          f"worst step error {summary['max_step_relative_error']:.3%})")


def _report(args: argparse.Namespace) -> int:
    # startup time: each command loads its stage when it runs (see the module docstring)
    from udnn_lab.report import ReportRequest, write_report

    request = ReportRequest(args.model, args.budget, batch=args.batch, hardware=args.hardware, policy=args.policy,
                            image_size=args.image_size, input_shape=args.input_shape, optimizer=args.optimizer,
                            dtype=args.dtype, seq_len=args.seq_len, attn_implementation=args.attn_implementation,
                            lora_rank=args.lora_rank, precision=args.precision,
                            grad_accumulation=args.grad_accumulation, clip_grad_norm=args.clip_grad_norm,
                            snapshot=args.snapshot)
    request.check_names()  # a mistyped name is said before a profile is looked for (or measured)
    request = replace(request, hardware=_by_name(args.hardware, _hardware(args.hardware)))
    write_report(request, args.out, progress=lambda line: print(line, file=sys.stderr), kernel=args.kernel)
    return 0


def _train(args: argparse.Namespace) -> int:
    # startup time: each command loads its stage when it runs (see the module docstring)
    import udnn_lab as ul

    spec = None
    if args.parallel is not None:
        if args.batch % args.world_size:
            raise ValueError(f"--batch {args.batch} does not split over --world-size {args.world_size}: give a "
                             f"batch that is a multiple of {args.world_size}")
        spec = (ul.DDP if args.parallel == "ddp" else ul.FSDP)(args.world_size)
    work = _workload(args, device=args.device)
    plans = _train_plans(args, spec)
    world = spec.world_size if spec is not None else 1
    print(f"training {work.name} for {args.steps} steps (batch {args.batch}, precision {work.precision}"
          + (f", {args.parallel} over {world} ranks" if spec is not None else "")
          + (f", plan {plans[0].policy}" if plans else "") + ") ...", file=sys.stderr)
    try:
        run = ul.train(work.model, repeat((work.example_input, work.target), args.steps * args.grad_accumulation),
                       work.optimizer, loss_fn=work.loss_fn, steps=args.steps, parallel=spec,
                       plan=(plans if spec is not None else plans[0]) if plans else None,
                       precision=work.precision, grad_accumulation=args.grad_accumulation,
                       clip_grad_norm=args.clip_grad_norm, callbacks=[_print_step(world)], progress=False,
                       name=work.name)
    except KeyboardInterrupt:
        print("udnn-lab: interrupted; every rank was ended" if spec is not None else "udnn-lab: interrupted",
              file=sys.stderr)
        return 130
    _print_run(run, world)
    return 0


def _train_plans(args: argparse.Namespace, spec) -> list:
    """One plan per rank (a rank's step traced at its share of the batch), or none without --policy/--budget."""
    if args.policy is None and args.budget is None:
        return []
    # startup time: each command loads its stage when it runs (see the module docstring)
    import udnn_lab as ul

    world = spec.world_size if spec is not None else 1
    rank_args = argparse.Namespace(**{**vars(args), "batch": args.batch // world})
    work = _workload(rank_args, device="meta")
    device = "cuda" if args.device.startswith("cuda") else "cpu"
    profile = _hardware(args.hardware, device, file=sys.stderr)  # with the rest of train's narration
    return [ul.plan(ul.trace(work, device=device, parallel=replace(spec, rank=rank) if spec is not None else None),
                    args.budget, args.policy or "auto", hardware=profile) for rank in range(world)]


def _print_step(world: int):
    def show(row: dict) -> None:
        peaks = ", ".join(f"{format_bytes(row[f'peak_bytes_rank{r}'])} (rank {r})" for r in range(world)) if world > 1 \
            else format_bytes(row["peak_bytes"])
        print(f"step {row['step']}: loss {row['loss']:.4g}, {format_seconds(row['time_s'])}, peak {peaks}",
              file=sys.stderr)
    return show


def _print_run(run, world: int) -> None:
    peaks = [f"peak_bytes_rank{r}" for r in range(world)] if world > 1 else ["peak_bytes"]
    names = [f"peak rank {r}" for r in range(world)] if world > 1 else ["peak"]
    print(f"{'step':>4s} {'loss':>10s} {'time':>10s} {'offloaded':>10s} " + " ".join(f"{name:>12s}" for name in names))
    for row in run.steps.to_dict("records"):
        print(f"{row['step']:4d} {row['loss']:10.4g} {format_seconds(row['time_s']):>10s} "
              f"{format_bytes(row['d2h_bytes']):>10s} "
              + " ".join(f"{format_bytes(row[column]):>12s}" for column in peaks))
    print(f"\n{run!r}")
    for note in run.notes:
        print(f"note: {note}")


def _max_size(args: argparse.Namespace) -> int:
    # startup time: each command loads its stage when it runs (see the module docstring)
    from udnn_lab import zoo
    from udnn_lab.fitting import max_batch, max_seq_len  # (as above)

    options = {key: value for key, value in (("seq_len", getattr(args, "seq_len", None)),
                                             ("image_size", getattr(args, "image_size", None)),
                                             ("input_shape", getattr(args, "input_shape", None))) if value is not None}
    own_module = ":" in args.model and not args.model.lower().startswith(zoo.hf_configs.PREFIX)
    if own_module and "input_shape" not in options:
        raise ValueError("for your own module give --input-shape, one example's shape, e.g. --input-shape 3x224x224")
    if args.dtype != "float32":
        options["dtype"] = zoo.DTYPES[args.dtype]
    options["optimizer"] = None if args.optimizer == "none" else args.optimizer
    search = dict(budget=args.budget, policy=args.policy, hardware=_hardware(args.hardware), start=args.start,
                  limit=args.limit,
                  multiple_of=args.multiple_of, progress=None,
                  host_budget=None if args.host_budget.lower() == "none" else args.host_budget,
                  counts=args.counts, outside_bytes=args.outside)
    found = max_batch(args.model, **search, **options) if args.dimension == "batch" else \
        max_seq_len(args.model, batch=args.batch, **search, **options)
    _print_probes(found, args.dimension)
    for note in found.notes:
        print(f"note: {note}")
    what = "batch size" if args.dimension == "batch" else "sequence length"
    answer = f"largest {what}: {found.size}" if found.fits else f"no {what} fits"
    print(f"\n{answer} ({found.model_name}, {format_bytes(found.budget_bytes)}, {found.policy} on {found.hardware}); "
          f"{found.stopped}; {len(found.probes)} probes")
    return 0


def _print_probes(found, dimension: str) -> None:
    """One row per size tried: its peak (under a plan, also the peak with every tensor kept), host bytes, fits."""
    host = found.host_budget_bytes is not None
    planned = found.policy != "keep-all"  # under keep-all the plan's peak is the traced one: one column
    peaks = ["peak (plan)", "peak (all kept)"] if planned else ["peak"]
    print(f"{dimension:>8s} " + " ".join(f"{name:>15s}" for name in peaks) + (f" {'host':>12s}" if host else "")
          + "  fits")
    for probe in sorted(found.probes, key=lambda p: p.size):
        sizes = [probe.peak_bytes, probe.traced_peak_bytes] if planned else [probe.peak_bytes]
        print(f"{probe.size:8d} " + " ".join(f"{format_bytes(size):>15s}" for size in sizes)
              + (f" {format_bytes(probe.host_bytes):>12s}" if host else "") + f"  {'yes' if probe.fits else 'no'}")


def _hardware(name: str | None, device: str | None = None, file=None):
    """The profile a command plans or simulates on, said on a line of its own (to ``file``, default stdout): the one
    named, else the one for this machine's ``device`` (resolve_hardware: a shipped stand-in is named in a warning);
    a command not told a device predicts GPU memory (PREDICTED_DEVICE)."""
    # startup time: each command loads its stage when it runs (see the module docstring)
    from udnn_lab.hardware import PREDICTED_DEVICE
    from udnn_lab.simulation.simulator import resolve_hardware

    device = device or PREDICTED_DEVICE
    profile = resolve_hardware(name, device)
    print(f"hardware profile: {profile.name} ({profile.title}, {format_bytes(profile.memory_bytes)} of "
          f"{profile.device_type} memory)", file=file or sys.stdout)
    return profile


def _by_name(given: str | None, profile) -> str | None:
    """What the report's notebook is given for ``profile``: its name where it is shipped, the .json path given,
    else None (the notebook then finds the same profile for this machine)."""
    # startup time: each command loads its stage when it runs (see the module docstring)
    from udnn_lab.hardware import Hardware

    if profile.name in Hardware.names():
        return profile.name
    return given if given is not None and given.lower().endswith(".json") else None


def _workload(args: argparse.Namespace, device: str):
    # startup time: each command loads its stage when it runs (see the module docstring)
    from udnn_lab import zoo
    from udnn_lab.workload import as_workload  # (as above)

    own_module = ":" in args.model and not args.model.lower().startswith(zoo.hf_configs.PREFIX)
    if own_module and args.input_shape is None:
        raise ValueError("for your own module give --input-shape, one example's shape, e.g. --input-shape 3x224x224")
    work = zoo.get(args.model, batch=args.batch, image_size=args.image_size, input_shape=args.input_shape,
                   device=device, dtype=None if args.dtype == "float32" else zoo.DTYPES[args.dtype],
                   optimizer=None if args.optimizer == "none" else args.optimizer, seq_len=args.seq_len,
                   attn_implementation=args.attn_implementation, lora_rank=args.lora_rank,
                   precision=args.precision)
    return as_workload(work, grad_accumulation=args.grad_accumulation, clip_grad_norm=args.clip_grad_norm)


def _print_summary(graph, elapsed: float) -> None:
    counts = {phase: sum(op.phase == phase for op in graph.ops) for phase in PHASES}
    print(f"{graph.model_name}: {len(graph.ops)} ops (forward {counts['forward']}, backward {counts['backward']}, "
          f"optimizer {counts['optimizer']}), {len(graph.tensors)} tensors, traced in {elapsed:.2f} s")
    for note in graph.notes:
        print(f"note: {note}")
    breakdown = graph.breakdown()
    print(f"\n{'category':20s} {'at peak':>12s} {'share':>7s} {'own max':>12s}")
    for category, row in breakdown.iterrows():
        print(f"{category:20s} {format_bytes(row.bytes_at_peak):>12s} {row.share_at_peak:7.1%} "
              f"{format_bytes(row.max_bytes):>12s}")
    peak_op = graph.ops[graph.peak_step] if graph.peak_step >= 0 else None
    where = f"after op {peak_op.index} {peak_op.name} in {peak_op.module or '(model)'} ({peak_op.phase})" \
        if peak_op else "before the first op"
    print(f"\npeak {format_bytes(graph.peak_bytes)} ({graph.peak_bytes} bytes) {where}")
    print(f"CUDA caching allocator (512-byte blocks): {format_bytes(graph.cuda_peak_bytes)} "
          f"({graph.cuda_peak_bytes} bytes)")


def _write_curve(graph, work, args: argparse.Namespace, out: Path, optimizer: str) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    curve = graph.memory_curve()
    curve.to_csv(out.with_suffix(".csv"), index=False)
    document = {
        "model": graph.model_name, "batch": args.batch, "device": graph.device, "dtype": args.dtype,
        "precision": work.precision, "grad_accumulation": work.grad_accumulation,
        "clip_grad_norm": work.clip_grad_norm,
        "optimizer": optimizer, "torch_version": graph.torch_version, "notes": list(graph.notes),
        "seq_len": args.seq_len, "attn_implementation": args.attn_implementation, "lora_rank": args.lora_rank,
        "peak_bytes": graph.peak_bytes, "cuda_peak_bytes": graph.cuda_peak_bytes, "peak_step": graph.peak_step,
        "baseline_bytes": graph.baseline_bytes,
        "breakdown": {k: {c: (v.item() if hasattr(v, "item") else v) for c, v in row.items()}
                      for k, row in graph.breakdown().iterrows()},
        "curve": json.loads(curve.to_json(orient="records")),
    }
    out.with_suffix(".json").write_text(json.dumps(document, indent=1))
    print(f"wrote {out.with_suffix('.csv')} and {out.with_suffix('.json')}", file=sys.stderr)


def run() -> None:
    """The console script: ``main`` with the command line, then exit.

    Without the collector's sweeps at exit: the interpreter's teardown, with torch (and for a
    report papermill and jupyter_client) loaded, spends one to two seconds collecting objects that
    the process's end frees anyway. Frozen, they are left to it.
    """
    code = main()
    gc.freeze()
    sys.exit(code)


if __name__ == "__main__":
    run()
