"""Q1 and Q3 of the study: each job alone, under each of its memory caps and profiled by operator."""

from __future__ import annotations

from statistics import median

from udnn_lab.errors import JobFailed
from udnn_lab.sharing._procs import RunState, Workers
from udnn_lab.sharing.records import Record, StudyConfig, disturbed, failed_job, interference


# -- Q1: each job alone under each cap ----------------------------------------------------------------
def q1(workers: Workers, caps: dict, config: StudyConfig, record: Record, sampler, log) -> None:
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
    assert facts is not None  # the run is done: its facts arrived
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
def q3(workers: Workers, config: StudyConfig, record: Record, log) -> None:
    for job in list(record.analyses):
        if not workers.alive(job):
            continue
        try:
            state = workers.profile(job, config.profile_repeats)
            workers.wait_for(lambda: state.done, [job])
        except JobFailed as failed:
            failed_job(record, failed, "q3")
            continue
        profile = state.profile
        assert profile is not None  # the profile order is done: its profile arrived
        total = sum(profile.values()) or 1.0
        record.op_mix.extend({"job": job, "op": op, "time_s": seconds, "share": seconds / total}
                             for op, seconds in profile.items())
        top = max(profile, key=profile.__getitem__) if profile else "-"
        log(f"Q3 {job}: {len(profile)} op types, most time in {top}")
