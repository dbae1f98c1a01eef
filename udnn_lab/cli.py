"""The ``udnn-lab`` command: analyze a model's training step from the shell."""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import time
from pathlib import Path

import torch

from udnn_lab import zoo
from udnn_lab.analysis.tracing import trace
from udnn_lab.errors import UdnnLabError
from udnn_lab.measurement.measuring import measure
from udnn_lab.report.writing import ReportRequest, write_report
from udnn_lab.units import format_bytes
from udnn_lab.vocabulary import PHASES


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    try:
        return args.run(args)
    except (UdnnLabError, ValueError, TypeError, ImportError) as err:
        print(f"udnn-lab: error: {err}", file=sys.stderr)
        return 1


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="udnn-lab", description=__doc__)
    commands = parser.add_subparsers(dest="command")
    analyze = commands.add_parser("analyze", help="memory of one training step: breakdown, peak, curve")
    analyze.add_argument("model", help="a zoo name (see 'udnn-lab zoo') or module.path:factory returning an nn.Module")
    analyze.add_argument("--batch", type=int, default=8, help="batch size (default 8)")
    analyze.add_argument("--image-size", type=int, help="side of image inputs (zoo default: 224, 299 for Inception)")
    analyze.add_argument("--input-shape", help="one example's shape for your own module, e.g. 3,224,224")
    analyze.add_argument("--optimizer", default="sgd", choices=["sgd", "adam", "adamw", "none"])
    analyze.add_argument("--dtype", default="float32", choices=sorted(zoo.DTYPES))
    analyze.add_argument("--device", default="cpu", help="device whose step is predicted: cpu or cuda (default cpu)")
    analyze.add_argument("--out", type=Path, help="write the memory curve to OUT.csv and OUT.json")
    analyze.add_argument("--measure", action="store_true", help="also run the step for real here and compare")
    analyze.set_defaults(run=_analyze)
    report = commands.add_parser("report", help="an HTML report: peak, breakdown, curve, the plan at a budget")
    report.add_argument("model", help="a zoo name (see 'udnn-lab zoo')")
    report.add_argument("--budget", required=True, help="device memory to fit into, e.g. 6GiB, '300 MiB'")
    report.add_argument("--batch", type=int, default=8, help="batch size (default 8)")
    report.add_argument("--image-size", type=int, help="side of image inputs (zoo default: 224, 299 for Inception)")
    report.add_argument("--hardware", default="h100-sxm",
                        help="a hardware profile name (data/hardware/*.json) or a profile .json (default h100-sxm)")
    report.add_argument("--policy", default="auto", help="planning policy (default auto: the fastest that fits)")
    report.add_argument("--optimizer", default="sgd", choices=["sgd", "adam", "adamw", "none"])
    report.add_argument("--dtype", default="float32", choices=sorted(zoo.DTYPES))
    report.add_argument("--out", type=Path, default=Path("report.html"),
                        help="HTML file to write (default report.html)")
    report.set_defaults(run=_report)
    listing = commands.add_parser("zoo", help="list the models the zoo can build")
    listing.set_defaults(run=_zoo)
    return parser


def _zoo(args: argparse.Namespace) -> int:
    for name, description in zoo.describe().items():
        print(f"{name:16s} {description}")
    return 0


def _analyze(args: argparse.Namespace) -> int:
    work = _workload(args, device="meta")
    print(f"tracing {work.name} (batch {args.batch}, {args.dtype}, optimizer {args.optimizer}) ...", file=sys.stderr)
    start = time.perf_counter()
    graph = trace(work, device=args.device)
    elapsed = time.perf_counter() - start
    _print_summary(graph, elapsed)
    if args.out is not None:
        _write_curve(graph, args, args.out)
    if args.measure:
        real = _workload(args, device=_real_device(args.device))
        print(f"measuring one real step on {args.device} ...", file=sys.stderr)
        summary = measure(real, repeats=1).summary(graph)
        print(f"\nmeasured peak {format_bytes(summary['measured_peak_bytes'])}  predicted "
              f"{format_bytes(summary['predicted_peak_bytes'])}  (peak error {summary['peak_relative_error']:.3%}, "
              f"worst step error {summary['max_step_relative_error']:.3%})")
    return 0


def _report(args: argparse.Namespace) -> int:
    request = ReportRequest(args.model, args.budget, batch=args.batch, hardware=args.hardware, policy=args.policy,
                            image_size=args.image_size, optimizer=args.optimizer, dtype=args.dtype)
    write_report(request, args.out, progress=lambda line: print(line, file=sys.stderr))
    return 0


def _real_device(device: str) -> str:
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("--measure --device cuda needs a CUDA device, and this machine has none")
    return device


def _workload(args: argparse.Namespace, device: str):
    optimizer = None if args.optimizer == "none" else args.optimizer
    dtype = zoo.DTYPES[args.dtype]
    shape = tuple(int(x) for x in args.input_shape.split(",")) if args.input_shape else None
    if ":" in args.model:
        module = _import_factory(args.model)
        if shape is None:
            raise ValueError("for your own module give --input-shape, e.g. --input-shape 3,224,224")
        module = module.to(device=device if device != "meta" else "cpu", dtype=dtype)
        return zoo.get(module, batch=args.batch, input_shape=shape, device=device if device != "meta" else "cpu",
                       dtype=dtype, optimizer=optimizer)
    return zoo.get(args.model, batch=args.batch, image_size=args.image_size, input_shape=shape, device=device,
                   dtype=None if dtype is torch.float32 else dtype, optimizer=optimizer)


def _import_factory(spec: str) -> torch.nn.Module:
    module_name, _, attribute = spec.partition(":")
    try:
        factory = getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError) as err:
        raise ValueError(f"cannot load {spec!r}: {err}; give module.path:callable") from err
    model = factory() if callable(factory) and not isinstance(factory, torch.nn.Module) else factory
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"{spec} gave a {type(model).__name__}, not an nn.Module")
    return model


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


def _write_curve(graph, args: argparse.Namespace, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    curve = graph.memory_curve()
    curve.to_csv(out.with_suffix(".csv"), index=False)
    document = {
        "model": graph.model_name, "batch": args.batch, "device": graph.device, "dtype": args.dtype,
        "optimizer": args.optimizer, "torch_version": graph.torch_version, "notes": list(graph.notes),
        "peak_bytes": graph.peak_bytes, "cuda_peak_bytes": graph.cuda_peak_bytes, "peak_step": graph.peak_step,
        "baseline_bytes": graph.baseline_bytes,
        "breakdown": {k: {c: (v.item() if hasattr(v, "item") else v) for c, v in row.items()}
                      for k, row in graph.breakdown().iterrows()},
        "curve": json.loads(curve.to_json(orient="records")),
    }
    out.with_suffix(".json").write_text(json.dumps(document, indent=1))
    print(f"wrote {out.with_suffix('.csv')} and {out.with_suffix('.json')}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
