"""Fit a hardware profile's rate curve from per-op profiles measured on that device, and say how it simulates.

Reads the ``*-profile.json.gz`` files ``benchmarks/gpu_corpus.py`` writes (``ul.profile`` of each model's
keep-all step; from a directory or a .tgz of one), fits ``RateCurve.fit`` on all but ``--held-out`` models and
prints, for every model, the measured step against the step simulated with the profile's figures alone and
with the fitted curve (the held-out ones are the test). With ``--out`` the curve is written where the
simulator looks for it (``data/rates/<hardware>.json``). Reads files only: no GPU needed.

    python benchmarks/fit_rates.py data/benchmarks/gpu/<run>/diagnostics.tgz --hardware nvidia-h200-measured
        [--held-out gpt2 densenet121] [--out data/rates/nvidia-h200-measured.json]
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
import tarfile
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from udnn_lab.cost import CostModel, Profile, RateCurve  # noqa: E402
from udnn_lab.hardware import Hardware  # noqa: E402


class Profiled(NamedTuple):
    profile: Profile
    compute_dtypes: tuple[str, ...] | None  # per op, where the corpus could align the trace with the profile


def profiles(source: Path) -> Iterator[tuple[str, Profiled]]:
    """(model, Profiled) for each ``<model>-profile.json.gz`` in a directory or a .tgz of one."""
    def read(name: str, data: bytes) -> tuple[str, Profiled]:
        fields = json.loads(gzip.decompress(data))
        dtypes = fields.pop("compute_dtypes", None)
        tuples = {k: tuple(v) if isinstance(v, list) else v for k, v in fields.items()}
        return (Path(name).name.removesuffix("-profile.json.gz"),
                Profiled(Profile(**tuples), tuple(dtypes) if dtypes else None))

    if source.is_dir():
        for path in sorted(source.rglob("*-profile.json.gz")):
            yield read(path.name, path.read_bytes())
        return
    with tarfile.open(source) as archive:
        for member in sorted(archive.getmembers(), key=lambda m: m.name):
            if member.name.endswith("-profile.json.gz"):
                yield read(member.name, archive.extractfile(member).read())


def simulated_step_s(found: Profiled, cost: CostModel) -> float:
    """The profile's ops priced one after another by ``cost`` (compute alone: what the keep-all step is), each in
    its compute dtype where known, else float32."""
    p = found.profile
    dtypes = found.compute_dtypes or ("float32",) * len(p.ops)
    return sum(cost.roofline_s(name, flops, read + written, dtype) for name, flops, read, written, dtype in
               zip(p.ops, p.flops, p.bytes_read, p.bytes_written, dtypes))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("sources", type=Path, nargs="+", help="directories or .tgz files of profiles")
    parser.add_argument("--hardware", required=True, help="the profile whose curve this is (a shipped name)")
    parser.add_argument("--held-out", nargs="*", default=[], help="models kept out of the fit, to test it on")
    parser.add_argument("--out", type=Path, help="write the curve here (data/rates/<hardware>.json to ship it)")
    args = parser.parse_args()
    found = dict(item for source in args.sources for item in profiles(source))
    if not found:
        raise SystemExit(f"no *-profile.json.gz in {', '.join(map(str, args.sources))}: run the GPU corpus first")
    hardware = Hardware.load(args.hardware)
    fitted_on = {name: p for name, p in found.items() if name not in args.held_out}
    devices = {p.profile.device_name for p in found.values()}
    torch_version = next(iter(found.values())).profile.torch_version
    # each op's compute dtype: a bf16 matmul and a float32 one are different rates
    curve = RateCurve.fit([p.profile for p in fitted_on.values()], dtypes=[p.compute_dtypes for p in
                                                                           fitted_on.values()],
                          source=f"ul.profile of {', '.join(sorted(fitted_on))} on {', '.join(sorted(devices))}, "
                          f"torch {torch_version}")
    plain, with_curve = CostModel(hardware), CostModel(hardware, rates=curve)
    print(f"{'model':20s} {'measured':>10s} {'figures':>16s} {'fitted curve':>16s}")
    for name, p in sorted(found.items()):
        measured = p.profile.step_time_s
        a, b = simulated_step_s(p, plain), simulated_step_s(p, with_curve)
        held = " (held out)" if name in args.held_out else ""
        print(f"{name:20s} {measured * 1e3:8.1f}ms {a * 1e3:8.1f}ms {a / measured - 1:+6.0%} "
              f"{b * 1e3:8.1f}ms {b / measured - 1:+6.0%}{held}")
    if args.out:
        curve.save(args.out)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
