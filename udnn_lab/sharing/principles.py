"""Document 004's conclusions and principles, each checked against one study's numbers."""

from __future__ import annotations

import numpy as np
import pandas as pd

COLUMNS = ["item", "document_004", "measured", "agrees"]


def check_principles(result) -> pd.DataFrame:
    """One row per conclusion or principle: what document 004 says, what this study measured, agreement."""
    rows = [_conclusion_1(result), _conclusion_2(result), _rule(result), _conclusion_3(result)]
    rows += _conclusion_4_5(result)
    rows += [_smaller_suffers(result), _principle_3(result)]
    return pd.DataFrame(rows, columns=COLUMNS)


def _row(item: str, claim: str, measured: str, agrees) -> dict:
    return {"item": item, "document_004": claim, "measured": measured, "agrees": agrees}


def _conclusion_1(result) -> dict:
    claim = "Q1 / conclusion 1: once a job has the minimum memory it needs, more memory does not make it faster"
    summary = result.q1_summary()
    at_need = summary[summary["cap"] == "need"] if len(summary) else summary
    if not len(at_need):
        return _row("C1", claim, "Q1 not measured", None)
    holding = int(at_need["enough"].sum())
    below = summary[summary["cap_bytes"].notna() & (summary["cap"] != "need") & summary["oom"].isna()]
    worst = f"; below the need, the planner's plans cost up to {below['slowdown'].max():.2f}x" if len(below) else ""
    return _row("C1", claim, f"{holding} of {len(at_need)} jobs run as fast at their need as uncapped "
                f"(slowdown {at_need['slowdown'].min():.2f}-{at_need['slowdown'].max():.2f}x){worst}",
                holding == len(at_need))


def _conclusion_2(result) -> dict:
    claim = "Q2 / conclusion 2: every job slows down when shared, by an amount that depends on the pair"
    tidy = result.degradation()
    if not len(tidy):
        return _row("C2", claim, "Q2 not measured", None)
    slowed = int((tidy["r"] > 1.0).sum())
    return _row("C2", claim, f"{slowed} of {len(tidy)} r values above 1; r from {tidy['r'].min():.2f} to "
                f"{tidy['r'].max():.2f}", slowed == len(tidy))


def _rule(result) -> dict:
    claim = ("principle 2: co-locate only when r_AB*r_BA < r_AB + r_BA (combined throughput > 1); "
             "conclusion 2: some pairs are more efficient together")
    pairs = result.recommendation()
    if not len(pairs):
        return _row("P2", claim, "Q2 not measured", None)
    passing = int(pairs["colocate"].sum())
    return _row("P2", claim, f"{passing} of {len(pairs)} pairs pass; combined throughput "
                f"{pairs['combined_throughput'].min():.2f}-{pairs['combined_throughput'].max():.2f}", passing > 0)


def _conclusion_3(result) -> dict:
    claim = "Q3 / conclusion 3: the models' operator mixes differ strongly (low normalized Jaccard similarity)"
    matrix = result.jaccard()
    if len(matrix) < 2:
        return _row("C3", claim, "Q3 not measured for two jobs", None)
    values = matrix.to_numpy()[~np.eye(len(matrix), dtype=bool)]
    return _row("C3", claim, f"Jaccard between different jobs {values.min():.2f}-{values.max():.2f} "
                f"(mean {values.mean():.2f})", bool(values.mean() < 0.5))


def _conclusion_4_5(result) -> list[dict]:
    ks = result.ks()
    gpu = str(result.meta.get("device", "")).startswith("cuda")
    occupancy = ("Q4 / conclusion 4: device occupancy has the same distribution alone and shared (KS test)")
    io = ("Q4 / conclusion 5: host-to-device copy throughput drops significantly when shared (p ~ 0): the "
          "contention is in I/O")
    if not len(ks) or ks["same_distribution"].isna().all():
        return [_row("C4", occupancy, "Q4 not measured", None), _row("C5", io, "Q4 not measured", None)]
    busy = ks[(ks["signal"] == "device_busy_percent") & ks["same_distribution"].notna()]
    same = int(busy["same_distribution"].astype(bool).sum())
    what = "GPU" if gpu else "the jobs' CPU core(s)'"
    rows = [_row("C4", occupancy, f"{same} of {len(busy)} comparisons of {what} utilization alone vs shared "
                 "keep the same distribution (p >= 0.05)",
                 bool(same >= len(busy) / 2) if len(busy) else None)]
    signal = "h2d_bytes_per_s" if gpu else "runqueue_wait_percent"
    contention = ks[(ks["signal"] == signal) & ks["same_distribution"].notna()]
    if not len(contention):
        return rows + [_row("C5", io, f"no {signal} samples", None)]
    changed = int((~contention["same_distribution"].astype(bool)).sum())
    what = "H2D PCIe throughput" if gpu else "time waiting for a core (the CPU has no PCIe: its shared resource)"
    rows.append(_row("C5", io, f"{what}: {changed} of {len(contention)} comparisons differ alone vs shared; "
                     f"mean {contention['mean_alone'].mean():.3g} alone, {contention['mean_shared'].mean():.3g} "
                     "shared", bool(changed >= len(contention) / 2)))
    return rows


def _smaller_suffers(result) -> dict:
    claim = "conclusion 4: the smaller model of a pair suffers more (here: smaller = shorter step alone)"
    pairs = result.recommendation()
    if not len(pairs):
        return _row("C4b", claim, "Q2 not measured", None)
    count = int(pairs["smaller_suffers_more"].sum())
    return _row("C4b", claim, f"in {count} of {len(pairs)} pairs the job with the shorter step has the larger r",
                bool(count > len(pairs) / 2))


def _principle_3(result) -> dict:
    claim = "principle 3: pairs of similar size and operator mix co-train better"
    pairs = result.recommendation().dropna(subset=["jaccard"])
    if len(pairs) < 3:
        return _row("P3", claim, "fewer than 3 pairs with both Q2 and Q3", None)
    by_mix = _spearman(pairs["jaccard"], pairs["combined_throughput"])
    by_size = _spearman(pairs["size_similarity"], pairs["combined_throughput"])
    measured = (f"rank correlation of combined throughput with op-mix similarity {by_mix:+.2f}, with size "
                f"similarity {by_size:+.2f} ({len(pairs)} pairs)")
    if not pairs["colocate"].any():  # principle 3 chooses among co-locatable pairs: here there are none
        return _row("P3", claim, measured + "; no pair passes principle 2, so there is nothing to prefer", None)
    return _row("P3", claim, measured, bool(by_mix > 0 and by_size > 0))


def _spearman(x: pd.Series, y: pd.Series) -> float:
    value = x.rank().corr(y.rank())
    return float(value) if value == value else float("nan")
