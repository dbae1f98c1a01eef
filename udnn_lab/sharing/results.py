"""The study's result: raw tables as gathered, the derived tables document 004 reports, and JSON.

Derived tables are computed from the raw ones on demand, so a result loaded from JSON
answers the same questions as the one just run. Sizes are bytes, times seconds.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from udnn_lab.sharing.principles import check_principles
from udnn_lab.sharing.signals import CPU_SIGNALS, GPU_SIGNALS, ks_2samp
from udnn_lab.units import format_bytes

TABLES = ("jobs", "q1_runs", "q1", "q2", "pairs", "op_mix", "samples", "errors")
_JOB_SIGNALS = ("cpu_busy_percent", "runqueue_wait_percent")  # per process; the others are the device's


@dataclass(frozen=True, repr=False)
class StudyResult:
    """Document 004's study on one device: Q1-Q4, and the recommendation its principles give."""

    meta: dict  # device, device_name, size, versions, started_at, wall_s, cap_enforcement, config, notes
    jobs: pd.DataFrame  # one row per job: the analyzer's need and minimum, status, error, pid
    q1_runs: pd.DataFrame  # one row per (job, cap): plan, median step, measured peak, out of memory
    q1: pd.DataFrame  # one row per measured step of Q1
    q2: pd.DataFrame  # one row per measured step of Q2: pair, job, partner, phase (alone/shared)
    pairs: pd.DataFrame  # one row per pair: mean iteration times, r_ab, r_ba, combined throughput, the rule
    op_mix: pd.DataFrame  # job, op type, seconds, share of the step
    samples: pd.DataFrame  # Q4: pair, window, subject, source, signal, t_s, value
    errors: pd.DataFrame = field(default_factory=lambda: pd.DataFrame(columns=["job", "stage", "error"]))

    def __repr__(self) -> str:
        ok = self.pairs[self.pairs["status"] == "ok"] if len(self.pairs) else self.pairs
        return (f"StudyResult({self.meta.get('device_name')} [{self.meta.get('device')}], size "
                f"{self.meta.get('size')}, {len(self.jobs)} jobs, {len(ok)} pairs measured, "
                f"{len(self.errors)} errors, {self.meta.get('wall_s', 0):.0f} s)")

    # -- Q1 -----------------------------------------------------------------------------------
    def q1_summary(self) -> pd.DataFrame:
        """Per job and cap: median step and slowdown against the job's uncapped run; 'enough' within tolerance."""
        frame = self.q1_runs.copy()
        if frame.empty:
            return frame.assign(slowdown=pd.Series(dtype=float), enough=pd.Series(dtype=bool))
        base = frame[frame["cap"] == "uncapped"].set_index("job")["median_time_s"]
        frame["slowdown"] = frame["median_time_s"] / frame["job"].map(base)
        tolerance = self.meta.get("config", {}).get("tolerance", 0.10)
        frame["enough"] = frame["oom"].isna() & (frame["slowdown"] <= 1 + tolerance)
        return frame

    # -- Q2 -----------------------------------------------------------------------------------
    def degradation(self) -> pd.DataFrame:
        """Tidy r: one row per (job, partner), r = the job's mean iteration time shared / alone."""
        ok = self._ok_pairs()
        rows = [{"job": p.job_a, "partner": p.job_b, "r": p.r_ab, "alone_s": p.alone_a_s, "shared_s": p.shared_a_s}
                for p in ok.itertuples()]
        rows += [{"job": p.job_b, "partner": p.job_a, "r": p.r_ba, "alone_s": p.alone_b_s, "shared_s": p.shared_b_s}
                 for p in ok.itertuples()]
        return pd.DataFrame(rows, columns=["job", "partner", "r", "alone_s", "shared_s"])

    def degradation_matrix(self) -> pd.DataFrame:
        """r_AB with A in rows and B in columns (NaN where not measured)."""
        names = list(self.jobs["job"]) if len(self.jobs) else []
        tidy = self.degradation()
        matrix = pd.DataFrame(np.nan, index=pd.Index(names, name="job"), columns=pd.Index(names, name="partner"))
        for row in tidy.itertuples():
            matrix.loc[row.job, row.partner] = row.r
        return matrix

    def _ok_pairs(self) -> pd.DataFrame:
        return self.pairs[self.pairs["status"] == "ok"] if len(self.pairs) else self.pairs

    # -- Q3 -----------------------------------------------------------------------------------
    def jaccard(self) -> pd.DataFrame:
        """Normalized (weighted) Jaccard similarity of the jobs' operator mixes: sum min(share) / sum max(share)."""
        shares = self.op_mix.pivot_table(index="op", columns="job", values="share", aggfunc="sum", fill_value=0.0) \
            if len(self.op_mix) else pd.DataFrame()
        names = list(shares.columns)
        matrix = pd.DataFrame(np.nan, index=pd.Index(names, name="job"), columns=pd.Index(names, name="partner"))
        for a in names:
            for b in names:
                matrix.loc[a, b] = weighted_jaccard(shares[a].to_numpy(), shares[b].to_numpy())
        return matrix

    # -- Q4 -----------------------------------------------------------------------------------
    def ks(self, alpha: float = 0.05) -> pd.DataFrame:
        """Per pair, job and signal: the job's alone samples against the shared ones, two-sample KS."""
        rows, samples = [], self.samples
        for pair in (samples["pair"].unique() if len(samples) else []):
            in_pair = samples[samples["pair"] == pair]
            for job in [j for j in in_pair["subject"].unique() if j != "both"]:
                for signal in in_pair["signal"].unique():
                    source = job if signal in _JOB_SIGNALS else "device"
                    pick = in_pair[(in_pair["signal"] == signal) & (in_pair["source"] == source)]
                    alone = pick[(pick["window"] == "alone") & (pick["subject"] == job)]["value"]
                    shared = pick[pick["window"] == "shared"]["value"]
                    rows.append(_ks_row(pair, job, signal, source, alone, shared, alpha))
        return pd.DataFrame(rows, columns=["pair", "job", "signal", "source", "n_alone", "n_shared", "mean_alone",
                                           "mean_shared", "statistic", "p_value", "same_distribution"])

    def background(self) -> pd.DataFrame:
        """CPU: per Q2 window, the study's cores busy in all (device), in its jobs, and in anything else: the
        load other programs put on those cores meanwhile, which a busy machine adds to r."""
        columns = ["pair", "window", "subject", "device_busy_cores", "jobs_busy_cores", "other_busy_cores"]
        samples = self.samples
        if not len(samples) or str(self.meta.get("device", "")).startswith("cuda"):
            return pd.DataFrame(columns=columns)
        cores = len(self.meta.get("config", {}).get("cores") or []) or self.meta.get("cpu_count") or 1
        rows = []
        for (pair, window, subject), group in samples.groupby(["pair", "window", "subject"], sort=False):
            device = group[group["signal"] == "device_busy_percent"]["value"].mean() * cores / 100
            jobs = group[group["signal"] == "cpu_busy_percent"].groupby("source")["value"].mean().sum() / 100
            rows.append({"pair": pair, "window": window, "subject": subject, "device_busy_cores": device,
                         "jobs_busy_cores": jobs, "other_busy_cores": device - jobs})
        return pd.DataFrame(rows, columns=columns)

    # -- principles -> recommendation ----------------------------------------------------------
    def memory_recommendation(self) -> pd.DataFrame:
        """Principle 1: each job's memory. The smallest Q1 cap within tolerance of uncapped, else its need."""
        summary, rows = self.q1_summary(), []
        for job in self.jobs[self.jobs["status"] == "ok"].itertuples():
            enough = summary[(summary["job"] == job.job) & summary["enough"] & summary["cap_bytes"].notna()] \
                if len(summary) else summary
            measured = int(enough["cap_bytes"].min()) if len(enough) else None
            rows.append({"job": job.job, "need_bytes": job.need_bytes, "min_cap_bytes": job.min_cap_bytes,
                         "measured_enough_bytes": measured,
                         "recommended_bytes": measured if measured is not None else job.need_bytes,
                         "basis": "Q1: smallest cap within tolerance of uncapped" if measured is not None
                         else "analyzer: keep-all need (Q1 not measured)"})
        return pd.DataFrame(rows, columns=["job", "need_bytes", "min_cap_bytes", "measured_enough_bytes",
                                           "recommended_bytes", "basis"])

    def recommendation(self) -> pd.DataFrame:
        """Principles 2 and 3 over every measured pair, each job with its principle-1 memory; 'chosen':
        disjoint pairs that pass the rule and fit the device, best combined throughput first."""
        memory = self.memory_recommendation().set_index("job")["recommended_bytes"]
        similar, need = self.jaccard(), self.jobs.set_index("job")["need_bytes"]
        device_bytes = self.meta.get("device_bytes")
        rows = []
        for p in self._ok_pairs().itertuples():
            memory_a, memory_b = int(memory.get(p.job_a, 0)), int(memory.get(p.job_b, 0))
            jac = similar.loc[p.job_a, p.job_b] if p.job_a in similar.index and p.job_b in similar.index else np.nan
            smaller = p.job_a if p.alone_a_s <= p.alone_b_s else p.job_b
            r_small, r_large = (p.r_ab, p.r_ba) if smaller == p.job_a else (p.r_ba, p.r_ab)
            rows.append({"pair": p.pair, "job_a": p.job_a, "job_b": p.job_b, "r_ab": p.r_ab, "r_ba": p.r_ba,
                         "combined_throughput": p.combined_throughput, "colocate": bool(p.colocate),
                         "jaccard": jac, "size_similarity": min(need[p.job_a], need[p.job_b]) /
                         max(need[p.job_a], need[p.job_b]), "memory_a_bytes": memory_a,
                         "memory_b_bytes": memory_b, "memory_bytes": memory_a + memory_b,
                         "fits": device_bytes is None or memory_a + memory_b <= device_bytes, "smaller": smaller,
                         "smaller_suffers_more": bool(r_small > r_large)})
        frame = pd.DataFrame(rows, columns=["pair", "job_a", "job_b", "r_ab", "r_ba", "combined_throughput",
                                            "colocate", "jaccard", "size_similarity", "memory_a_bytes",
                                            "memory_b_bytes", "memory_bytes", "fits",
                                            "smaller", "smaller_suffers_more"])
        frame = frame.sort_values("combined_throughput", ascending=False, kind="stable").reset_index(drop=True)
        frame["chosen"], frame["reason"] = _choose(frame)
        return frame

    def principles(self) -> pd.DataFrame:
        """Document 004's conclusions, checked against this study: claim, what was measured, holds?"""
        return check_principles(self)

    # -- JSON -----------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        return {"meta": self.meta, "tables": {name: _records(getattr(self, name)) for name in TABLES}}

    def save(self, path: str | Path) -> Path:
        """Write the result as JSON (device, versions, config, every raw table); returns the path.

        The metadata is indented; each table row is one line, a list in the order of its columns."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        data = self.to_dict()
        tables = ",\n".join(
            f' {json.dumps(name)}: {{"columns": {json.dumps(table["columns"])}, "rows": [\n'
            + ",\n".join("  " + json.dumps(row, allow_nan=False) for row in table["rows"]) + "]}"
            for name, table in data["tables"].items())
        meta = json.dumps(data["meta"], indent=1, allow_nan=False)
        path.write_text(f'{{"meta": {meta},\n"tables": {{\n{tables}}}}}\n', encoding="utf-8")
        return path


def load(path: str | Path) -> StudyResult:
    """A StudyResult saved by ``save``."""
    data = json.loads(Path(path).read_text(encoding="utf-8"))
    if "tables" not in data or "meta" not in data:
        raise ValueError(f"{path} is not a saved co-training study (no 'meta' and 'tables'): save one with "
                         "result.save(path)")
    tables = {name: pd.DataFrame(data["tables"][name]["rows"], columns=data["tables"][name]["columns"])
              for name in TABLES}
    return StudyResult(meta=data["meta"], **tables)


def _records(frame: pd.DataFrame) -> dict:
    rows = [[_plain(v) for v in row] for row in frame.itertuples(index=False, name=None)]
    return {"columns": list(frame.columns), "rows": rows}


def _plain(value):
    if isinstance(value, (np.integer,)):
        return int(value)
    if isinstance(value, (np.floating, float)):
        return None if math.isnan(value) else float(value)
    if isinstance(value, np.bool_):
        return bool(value)
    if value is pd.NA or value is pd.NaT:
        return None
    return value


def compare_runs(results: list[StudyResult]) -> pd.DataFrame:
    """r of the same study run several times: one row per (job, partner), a column per run, and the spread
    (largest - smallest) / smallest; a pair missing from a run is NaN there."""
    if len(results) < 2:
        raise ValueError(f"comparing runs needs at least two StudyResults, got {len(results)}")
    frames = [r.degradation().set_index(["job", "partner"])["r"] for r in results]
    table = pd.concat(frames, axis=1, keys=[f"run{i + 1}" for i in range(len(frames))])
    table["relative_spread"] = (table.max(axis=1) - table.min(axis=1)) / table.min(axis=1)
    return table.reset_index()


def weighted_jaccard(a: np.ndarray, b: np.ndarray) -> float:
    """sum(min(a, b)) / sum(max(a, b)) over op types (1: the same mix, 0: nothing in common)."""
    top = np.maximum(a, b).sum()
    return float(np.minimum(a, b).sum() / top) if top > 0 else float("nan")


def _ks_row(pair, job, signal, source, alone: pd.Series, shared: pd.Series, alpha: float) -> dict:
    row = {"pair": pair, "job": job, "signal": signal, "source": source, "n_alone": len(alone),
           "n_shared": len(shared), "mean_alone": float(alone.mean()) if len(alone) else np.nan,
           "mean_shared": float(shared.mean()) if len(shared) else np.nan, "statistic": np.nan, "p_value": np.nan,
           "same_distribution": None}
    if len(alone) >= 3 and len(shared) >= 3:
        row["statistic"], row["p_value"] = ks_2samp(alone, shared)
        row["same_distribution"] = bool(row["p_value"] >= alpha)
    return row


def _choose(frame: pd.DataFrame) -> tuple[list[bool], list[str]]:
    """Greedy: best combined throughput first, each job in at most one chosen pair."""
    taken: set[str] = set()
    chosen, reasons = [], []
    for row in frame.itertuples():
        if not row.colocate:
            chosen.append(False)
            reasons.append(f"principle 2 fails: r_AB*r_BA = {row.r_ab * row.r_ba:.2f} >= r_AB+r_BA = "
                           f"{row.r_ab + row.r_ba:.2f}; run them one after the other")
        elif not row.fits:
            chosen.append(False)
            reasons.append(f"needs {format_bytes(row.memory_bytes)}, more than the device has")
        elif row.job_a in taken or row.job_b in taken:
            chosen.append(False)
            reasons.append("co-locatable, but a job of it is already in a better pair")
        else:
            taken.update((row.job_a, row.job_b))
            chosen.append(True)
            reasons.append(f"co-locate: combined throughput {row.combined_throughput:.2f} > 1; give "
                           f"{row.job_a} {format_bytes(row.memory_a_bytes)} and {row.job_b} "
                           f"{format_bytes(row.memory_b_bytes)}")
    return chosen, reasons


def signal_descriptions(device: str) -> dict[str, str]:
    return dict(GPU_SIGNALS if device.startswith("cuda") else CPU_SIGNALS)


def cut_samples(samples: list[tuple[float, str, str, float]], windows: list[dict], started: float) -> pd.DataFrame:
    """Keep the samples inside Q2's windows, labelled (pair, window, subject)."""
    rows = []
    for window in windows:
        sources = {"device", *window["jobs"]}
        for moment, source, signal, value in samples:
            if window["start"] <= moment <= window["end"] and source in sources:
                rows.append({"pair": window["pair"], "window": window["window"], "subject": window["subject"],
                             "source": source, "signal": signal, "t_s": moment - started, "value": value})
    return pd.DataFrame(rows, columns=["pair", "window", "subject", "source", "signal", "t_s", "value"])
