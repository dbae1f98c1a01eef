"""Co-training study: several training jobs on one device (document 004).

    from udnn_lab import sharing
    result = sharing.run_study(size="small")        # FCN, VGG-19, ResNet-50, LSTM; each its own process
    result.q1_summary()                             # Q1: step time against the memory cap
    result.degradation_matrix()                     # Q2: r_AB = A's step shared with B / alone
    result.pairs[["pair", "combined_throughput", "colocate"]]   # 1/r_AB + 1/r_BA; r_AB*r_BA < r_AB+r_BA
    result.jaccard()                                # Q3: operator-mix similarity
    result.ks()                                     # Q4: signals alone vs shared, two-sample KS
    result.recommendation()                         # principles 1-3: which pairs, how much memory each
    result.principles()                             # document 004's conclusions, checked here
    sharing.degradation_heatmap(result); result.save("data/sharing/x.json"); sharing.load(...)
    sharing.repeat_chart(sharing.compare_runs([first, second]))   # is r repeatable?

Jobs are JobSpecs (picklable: a zoo name or "package.module:factory", a batch, options);
``document_004_jobs(size)`` gives the document's four at 'tiny', 'small' or 'full' size.
Each job runs in its own 'spawn' process with ``threads`` torch threads; every process
is ended when the study ends, by error or interrupt too. Memory caps: see sharing_study.
"""

from __future__ import annotations

import os
import platform
import sys
import time
from collections.abc import Sequence
from datetime import datetime, timezone
from typing import cast

import altair
import numpy
import pandas as pd
import torch

import udnn_lab
from udnn_lab.errors import CapBelowMinimum
from udnn_lab.measurement import nvml
from udnn_lab.sharing._worker import JobAnalysis, analyze_job
from udnn_lab.sharing.caps import CPU_CAPS, CUDA_CAPS, resolve_caps
from udnn_lab.sharing.charts import (
    degradation_heatmap,
    jaccard_heatmap,
    op_mix_chart,
    q1_chart,
    repeat_chart,
    signals_chart,
)
from udnn_lab.sharing.jobs import (
    DOCUMENT_004_MODELS,
    SIZES,
    JobSpec,
    document_004_job,
    document_004_jobs,
    resolve_factory,
)
from udnn_lab.sharing.records import QUESTIONS, Record, StudyConfig
from udnn_lab.sharing.results import StudyResult, compare_runs, cut_samples, load, signal_descriptions, weighted_jaccard
from udnn_lab.sharing.signals import ks_2samp
from udnn_lab.sharing.study import quiet, run_jobs, stderr_log

__all__ = [
    "DOCUMENT_004_MODELS", "QUESTIONS", "SIZES", "CapBelowMinimum", "JobAnalysis", "JobSpec", "StudyConfig",
    "StudyResult", "analyze_job", "compare_runs", "degradation_heatmap", "document_004_job", "document_004_jobs",
    "jaccard_heatmap", "ks_2samp", "load", "op_mix_chart", "q1_chart", "repeat_chart", "resolve_caps",
    "resolve_factory", "run_study", "signals_chart", "weighted_jaccard",
]


def run_study(jobs: Sequence[JobSpec | str] | None = None, *, size: str = "small", device: str | None = None,
              caps: Sequence | None = None, warmup: int = 5, iterations: int = 30,
              pairs: Sequence[tuple[str, str]] | None = None, profile_repeats: int = 3,
              min_phase_s: float = 2.0, sample_interval_s: float = 0.05, threads: int = 1,
              cores: Sequence[int] | str | None = "auto", retries: int = 2, max_interference: float = 0.05,
              stall_timeout_s: float = 120.0, ready_timeout_s: float = 300.0, tolerance: float = 0.10,
              questions: Sequence[str] = QUESTIONS, progress: bool = True) -> StudyResult:
    """Run document 004's study over ``jobs`` (default: its four models at ``size``) on ``device``.

    ``jobs``: JobSpecs, or names (document 004's models at ``size``, else zoo names).
    ``caps`` for Q1, the same for every job: None, 'need', 'min', a fraction of the need,
    bytes or '12 MiB'; default: uncapped, need, midway and min. A cap below a job's
    minimum raises CapBelowMinimum. A job that fails is reported in ``result.errors``
    and the study goes on without it.

    Each measured phase has at least ``iterations`` steps and lasts ``min_phase_s``. On a
    CPU, a Q1 run or Q2 pair during which other programs took more than ``max_interference``
    of the jobs' cores is measured again, up to ``retries`` times (sharing_study.interference).

    ``cores``: CPU cores every job is pinned to once it is analyzed. 'auto': on a CPU, one
    core (the last), the CPU's "device": the jobs take turns on it the way jobs on a GPU
    take turns on its time (document 004: one context runs at a time), and r measures
    that sharing, not how many idle cores the machine happens to have. Pinning keeps the
    jobs on that core, not other programs off it: the load balancer tends to move them to
    the other cores, and what they still take is measured (``result.background()``) and
    a disturbed pair measured again (NOTE [pair protocol], 6). On CUDA 'auto' pins
    nothing. None: the OS places the jobs on any core.
    """
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    specs = [_spec(job, size) for job in (jobs if jobs is not None else DOCUMENT_004_MODELS)]
    unknown = set(questions) - set(QUESTIONS)
    if unknown or warmup < 1 or iterations < 3:
        raise ValueError(f"questions are a subset of {QUESTIONS} (got {sorted(unknown)}); warmup >= 1 and "
                         f"iterations >= 3 (got {warmup}, {iterations})")
    config = StudyConfig(
        size=size, device=device, caps=tuple(caps) if caps is not None else None, warmup=warmup,
        iterations=iterations, profile_repeats=profile_repeats, sample_interval_s=sample_interval_s,
        threads=threads, stall_timeout_s=stall_timeout_s, ready_timeout_s=ready_timeout_s, tolerance=tolerance,
        questions=tuple(questions),
        pairs=tuple(cast("tuple[str, str]", tuple(p)) for p in pairs) if pairs is not None else None,
        cores=_cores(cores, device), min_phase_s=min_phase_s, retries=retries, max_interference=max_interference)
    started_at = datetime.now(timezone.utc).isoformat(timespec="seconds")
    load_before = os.getloadavg()
    begin = time.monotonic()
    log = stderr_log(begin) if progress else quiet
    record = run_jobs(specs, config, log)
    load = {"before": list(load_before), "after": list(os.getloadavg())}
    result = build_result(record, specs, config, started_at, time.monotonic() - begin, load)
    log(f"done in {result.meta['wall_s']:.0f} s: {result!r}")
    return result


def _cores(cores: Sequence[int] | str | None, device: str) -> tuple[int, ...] | None:
    if cores == "auto":
        available = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
        return (available[-1],) if available and not device.startswith("cuda") else None
    if isinstance(cores, str):
        raise ValueError(f"cores is 'auto', None or a list of core numbers, got {cores!r}")
    return tuple(int(c) for c in cores) if cores is not None else None


def _spec(job: JobSpec | str, size: str) -> JobSpec:
    if isinstance(job, JobSpec):
        return job
    if isinstance(job, str):
        return document_004_job(job, size) if job in DOCUMENT_004_MODELS else JobSpec(job, job)
    raise TypeError(f"a job is a JobSpec or a model name, got {type(job).__name__}")


def build_result(record: Record, specs: list[JobSpec], config: StudyConfig, started_at: str,
                 wall_s: float, load_average: dict | None = None) -> StudyResult:
    """Turn what the study gathered into a StudyResult with its metadata; ``load_average``: the machine's
    1, 5 and 15 minute load averages before and after the study (other programs add noise)."""
    errors = pd.DataFrame(record.errors, columns=["job", "stage", "error"])
    failed = dict(zip(errors["job"], errors["stage"]))
    rows = []
    for spec in specs:
        analysis = record.analyses.get(spec.name)
        row = analysis.to_dict() if analysis is not None else {"job": spec.name, "model": spec.model,
                                                                 "batch": spec.batch}
        row.update(options=repr(dict(spec.options)), pid=record.pids.get(spec.name),
                   status="ok" if spec.name not in failed else f"failed in {failed[spec.name]}")
        rows.append(row)
    columns = ["job", "model", "batch", "options", "status", "pid", *[f for f in JobAnalysis.__dataclass_fields__
                                                                      if f not in ("job", "model", "batch")]]
    jobs = pd.DataFrame(rows).reindex(columns=columns)
    analyses = list(record.analyses.values())
    meta = {"device": config.device, "device_name": analyses[0].device_name if analyses else "",
            "device_bytes": analyses[0].device_bytes if analyses else None, "size": config.size,
            "cpu_count": os.cpu_count(), "cuda_available": torch.cuda.is_available(),
            "gpu_results": _gpu_results(config.device),
            "started_at": started_at, "wall_s": wall_s, "load_average": load_average,
            "versions": versions(config.device),
            "cap_enforcement": CUDA_CAPS if config.device.startswith("cuda") else CPU_CAPS,
            "signals": signal_descriptions(config.device), "config": config.to_dict(), "notes": record.notes}
    return StudyResult(
        meta=meta, jobs=jobs,
        q1_runs=pd.DataFrame(record.q1_runs, columns=_Q1_RUNS), q1=pd.DataFrame(record.q1, columns=_Q1),
        q2=pd.DataFrame(record.q2, columns=_Q2), pairs=pd.DataFrame(record.pairs, columns=_PAIRS),
        op_mix=pd.DataFrame(record.op_mix, columns=["job", "op", "time_s", "share"]),
        samples=cut_samples(record.samples, record.windows, record.started), errors=errors)


_Q1_RUNS = ["job", "cap", "cap_bytes", "policy", "plan_budget_bytes", "offloads", "recomputes", "iterations",
            "median_time_s", "peak_bytes", "reserved_peak_bytes", "oom", "interference", "attempts"]
_Q1 = ["job", "cap", "cap_bytes", "step", "time_s", "interval_s"]
_Q2 = ["pair", "job", "partner", "phase", "step", "start_s", "time_s", "interval_s"]
_PAIRS = ["pair", "job_a", "job_b", "status", "error", "alone_a_s", "shared_a_s", "alone_b_s", "shared_b_s", "r_ab",
          "r_ba", "combined_throughput", "colocate", "memory_a_bytes", "memory_b_bytes", "interference", "attempts"]


def _gpu_results(device: str) -> str:
    if device.startswith("cuda"):
        return "measured: this study ran on the GPU"
    if torch.cuda.is_available():
        return "unmeasured here: a GPU was available, but this study ran on the CPU"
    return "unmeasured: no CUDA device on this machine; every number here is from the CPU"


def versions(device: str) -> dict:
    """Python, torch, udnn_lab and friends, the OS, and the NVIDIA driver when there is one."""
    found = {"python": sys.version.split()[0], "torch": torch.__version__, "udnn_lab": udnn_lab.__version__,
             "numpy": numpy.__version__, "pandas": pd.__version__, "altair": altair.__version__,
             "platform": platform.platform(), "cuda": torch.version.cuda}
    if device.startswith("cuda"):
        reading = nvml.read(int(device.split(":", 1)[1]) if ":" in device else 0)
        found["nvidia_driver"] = reading.driver_version if reading.available else reading.reason
    return found
