"""What a real measurement will cost, said before it starts: time from the step's FLOPs, memory from its peak."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from udnn_lab.graph.step_graph import Graph
from udnn_lab.units import format_bytes

LARGE_SECONDS = 30.0  # a measurement longer than this is announced, with what it will take
LARGE_BYTES = 2 << 30  # so is one that holds more host memory than this
PROGRESS_SECONDS = 3.0  # a measurement longer than this shows a progress bar
RECORDED_STEP_FACTOR = 2.0  # the recorded step counts live storages after every op: about twice a plain step


@dataclass(frozen=True)
class MeasurementEstimate:
    """The expected cost of measuring ``steps`` plain steps and one recorded step of a traced Graph."""

    model_name: str
    device: str
    plain_steps: int  # warm-up and timed steps
    step_flops: int  # FLOPs of one step, by the Graph's op counts
    flops_per_s: float  # what a matmul achieves here now
    peak_bytes: int  # the step's predicted peak of live bytes

    @property
    def seconds(self) -> float:
        return (self.plain_steps + RECORDED_STEP_FACTOR) * self.step_flops / self.flops_per_s

    @property
    def large(self) -> bool:
        return self.seconds > LARGE_SECONDS or (self.device == "cpu" and self.peak_bytes > LARGE_BYTES)

    def message(self) -> str:
        steps = self.plain_steps + 1
        return (f"measuring {self.model_name} runs {steps} real step{'s' * (steps > 1)} of "
                f"{self.step_flops / 1e9:,.0f} GFLOP each on {self.device}: about "
                f"{_duration(self.seconds)} at this machine's {self.flops_per_s / 1e9:.0f} GFLOP/s, holding "
                f"about {format_bytes(self.peak_bytes)} (the predicted peak). The prediction (ul.trace) needs no "
                "real step; to measure quicker, use a smaller batch, or fewer steps (warmup=0, repeats=0)")


def estimate(graph: Graph, plain_steps: int, device: torch.device) -> MeasurementEstimate:
    """The cost of measuring ``graph``'s step on ``device`` (rates from a short matmul timing there)."""
    return MeasurementEstimate(model_name=graph.model_name, device=device.type, plain_steps=plain_steps,
                               step_flops=sum(op.flops for op in graph.ops), flops_per_s=_matmul_flops_per_s(device),
                               peak_bytes=graph.peak_bytes)


def _matmul_flops_per_s(device: torch.device, n: int = 512, repeats: int = 7) -> float:
    """Best achieved FLOP/s of an n x n fp32 matmul (tens of milliseconds; an upper bound for conv and small ops).

    The best, not the median: on a shared machine a few runs are slowed by others' work.
    """
    a, b = torch.randn(n, n, device=device), torch.randn(n, n, device=device)
    times = []
    for _ in range(repeats + 1):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        torch.mm(a, b)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return 2 * n**3 / min(times[1:])


def _duration(seconds: float) -> str:
    if seconds >= 90:
        return f"{seconds / 60:.0f} min"
    return f"{seconds:.0f} s" if seconds >= 1 else "under a second"
