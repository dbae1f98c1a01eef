"""The co-training study of document 004, run: Q1 (time against memory cap), Q3 (operator mix),
Q2 (every pair at once) with Q4's signals sampled meanwhile.

On a CPU, other programs on the machine may take time on the jobs' cores while a job is
measured; that share is measured from the signals (``interference``), and a Q1 run or a Q2
pair above ``max_interference`` is measured again, up to ``retries`` times, keeping the
least disturbed attempt.

One worker process per job (sharing_procs.py). A job that fails at any point is
recorded with its error and left out of what follows; the others go on. A cap below a
job's minimum is refused before any job runs.

How a cap is enforced: on CUDA, torch.cuda.set_per_process_memory_fraction(cap / device
memory) in the job's process, and below the job's keep-all need the planner's plan for
cap - allocator overhead. On a CPU there is no per-process memory limit: the cap is
enforced by training under the planner's plan for that budget (OffloadRuntime), so
the cap is as good as the plan.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import asdict, dataclass
from statistics import median
from typing import Callable, Sequence

from udnn_lab.errors import UdnnLabError
from udnn_lab.sharing_jobs import JobSpec
from udnn_lab.sharing_procs import JobFailed, RunState, Workers
from udnn_lab.sharing_worker import JobAnalysis
from udnn_lab.units import format_bytes, parse_bytes

QUESTIONS = ("q1", "q2", "q3", "q4")
CPU_CAPS = ("CPU: no per-process memory limit exists; a cap is enforced by training under the planner's plan "
            "for that budget (ul.plan(graph, cap, 'auto') + OffloadRuntime); at or above the job's keep-all "
            "need it runs without a plan")
CUDA_CAPS = ("CUDA: torch.cuda.set_per_process_memory_fraction(cap / device memory) in the job's process; below "
             "the job's keep-all need (predicted peak + caching-allocator overhead) also the planner's plan for "
             "cap - overhead")


class CapBelowMinimum(UdnnLabError, ValueError):
    """A memory cap under the least a job can run with."""

    def __init__(self, message: str, job: str, cap_bytes: int, minimum_bytes: int) -> None:
        super().__init__(message)
        self.job, self.cap_bytes, self.minimum_bytes = job, cap_bytes, minimum_bytes


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


def run_jobs(specs: Sequence[JobSpec], config: StudyConfig, log: Callable[[str], None]) -> Record:
    """Start the workers, run the study's phases, and always end every worker."""
    from udnn_lab.sharing_signals import Sampler

    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise ValueError(f"job names must be unique, got {names}: give JobSpec(name=...) to tell them apart")
    record = Record(time.monotonic(), {}, [], [], [], [], [], [], [], [], {}, [])
    with Workers(list(specs), config.device, config.threads, config.stall_timeout_s, log, config.cores) as workers:
        log(f"starting {len(specs)} job processes on {config.device}")
        for job, error in workers.wait_ready(config.ready_timeout_s).items():
            record.errors.append({"job": job, "stage": "start", "error": error})
        record.analyses = workers.analyses()
        for analysis in record.analyses.values():
            log(f"{analysis.job}: need {format_bytes(analysis.need_bytes)}, minimum "
                f"{format_bytes(analysis.min_cap_bytes)} (analyzed in {analysis.analysis_s:.1f} s)")
        caps = {job: resolve_caps(config.caps, analysis) for job, analysis in record.analyses.items()}
        gpu = config.device.startswith("cuda")
        sampler = Sampler(workers.live_pids, config.sample_interval_s, _gpu_index(config.device) if gpu else None,
                          config.cores)
        try:
            with sampler:  # Q4's signals, and on a CPU the interference of other programs
                if "q1" in config.questions:
                    _q1(workers, caps, config, record, sampler, log)
                if "q3" in config.questions:
                    _q3(workers, config, record, log)
                if "q2" in config.questions:
                    from udnn_lab.sharing_pairs import q2

                    q2(workers, config, record, sampler, log)
        finally:
            record.samples, record.pids = list(sampler.samples), dict(workers.pids)
            record.notes.extend(sampler.notes)
            record.errors.extend({"job": job, "stage": "study", "error": error}
                                 for job, error in workers.errors().items()
                                 if not any(e["job"] == job for e in record.errors))
    return record


def _gpu_index(device: str) -> int:
    return int(device.split(":", 1)[1]) if ":" in device else 0


# -- caps ---------------------------------------------------------------------------------------
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


# -- Q1: each job alone under each cap ----------------------------------------------------------------
def _q1(workers: Workers, caps: dict, config: StudyConfig, record: Record, sampler, log) -> None:
    for job, job_caps in caps.items():
        for label, cap in job_caps:
            if not workers.alive(job):
                break
            try:
                state, share, attempts = _q1_run(workers, job, label, cap, config, sampler, log)
            except JobFailed as failed:
                failed_job(record, failed, "q1")
                break
            _q1_rows(record, job, label, cap, state, config, share, attempts)
            last = record.q1_runs[-1]
            text = "out of memory" if last["oom"] else f"median step {last['median_time_s'] * 1e3:.1f} ms"
            extra = f", interference {share:.0%}" if share is not None else ""
            log(f"Q1 {job} cap {label}: {text} ({last['policy']}, {last['iterations']} steps{extra})")


def _q1_run(workers: Workers, job: str, label: str, cap: int | None, config: StudyConfig, sampler, log):
    """(RunState, interference, attempts) of the least disturbed of up to 1 + retries runs."""
    attempts = []
    for attempt in range(1 + config.retries):
        state = workers.run(job, config.warmup, config.iterations, cap, measure_peak=True,
                            min_seconds=config.min_phase_s)
        workers.wait_for(lambda: state.done, [job])
        measured = state.iterations[config.warmup:]
        share = interference(sampler, [job], measured[0].start, measured[-1].end, config) if measured else None
        attempts.append((state, share))
        if not disturbed(share, config):
            break
        if attempt < config.retries:
            log(f"Q1 {job} cap {label}: {share:.0%} of its core went to other programs; measuring again")
    state, share = min(attempts, key=lambda item: item[1] or 0.0)
    return state, share, len(attempts)


def _q1_rows(record: Record, job: str, label: str, cap: int | None, state: RunState, config: StudyConfig,
             share: float | None, attempts: int) -> None:
    facts = state.facts
    measured = state.iterations[config.warmup:]
    times = [it.time_s for it in measured]
    record.q1_runs.append({
        "job": job, "cap": label, "cap_bytes": cap, "policy": facts["policy"],
        "plan_budget_bytes": facts["plan_budget_bytes"], "offloads": facts["offloads"],
        "recomputes": facts["recomputes"], "iterations": len(times),
        "median_time_s": median(times) if times else float("nan"), "peak_bytes": facts.get("peak_bytes"),
        "reserved_peak_bytes": facts.get("reserved_peak_bytes"), "oom": facts["oom"], "interference": share,
        "attempts": attempts})
    record.q1.extend({"job": job, "cap": label, "cap_bytes": cap, "step": it.step, "time_s": it.time_s,
                      "interval_s": it.interval_s} for it in measured)


# -- Q3: each job's operator mix --------------------------------------------------------------------
def _q3(workers: Workers, config: StudyConfig, record: Record, log) -> None:
    for job in list(record.analyses):
        if not workers.alive(job):
            continue
        try:
            state = workers.profile(job, config.profile_repeats)
            workers.wait_for(lambda: state.done, [job])
        except JobFailed as failed:
            failed_job(record, failed, "q3")
            continue
        total = sum(state.profile.values()) or 1.0
        record.op_mix.extend({"job": job, "op": op, "time_s": seconds, "share": seconds / total}
                             for op, seconds in state.profile.items())
        top = max(state.profile, key=state.profile.get) if state.profile else "-"
        log(f"Q3 {job}: {len(state.profile)} op types, most time in {top}")


def failed_job(record: Record, failed: JobFailed, stage: str) -> None:
    if not any(e["job"] == failed.job for e in record.errors):
        record.errors.append({"job": failed.job, "stage": stage, "error": failed.message})


def stderr_log(started: float) -> Callable[[str], None]:
    def log(message: str) -> None:
        print(f"[sharing {time.monotonic() - started:6.1f} s] {message}", file=sys.stderr, flush=True)
    return log


def quiet(message: str) -> None:
    pass
