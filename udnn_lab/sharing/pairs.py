"""Q2: every pair of jobs trained at once, with alone baselines next to the shared phase.

NOTE [pair protocol]
  1. A starts and warms up (``warmup`` steps), then runs alone for ``iterations`` steps
     and at least ``min_phase_s``: A's baseline, taken right before its partner arrives.
  2. B starts (document 004: B starts after A). Once B has warmed up, both run until each
     has ``iterations`` steps that began after that moment, for at least ``min_phase_s``.
  3. A is stopped; B runs alone as long again after A has ended: B's baseline.
  4. r_AB = A's mean iteration time shared / alone (r_BA likewise), an iteration timed from
     the previous one's end (Iteration.interval_s), so whatever sharing costs counts: the
     step, the batch copy before it, and time spent waiting for the device. The mean, not
     the median: on a time-sliced device a step shorter than the time slice is mostly not
     interrupted at all, and the few that are carry the whole cost. Baselines next to the
     shared phase keep slow drifts of a busy machine out of r.
  5. Each job gets the memory of pair_memory(): its keep-all need (principle 1).
  6. Interference (CPU only, sharing_study.interference): the largest, over the three
     windows, share of the cores the jobs could use that went to other programs; a pair
     above ``max_interference`` is measured again, up to ``retries`` times, and the least
     disturbed attempt is kept.
"""

from __future__ import annotations

import time
from itertools import combinations

import numpy as np

from udnn_lab.errors import JobFailed
from udnn_lab.sharing._procs import Iteration, Workers
from udnn_lab.sharing.records import Record, StudyConfig, disturbed, failed_job, interference


def pair_memory(job: str, record: Record) -> int | None:
    """Each job gets its minimum for full speed: its keep-all need, or the smallest larger Q1 cap that ran."""
    need = record.analyses[job].need_bytes
    ran = [r["cap_bytes"] for r in record.q1_runs if r["job"] == job and not r["oom"] and r["iterations"]]
    if not ran:
        return need
    enough = sorted(c for c in ran if c is not None and c >= need)
    return enough[0] if enough else None


def q2(workers: Workers, config: StudyConfig, record: Record, sampler, log) -> None:
    """Measure every pair (config.pairs, or all in job order); failures are recorded and the study goes on."""
    pairs = config.pairs if config.pairs is not None else list(combinations(list(record.analyses), 2))
    for a, b in pairs:
        if a not in record.analyses or b not in record.analyses:
            raise ValueError(f"pair ({a!r}, {b!r}) names a job that is not in the study: jobs are "
                             f"{', '.join(record.analyses)}")
        row = {"pair": f"{a} + {b}", "job_a": a, "job_b": b, "status": "ok", "error": None}
        if not (workers.alive(a) and workers.alive(b)):
            out = a if not workers.alive(a) else b
            row.update(status="skipped", error=f"{out} is out of the study")
        else:
            try:
                row.update(_best_attempt(workers, a, b, config, record, sampler, log))
                log(f"Q2 {row['pair']}: r_AB {row['r_ab']:.3f}, r_BA {row['r_ba']:.3f}, combined throughput "
                    f"{row['combined_throughput']:.3f}" + _interference_text(row))
            except JobFailed as failed:
                failed_job(record, failed, "q2")
                row.update(status="failed", error=f"{failed.job}: {failed.message.splitlines()[-1]}")
                _settle(workers, [a, b])
        record.pairs.append(row)


def _best_attempt(workers: Workers, a: str, b: str, config: StudyConfig, record: Record, sampler, log) -> dict:
    """Measure the pair; again while other programs disturbed it (NOTE [pair protocol], 6)."""
    attempts = []
    for attempt in range(1 + config.retries):
        steps: list[dict] = []
        windows: list[dict] = []
        row = _pair(workers, a, b, config, record.started, record, steps, windows)
        row["interference"] = _pair_interference(sampler, windows, config)
        row["attempts"] = attempt + 1
        attempts.append((row, steps, windows))
        if not disturbed(row["interference"], config):
            break
        if attempt < config.retries:
            log(f"Q2 {a} + {b}: {row['interference']:.0%} of the cores went to other programs; measuring again")
    row, steps, windows = min(attempts, key=lambda item: item[0]["interference"] or 0.0)
    record.q2.extend(steps)
    record.windows.extend(windows)
    return {**row, "attempts": len(attempts)}


def _pair(workers: Workers, a: str, b: str, config: StudyConfig, started: float, record: Record,
          steps: list, windows: list) -> dict:
    w, n, span = config.warmup, config.iterations, config.min_phase_s
    run_a = workers.run(a, w, None, pair_memory(a, record))
    workers.wait_for(lambda: len(run_a.iterations) >= w + n and _spans(run_a.iterations[w:], span), [a])
    run_b = workers.run(b, w, None, pair_memory(b, record))
    workers.wait_for(lambda: len(run_b.iterations) >= w, [a, b])
    both = run_b.iterations[w - 1].end
    workers.wait_for(lambda: len(run_a.after(both)) >= n and len(run_b.after(both)) >= n
                     and time.monotonic() - both >= span, [a, b])
    workers.stop(run_a)
    workers.wait_for(lambda: run_a.done, [a, b])
    assert run_a.facts is not None  # the run is done: its facts arrived
    a_done = run_a.facts["end"]
    workers.wait_for(lambda: len(run_b.after(a_done)) >= n and time.monotonic() - a_done >= span, [b])
    workers.stop(run_b)
    workers.wait_for(lambda: run_b.done, [b])
    phases = {(a, "alone"): _alone(run_a.iterations[w:], run_b.started), (a, "shared"): run_a.after(both),
              (b, "shared"): [it for it in run_b.after(both) if it.end <= a_done], (b, "alone"): run_b.after(a_done)}
    pair = f"{a} + {b}"
    for (job, phase), its in phases.items():
        steps.extend({"pair": pair, "job": job, "partner": b if job == a else a, "phase": phase, "step": it.step,
                      "start_s": it.start - started, "time_s": it.time_s, "interval_s": it.interval_s}
                     for it in its)
        if its and not (phase == "shared" and job == b):
            windows.append({"pair": pair, "window": phase, "subject": "both" if phase == "shared" else job,
                            "jobs": (a, b) if phase == "shared" else (job,), "start": its[0].start,
                            "end": its[-1].end})
    mean = {key: float(np.mean([it.interval_s for it in its])) for key, its in phases.items()}
    r_ab, r_ba = mean[(a, "shared")] / mean[(a, "alone")], mean[(b, "shared")] / mean[(b, "alone")]
    return {"alone_a_s": mean[(a, "alone")], "shared_a_s": mean[(a, "shared")], "alone_b_s": mean[(b, "alone")],
            "shared_b_s": mean[(b, "shared")], "r_ab": r_ab, "r_ba": r_ba,
            "combined_throughput": 1 / r_ab + 1 / r_ba, "colocate": bool(r_ab * r_ba < r_ab + r_ba),
            "memory_a_bytes": pair_memory(a, record), "memory_b_bytes": pair_memory(b, record)}


def _spans(iterations: list[Iteration], seconds: float) -> bool:
    return bool(iterations) and iterations[-1].end - iterations[0].start >= seconds


def _alone(iterations: list[Iteration], partner_started: float) -> list[Iteration]:
    """A's steps that ended before its partner's process was told to start (B's warm-up disturbs A too)."""
    return [it for it in iterations if it.end <= partner_started] or iterations[:1]


def _pair_interference(sampler, windows: list[dict], config: StudyConfig) -> float | None:
    """The largest share, over the pair's windows, of the cores its jobs could use that went elsewhere."""
    shares = [interference(sampler, w["jobs"], w["start"], w["end"], config) for w in windows]
    return None if not shares or None in shares else max(s for s in shares if s is not None)


def _interference_text(row: dict) -> str:
    share = row.get("interference")
    return "" if share is None else f"; interference {share:.0%} (attempt {row['attempts']})"


def _settle(workers: Workers, jobs: list[str]) -> None:
    """After a pair failed: stop the survivor's run so its worker is free for the next pair."""
    for job in jobs:
        if not workers.alive(job):
            continue
        for state in workers.running(job):
            try:
                workers.stop(state)
                workers.wait_for(lambda: state.done, [job], timeout_s=workers.stall_timeout_s)
            except (JobFailed, TimeoutError) as err:
                workers.fail(job, f"did not stop after its partner failed: {err}")
