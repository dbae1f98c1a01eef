"""Does the trace's ``rebuilds_views`` hold on every torchvision classifier and every ``hf:`` config (NOTE [view
replay] 4)?

For each torchvision classifier, built from code with random weights at a small input, and each of the zoo's
Hugging Face configs (small; 32 tokens where it takes tokens) in 32-true and bf16-mixed: the trace says whether
the step writes in place, under autograd, into a storage a view shares; then one real forward and backward runs
with view replay and one without, and their op sequences are compared. A step the trace says rebuilds no view must
run the same ops either way (the runtime then runs it without view replay); one it says rebuilds a view
should differ (else view replay was turned on where it was not needed, which costs time, not correctness).

    python benchmarks/view_writes.py [--out data/benchmarks/view_writes.json] [--limit N]
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from datetime import datetime, timezone
from functools import partial
from pathlib import Path

import torch
import torchvision
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import udnn_lab as ul  # noqa: E402
from udnn_lab.analysis.recording import real_step_ops  # noqa: E402
from udnn_lab.workload import Workload  # noqa: E402

LARGE_INPUTS = {"inception_v3": 299}  # the smallest input each family takes; 64 px otherwise
PATCHED = ("vit", "swin", "maxvit")  # fixed 224-px inputs
IMAGE_MODELS = {"hf:vit-b-16"}  # Hugging Face configs that take images at their config's size


def _loss(output, target):
    return nn.functional.cross_entropy(output if isinstance(output, torch.Tensor) else output[0], target)


def _classifier(name: str) -> tuple[Workload, dict]:
    size = LARGE_INPUTS.get(name, 224 if name.startswith(PATCHED) else 64)
    torch.manual_seed(0)
    model = torchvision.models.get_model(name, num_classes=10)
    return Workload(model, torch.randn(2, 3, size, size), torch.randint(10, (2,)), _loss, None, name=name), \
        {"image_size": size}


def _hf(name: str, precision: str) -> tuple[Workload, dict]:
    tokens = {} if name in IMAGE_MODELS else {"seq_len": 32}
    options = {"batch": 2, "small": True, **tokens, "precision": precision, "optimizer": "none"}
    return ul.zoo.get(name, **options), options


def _row(model: str, make) -> dict:
    start = time.perf_counter()
    work, options = make()
    rebuilds = ul.trace(work).rebuilds_views
    with_replay, without = real_step_ops(work, True), real_step_ops(work, False)
    return {"model": model, **options, "rebuilds_views": rebuilds, "same_ops": with_replay == without,
            "ops": len(with_replay), "seconds": time.perf_counter() - start}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "data" / "benchmarks" / "view_writes.json")
    parser.add_argument("--limit", type=int, default=None, help="the first N classifiers only")
    options = parser.parse_args()
    torch.set_num_threads(2)
    makers = {name: partial(_classifier, name) for name in torchvision.models.list_models(module=torchvision.models)}
    makers.update({f"{name} {precision}": partial(_hf, name, precision) for name in ul.zoo.names()
                   if name.startswith("hf:") for precision in ("32-true", "bf16-mixed")})
    names = list(makers)[:options.limit]
    rows = []
    print(f"{'model':34} {'rebuilds views':>15} {'same ops':>9}")
    for name in names:
        try:
            row = _row(name, makers[name])
        except Exception as err:  # a model this sweep cannot build or step is reported, not fatal
            row = {"model": name, "error": f"{type(err).__name__}: {str(err).splitlines()[0][:160]}"}
            print(f"{name:34} {row['error']}")
        else:
            print(f"{name:34} {str(row['rebuilds_views']):>15} {str(row['same_ops']):>9}")
        rows.append(row)
    checked = [r for r in rows if "error" not in r]
    missed = [r["model"] for r in checked if not r["same_ops"] and not r["rebuilds_views"]]
    needless = [r["model"] for r in checked if r["same_ops"] and r["rebuilds_views"]]
    result = {
        "benchmark": "view_writes", "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": {"python": platform.python_version(), "torch": torch.__version__,
                    "torchvision": torchvision.__version__},
        "models": len(names), "checked": len(checked), "rebuilds_views": sum(r["rebuilds_views"] for r in checked),
        "targets": {"no_step_said_to_rebuild_no_view_runs_other_ops": {"met": not missed, "misses": missed},
                    "view_replay_turned_on_needlessly": needless},
        "rows": rows}
    options.out.parent.mkdir(parents=True, exist_ok=True)
    options.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"{len(checked)} of {len(names)} checked; {result['rebuilds_views']} rebuild a view; missed: "
          f"{missed or 'none'}; turned on needlessly: {needless or 'none'}\nwrote {options.out}")


if __name__ == "__main__":
    main()
