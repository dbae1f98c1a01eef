"""Per-rank peak of Llama-3-8B under FSDP2 over 8, 64 and 1024 ranks (and DDP over 8, and one GPU), and what it costs
to find out.

The model is built on the meta device (no weights in memory) and each setup's step is traced as one rank of
a fake process group, for CUDA (CPU kernels stand in while tracing; no GPU needed): the peaks are
predictions, not measurements. Batch 1 per rank, 4096 tokens, float32 weights, AdamW, sdpa attention, as
``ul.zoo.get("hf:llama-3-8b", batch=1, seq_len=4096, device="meta")`` builds it. For each setup: the
per-rank peak as CUDA's caching allocator would count it, what the peak is made of, and the seconds the
trace took on this machine (a warm-up step and the recorded step). FSDP2 wraps as udnn_lab does by default
(each decoder layer, then the root with the embedding, the final norm and the head), and as torchtitan does
(the embedding, each layer, the norm and head together). Prints the table and writes JSON.

    python benchmarks/parallel_ranks.py [--worlds 8 64 1024] [--out data/benchmarks/parallel_ranks.json]
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
from udnn_lab.units import format_bytes

MODEL, BATCH, SEQ_LEN = "hf:llama-3-8b", 1, 4096
SHOWN = ("parameter", "parameter_gradient", "optimizer_state", "feature_map", "communication")


def torchtitan_units(model: torch.nn.Module, shard) -> None:
    """torchtitan's wrapping of Llama: the embedding, each layer, then the final norm and the head together and
    kept from forward to backward (backward needs them first); the root is left with nothing of its own."""
    inner = model.model
    shard(inner.embed_tokens)
    for layer in inner.layers:
        shard(layer)
    shard([inner.norm, model.lm_head], reshard_after_forward=False)


def setups(worlds: list[int]) -> list[tuple[str, ul.DDP | ul.FSDP | None]]:
    found: list[tuple[str, ul.DDP | ul.FSDP | None]] = [("one GPU", None), ("DDP x 8", ul.DDP(8))]
    for world in worlds:
        found.append((f"FSDP2 x {world}", ul.FSDP(world)))
        found.append(("  torchtitan's", ul.FSDP(world, wrap=torchtitan_units)))
    return found


def table(worlds: list[int]) -> tuple[list[dict], float]:
    start = time.perf_counter()
    work = ul.zoo.get(MODEL, batch=BATCH, seq_len=SEQ_LEN, device="meta")
    build_s = time.perf_counter() - start
    rows = []
    for name, spec in setups(worlds):
        start = time.perf_counter()
        graph = ul.trace(work, device="cuda", parallel=spec)
        seconds = time.perf_counter() - start
        at_peak = graph.breakdown()["bytes_at_peak"]
        rows.append({"setup": name, "world_size": spec.world_size if spec else 1,
                     "peak_bytes": int(graph.cuda_peak_bytes), "trace_s": seconds, "ops": len(graph.ops),
                     "at_peak_bytes": {c: int(at_peak[c]) for c in SHOWN}, "notes": list(graph.notes)})
    return rows, build_s


def _print(rows: list[dict], build_s: float) -> None:
    print(f"{MODEL} batch {BATCH} x {SEQ_LEN} tokens per rank, float32, AdamW; CUDA step, predicted "
          f"(model built on meta in {build_s:.1f} s)")
    print(f"{'setup':<14} {'peak/rank':>11} " + " ".join(f"{c[:14]:>14}" for c in SHOWN) + f" {'ops':>6} {'trace':>7}")
    for r in rows:
        parts = " ".join(f"{format_bytes(r['at_peak_bytes'][c]):>14}" for c in SHOWN)
        print(f"{r['setup']:<14} {format_bytes(r['peak_bytes']):>11} {parts} {r['ops']:6d} {r['trace_s']:6.1f}s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worlds", type=int, nargs="+", default=[8, 64, 1024], help="FSDP2 world sizes")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent.parent / "data" / "benchmarks"
                        / "parallel_ranks.json")
    args = parser.parse_args()
    torch.set_num_threads(2)
    rows, build_s = table(args.worlds)
    _print(rows, build_s)
    document = {"benchmark": "parallel_ranks", "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                "machine": {"python": platform.python_version(), "torch": torch.__version__,
                            "cpu": device_name("cpu")},
                "model": MODEL, "batch": BATCH, "seq_len": SEQ_LEN, "predicted": True, "build_s": build_s,
                "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(document, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
