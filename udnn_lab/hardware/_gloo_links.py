"""The collectives' link of a CPU machine: all-reduces between two gloo ranks on it, timed.

Ranks on one machine run gloo over its loopback and memory; the simulator's ring model (NOTE [collectives]) needs
that link's bandwidth and its latency per ring step. Two processes all-reduce buffers of each size; with p = 2 an
all-reduce of N bytes sends N bytes over each rank's link in 2 ring steps, so a size's time is N / bandwidth +
2 x latency: the largest buffer gives the bandwidth, the smallest what is left as latency.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

GLOO_SIZES = tuple(4096 << (2 * i) for i in range(8))  # 4 KiB .. 64 MiB
RANKS = 2
TIMEOUT_S = 180


def measure_gloo(sizes: tuple[int, ...] = GLOO_SIZES, repeats: int = 5) -> list[tuple[int, float]]:
    """(bytes, median seconds of one all-reduce) per size, from two gloo ranks on this machine."""
    with tempfile.TemporaryDirectory() as folder:
        context = mp.start_processes(_rank, args=(folder, sizes, repeats), nprocs=RANKS, join=False,
                                     start_method="spawn")
        deadline = time.monotonic() + TIMEOUT_S
        try:
            while not context.join(timeout=max(1.0, deadline - time.monotonic())):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the gloo ranks did not finish their all-reduces in {TIMEOUT_S} s")
        finally:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
                process.join(10)
        lines = Path(folder, "times").read_text().split()
    return [(int(nbytes), float(seconds)) for nbytes, seconds in zip(lines[::2], lines[1::2], strict=True)]


def link_figures(times: list[tuple[int, float]]) -> tuple[float, float]:
    """(bytes_per_s, latency_s per ring step) of the module's model, from ``measure_gloo``'s times."""
    largest, slowest = max(times)
    bandwidth = largest / slowest  # p = 2: N bytes over the link
    smallest, quickest = min(times)
    return bandwidth, max(0.0, (quickest - smallest / bandwidth) / 2)


def _rank(rank: int, folder: str, sizes: tuple[int, ...], repeats: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{os.path.join(folder, 'store')}", rank=rank,
                            world_size=RANKS)
    try:
        found = []
        for nbytes in sizes:
            buffer = torch.ones(nbytes // 4, dtype=torch.float32)
            dist.all_reduce(buffer)  # warm-up: gloo sets up its pairs on the first use
            times = []
            for _ in range(repeats):
                dist.barrier()
                start = time.perf_counter()
                dist.all_reduce(buffer)
                times.append(time.perf_counter() - start)
            found.append(f"{nbytes} {statistics.median(times)!r}")
        if rank == 0:
            Path(folder, "times").write_text("\n".join(found))
    finally:
        dist.destroy_process_group()
