"""What a study is asked (StudyConfig) and what it gathers (Record), and the checks every phase shares:
how disturbed a measurement was, and how a failed job is recorded."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from udnn_lab.errors import JobFailed
from udnn_lab.sharing._worker import JobAnalysis

QUESTIONS = ("q1", "q2", "q3", "q4")


@dataclass(frozen=True)
class StudyConfig:
    """How the study runs. Iterations are per measured phase; times are seconds."""

    size: str = "small"
    device: str = "cpu"
    caps: tuple | None = None  # per job; None: uncapped, need, midway, min. Items: None, 'need', 'min',
    #                            a fraction of the need (float), bytes (int) or a size ('12 MiB')
    warmup: int = 5
    iterations: int = 30  # at least this many measured steps per phase ...
    min_phase_s: float = 2.0  # ... spanning at least this long (short steps get more of them)
    profile_repeats: int = 3
    sample_interval_s: float = 0.05
    threads: int = 1  # torch threads per job
    stall_timeout_s: float = 120.0  # a job silent this long is hung
    ready_timeout_s: float = 300.0  # to start, build and analyze every job
    # principle 1: a cap is enough when its median step is within this of uncapped. Not tighter: on a CPU,
    # two runs of the same job and cap (a fresh model each) differ by up to ~10% even on a quiet machine
    tolerance: float = 0.10
    questions: tuple[str, ...] = QUESTIONS
    pairs: tuple[tuple[str, str], ...] | None = None  # None: every pair, in job order
    cores: tuple[int, ...] | None = None  # CPU cores every job is pinned to (None: any core)
    retries: int = 2  # measure a disturbed Q1 run or Q2 pair again, up to this many times
    max_interference: float = 0.05  # CPU: the share of the jobs' cores other programs may take (see interference)

    def to_dict(self) -> dict:
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(self).items()}


@dataclass
class Record:
    """What the study gathered, before it becomes a StudyResult (filled as it goes)."""

    started: float  # time.monotonic() at the start
    analyses: dict[str, JobAnalysis]
    errors: list[dict]
    q1: list[dict]
    q1_runs: list[dict]
    q2: list[dict]
    pairs: list[dict]
    op_mix: list[dict]
    windows: list[dict]
    samples: list[tuple[float, str, str, float]]
    pids: dict[str, int]
    notes: list[str]


# -- interference: other programs on the jobs' cores ---------------------------------------------------
def interference(sampler, jobs: Sequence[str], start: float, end: float, config: StudyConfig) -> float | None:
    """CPU: the share of the cores ``jobs`` could use from ``start`` to ``end`` that they did not get,
    1 - sum(job CPU busy) / min(cores, jobs). Other programs on those cores raise it, and a busy
    machine that takes a share of the core from a job alone but less from two jobs (the scheduler
    shares a core by runnable task) makes r look smaller. None on CUDA, or without samples."""
    if config.device.startswith("cuda"):
        return None
    cores = len(config.cores) if config.cores else (os.cpu_count() or 1)
    busy = 0.0
    for job in jobs:
        share = sampler.mean(job, "cpu_busy_percent", start, end)
        if share is None:
            return None
        busy += share / 100
    return max(0.0, 1.0 - busy / min(cores, len(jobs)))


def disturbed(share: float | None, config: StudyConfig) -> bool:
    return share is not None and share > config.max_interference


def failed_job(record: Record, failed: JobFailed, stage: str) -> None:
    if not any(e["job"] == failed.job for e in record.errors):
        record.errors.append({"job": failed.job, "stage": stage, "error": failed.message})
