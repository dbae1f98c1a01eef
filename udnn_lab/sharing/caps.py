"""Memory caps of the study: how each is enforced, and resolving what a user asked for into bytes per job."""

from __future__ import annotations

from collections.abc import Sequence

from udnn_lab.errors import CapBelowMinimum
from udnn_lab.sharing._worker import JobAnalysis
from udnn_lab.units import format_bytes, parse_bytes

CPU_CAPS = ("CPU: no per-process memory limit exists; a cap is enforced by training under the planner's plan "
            "for that budget (ul.plan(graph, cap, 'auto') + OffloadRuntime); at or above the job's keep-all "
            "need it runs without a plan")
CUDA_CAPS = ("CUDA: torch.cuda.set_per_process_memory_fraction(cap / device memory) in the job's process; below "
             "the job's keep-all need (predicted peak + caching-allocator overhead) also the planner's plan for "
             "cap - overhead")


def resolve_caps(caps: Sequence | None, analysis: JobAnalysis) -> list[tuple[str, int | None]]:
    """(label, bytes or None for uncapped) per cap, largest first; refuses a cap below the job's minimum."""
    need, least = analysis.need_bytes, analysis.min_cap_bytes
    if caps is None:
        chosen = [("uncapped", None), ("need", need)]
        if least < need:
            chosen += [("midway", (need + least) // 2), ("min", least)]
        return chosen
    resolved = []
    for cap in caps:
        label, value = _one_cap(cap, analysis)
        if value is not None and value < least:
            raise CapBelowMinimum(
                f"memory cap {label} ({format_bytes(value)}) for job {analysis.job!r} is below its minimum "
                f"{format_bytes(least)} ({least} bytes: the planner's smallest budget plus "
                f"{format_bytes(analysis.overhead_bytes)} allocator overhead; its keep-all need is "
                f"{format_bytes(need)}); give caps of at least {format_bytes(least)}, or 'min'",
                analysis.job, value, least)
        resolved.append((label, value))
    return sorted(dict(resolved).items(), key=lambda item: -(item[1] if item[1] is not None else 2**62))


def _one_cap(cap, analysis: JobAnalysis) -> tuple[str, int | None]:
    if cap is None or cap == "uncapped":
        return "uncapped", None
    if cap in ("need", "min"):
        return cap, analysis.need_bytes if cap == "need" else analysis.min_cap_bytes
    if isinstance(cap, float):
        if cap <= 0:
            raise ValueError(f"a cap given as a fraction of the need must be positive, got {cap}")
        return f"{cap:.2f} x need", int(cap * analysis.need_bytes)
    value = parse_bytes(cap)
    return format_bytes(value), value
