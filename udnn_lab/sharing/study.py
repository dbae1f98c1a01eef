"""The co-training study of document 004, run: Q1 (time against memory cap), Q3 (operator mix),
Q2 (every pair at once) with Q4's signals sampled meanwhile.

On a CPU, other programs on the machine may take time on the jobs' cores while a job is
measured; that share is measured from the signals (``interference``), and a Q1 run or a Q2
pair above ``max_interference`` is measured again, up to ``retries`` times, keeping the
least disturbed attempt.

One worker process per job (_procs.py). A job that fails at any point is
recorded with its error and left out of what follows; the others go on. A cap below a
job's minimum is refused before any job runs.

How a cap is enforced: on CUDA, torch.cuda.set_per_process_memory_fraction(cap / device
memory) in the job's process, and below the job's keep-all need the planner's plan for
cap - allocator overhead. On a CPU there is no per-process memory limit: the cap is
enforced by training under the planner's plan for that budget (OffloadRuntime), so
the cap is as good as the plan.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence

from udnn_lab.sharing._procs import Workers
from udnn_lab.sharing.caps import resolve_caps
from udnn_lab.sharing.jobs import JobSpec
from udnn_lab.sharing.pairs import q2
from udnn_lab.sharing.records import Record, StudyConfig
from udnn_lab.sharing.signals import Sampler
from udnn_lab.sharing.solo import q1, q3
from udnn_lab.units import format_bytes


def run_jobs(specs: Sequence[JobSpec], config: StudyConfig, log: Callable[[str], None]) -> Record:
    """Start the workers, run the study's phases, and always end every worker."""
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
                    q1(workers, caps, config, record, sampler, log)
                if "q3" in config.questions:
                    q3(workers, config, record, log)
                if "q2" in config.questions:
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


def stderr_log(started: float) -> Callable[[str], None]:
    def log(message: str) -> None:
        print(f"[sharing {time.monotonic() - started:6.1f} s] {message}", file=sys.stderr, flush=True)
    return log


def quiet(message: str) -> None:
    pass
