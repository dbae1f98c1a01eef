"""The co-training study (document 004): a tiny study end to end, failures, refusals, cleanup, charts."""

import json
import math
import multiprocessing
import os
import signal
import threading

import numpy as np
import pandas as pd
import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor

import udnn_lab as ul
from udnn_lab import sharing
from udnn_lab.sharing._worker import JobAnalysis, op_type
from udnn_lab.sharing.signals import EXACT_KS_LIMIT, kolmogorov_sf
from udnn_lab.sharing.study import StudyConfig, run_jobs

FAST = dict(size="tiny", warmup=2, iterations=15, min_phase_s=0.4, sample_interval_s=0.02, profile_repeats=1,
            retries=0, progress=False)


# -- job factories for the failure tests (module level: the study imports them in fresh processes) -------------
def crash_at_build(batch, device, **options):
    raise RuntimeError("this job's factory fails on purpose")


class _Flaky(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 2)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        if self.calls > 4:  # every run builds the model afresh: the first run raises at its 5th step
            raise RuntimeError("this job crashes mid-run on purpose")
        return self.fc(x)


def crash_mid_run(batch, device):
    return ul.zoo.get(_Flaky(), batch=batch, input_shape=(8,), device=device)


class _DiesWhenTrained(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 2)
        self.calls = 0

    def forward(self, x):
        if not isinstance(x, FakeTensor):  # the analyzer's trace runs on fake tensors; training does not
            self.calls += 1
            if self.calls == 3:
                os._exit(3)  # the process vanishes mid-run, no traceback, no goodbye
        return self.fc(x)


def die_when_trained(batch, device):
    return ul.zoo.get(_DiesWhenTrained(), batch=batch, input_shape=(8,), device=device)


def _gone(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    with open(f"/proc/{pid}/stat") as stat:  # a zombie is gone too, but nothing of ours should be one
        return stat.read().split(")")[1].split()[0] == "Z"


@pytest.fixture(scope="module")
def study():
    jobs = [*sharing.document_004_jobs("tiny", ("mlp5", "vgg19")),
            sharing.JobSpec("breaks-at-build", f"{__name__}:crash_at_build", batch=2),
            sharing.JobSpec("breaks-mid-run", f"{__name__}:crash_mid_run", batch=2)]
    result = sharing.run_study(jobs, **FAST)
    assert not multiprocessing.active_children()
    return result


# -- the tiny study end to end ----------------------------------------------------------------------
def test_q1_times_against_caps(study):
    summary = study.q1_summary()
    capped = summary[summary["job"] == "vgg19"]
    assert list(capped["cap"]) == ["uncapped", "need", "midway", "min"]
    assert (capped["median_time_s"] > 0).all() and capped["oom"].isna().all()
    assert capped.iloc[1:]["cap_bytes"].is_monotonic_decreasing
    assert (capped[capped["cap"] == "min"]["policy"] == "auto").all()  # below the need: planned
    assert study.meta["cap_enforcement"].startswith("CPU")


def test_r_is_the_ratio_of_mean_iteration_times(study):
    pair = study.pairs.set_index("pair").loc["mlp5 + vgg19"]
    steps = study.q2[study.q2["pair"] == "mlp5 + vgg19"]
    assert (steps["interval_s"] >= steps["time_s"] - 1e-6).all()  # an iteration holds its step
    mean = steps.groupby(["job", "phase"])["interval_s"].mean()
    assert pair["r_ab"] == pytest.approx(mean["mlp5", "shared"] / mean["mlp5", "alone"])
    assert pair["r_ba"] == pytest.approx(mean["vgg19", "shared"] / mean["vgg19", "alone"])
    assert pair["alone_b_s"] == pytest.approx(mean["vgg19", "alone"])
    shared_a = steps[(steps["job"] == "mlp5") & (steps["phase"] == "shared")]["start_s"]
    alone_a = steps[(steps["job"] == "mlp5") & (steps["phase"] == "alone")]["start_s"]
    alone_b = steps[(steps["job"] == "vgg19") & (steps["phase"] == "alone")]["start_s"]
    assert alone_a.max() < shared_a.min() and shared_a.max() < alone_b.min()  # A alone, both, then B alone


def test_q2_degradation_throughput_and_rule(study):
    pair = study.pairs[study.pairs["pair"] == "mlp5 + vgg19"].iloc[0]
    assert pair["status"] == "ok"
    assert pair["r_ab"] > 0 and pair["r_ba"] > 0
    assert math.isclose(pair["combined_throughput"], 1 / pair["r_ab"] + 1 / pair["r_ba"])
    assert pair["colocate"] == (pair["r_ab"] * pair["r_ba"] < pair["r_ab"] + pair["r_ba"])
    matrix = study.degradation_matrix()
    assert matrix.loc["mlp5", "vgg19"] == pytest.approx(pair["r_ab"])
    assert matrix.loc["vgg19", "mlp5"] == pytest.approx(pair["r_ba"])
    phases = study.q2[study.q2["pair"] == "mlp5 + vgg19"].groupby(["job", "phase"]).size()
    assert (phases >= FAST["iterations"]).all() and len(phases) == 4


def test_q3_operator_mix_and_jaccard(study):
    shares = study.op_mix.groupby("job")["share"].sum()
    assert shares.loc["mlp5"] == pytest.approx(1.0) and shares.loc["vgg19"] == pytest.approx(1.0)
    jaccard = study.jaccard()
    assert jaccard.loc["mlp5", "mlp5"] == pytest.approx(1.0)
    assert 0 <= jaccard.loc["mlp5", "vgg19"] < 1
    assert jaccard.loc["mlp5", "vgg19"] == pytest.approx(jaccard.loc["vgg19", "mlp5"])


def test_q4_signals_compared_with_ks(study):
    ks = study.ks()
    tested = ks[ks["same_distribution"].notna()]
    assert {"device_busy_percent", "cpu_busy_percent", "runqueue_wait_percent"} <= set(tested["signal"])
    assert tested["p_value"].between(0, 1).all() and tested["statistic"].between(0, 1).all()
    assert set(study.samples["window"]) == {"alone", "shared"}


def test_recommendation_from_the_principles(study):
    memory = study.memory_recommendation().set_index("job")
    assert set(memory.index) == {"mlp5", "vgg19"}
    assert (memory["recommended_bytes"] >= memory["min_cap_bytes"]).all()
    rec = study.recommendation()
    row = rec[rec["pair"] == "mlp5 + vgg19"].iloc[0]
    assert row["chosen"] == (row["colocate"] and row["fits"])
    assert row["reason"]
    principles = study.principles()
    assert list(principles["item"]) == ["C1", "C2", "P2", "C3", "C4", "C5", "C4b", "P3"]


def test_crashing_jobs_are_reported_and_the_others_go_on(study):
    errors = study.errors.set_index("job")
    assert "fails on purpose" in errors.loc["breaks-at-build", "error"]
    assert errors.loc["breaks-at-build", "stage"] == "start"
    assert "crashes mid-run on purpose" in errors.loc["breaks-mid-run", "error"]
    assert errors.loc["breaks-mid-run", "stage"] == "q1"
    status = study.jobs.set_index("job")["status"]
    assert status.loc["mlp5"] == "ok" and status.loc["breaks-mid-run"] == "failed in q1"
    skipped = study.pairs[study.pairs["status"] == "skipped"]
    assert len(skipped) == 2 and skipped["error"].str.contains("out of the study").all()


def test_children_are_gone_after_the_study(study):
    pids = [int(p) for p in study.jobs["pid"].dropna()]
    assert len(pids) >= 3  # every job that started (the build crash reports no pid)
    assert all(_gone(pid) for pid in pids)


def test_heatmap_chart_has_the_r_values(study):
    chart = sharing.degradation_heatmap(study)
    spec = chart.to_dict()
    values = [row for rows in spec["datasets"].values() for row in rows]
    assert {(v["job"], v["partner"]) for v in values} == {("mlp5", "vgg19"), ("vgg19", "mlp5")}
    assert sorted(v["r"] for v in values) == sorted(study.degradation()["r"])
    for make in (sharing.q1_chart, sharing.op_mix_chart, sharing.jaccard_heatmap, sharing.signals_chart):
        assert make(study).to_dict()


def test_repeat_comparison(study):
    table = sharing.compare_runs([study, study])
    assert len(table) == 2 and (table["relative_spread"] == 0).all()
    assert sharing.repeat_chart(table).to_dict()
    with pytest.raises(ValueError, match="at least two"):
        sharing.compare_runs([study])


def test_json_round_trip(study, tmp_path):
    path = study.save(tmp_path / "study.json")
    data = json.loads(path.read_text())
    assert data["meta"]["versions"]["torch"] == torch.__version__ and data["meta"]["device"] == "cpu"
    assert data["meta"]["gpu_results"].startswith("unmeasured")  # a CPU study never stands in for a GPU one
    assert data["meta"]["config"]["cores"] == [max(os.sched_getaffinity(0))]  # 'auto': one core, the device
    loaded = sharing.load(path)
    pd.testing.assert_frame_equal(loaded.degradation_matrix(), study.degradation_matrix())
    pd.testing.assert_frame_equal(loaded.jaccard(), study.jaccard())
    assert list(loaded.recommendation()["pair"]) == list(study.recommendation()["pair"])


# -- refusals and cleanup -------------------------------------------------------------------------------
def test_cap_below_minimum_is_refused_with_the_minimum():
    with pytest.raises(sharing.CapBelowMinimum) as refused:
        sharing.run_study(["mlp5"], caps=["1 KiB"], **FAST)
    assert refused.value.minimum_bytes > 1024
    assert str(refused.value.minimum_bytes) in str(refused.value)
    assert "'min'" in str(refused.value)
    assert not multiprocessing.active_children()


def test_job_dying_mid_pair_is_reported_and_the_others_go_on():
    jobs = [sharing.document_004_job("mlp5", "tiny"), sharing.JobSpec("dies", f"{__name__}:die_when_trained", 2),
            sharing.document_004_job("lstm", "tiny")]
    result = sharing.run_study(jobs, **{**FAST, "questions": ("q2",), "min_phase_s": 0.2})
    assert not multiprocessing.active_children()
    error = result.errors.set_index("job").loc["dies"]
    assert error["stage"] == "q2" and "its process died (exit code 3)" in error["error"]
    status = result.pairs.set_index("pair")["status"]
    assert status.to_dict() == {"mlp5 + dies": "failed", "mlp5 + lstm": "ok", "dies + lstm": "skipped"}
    assert result.degradation_matrix().loc["mlp5", "lstm"] > 0  # mlp5 was stopped and went on to its next pair
    assert all(_gone(int(pid)) for pid in result.jobs["pid"].dropna())


def test_interrupt_mid_run_ends_every_child():
    started, timer = {}, None

    def interrupt_soon(message):  # Ctrl-C in the parent half a second into Q1's first (30 s) run
        nonlocal timer
        if message.startswith("mlp5: need"):
            started["pids"] = [child.pid for child in multiprocessing.active_children()]
            timer = threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT))
            timer.start()

    config = StudyConfig(size="tiny", warmup=2, iterations=5, min_phase_s=30.0, questions=("q1",))
    # Python's own Ctrl-C handler, whatever an earlier test in this process left installed (an event loop's)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            run_jobs(sharing.document_004_jobs("tiny", ("mlp5",)), config, interrupt_soon)
    finally:
        signal.signal(signal.SIGINT, previous)
        if timer is not None:
            timer.cancel()
    assert len(started["pids"]) == 1 and all(_gone(pid) for pid in started["pids"])
    assert not multiprocessing.active_children()


# -- pieces without processes ----------------------------------------------------------------------
def _analysis(need=1000, least=600):
    return JobAnalysis("job", "m", 1, "cpu", "cpu", 0, 1, need, 0, need, least, 2**30, 0.0)


def test_resolve_caps():
    assert sharing.resolve_caps(None, _analysis()) == [("uncapped", None), ("need", 1000), ("midway", 800),
                                                        ("min", 600)]
    assert sharing.resolve_caps(["min", 0.8, None, 900], _analysis()) == [
        ("uncapped", None), ("900 B", 900), ("0.80 x need", 800), ("min", 600)]
    with pytest.raises(sharing.CapBelowMinimum, match="minimum 600 B"):
        sharing.resolve_caps([0.5], _analysis())


def test_ks_exact_p_values_computed_by_hand():
    # p = the share of the C(n+m, n) orderings of the pooled samples whose CDF gap reaches D
    assert sharing.ks_2samp([1, 2], [3, 4]) == pytest.approx((1.0, 2 / 6))  # only aabb and bbaa reach 1
    assert sharing.ks_2samp([1, 2, 3], [4, 5, 6]) == pytest.approx((1.0, 2 / 20))
    assert sharing.ks_2samp([1, 2, 3], [4, 5]) == pytest.approx((1.0, 2 / 10))
    assert sharing.ks_2samp([1, 3], [2, 4]) == pytest.approx((0.5, 1.0))  # every ordering reaches 1/2
    assert sharing.ks_2samp([1, 2, 3], [1, 2, 3]) == (0.0, 1.0)
    assert sharing.ks_2samp(range(50), range(100, 150))[1] == pytest.approx(2 / math.comb(100, 50))
    with pytest.raises(ValueError, match="at least one sample"):
        sharing.ks_2samp([], [1.0])


def test_ks_asymptotic_p_values():
    assert kolmogorov_sf(1.358) == pytest.approx(0.05, abs=1e-3)  # the 5% critical value
    assert kolmogorov_sf(1.628) == pytest.approx(0.01, abs=1e-3)  # the 1% one
    rng = np.random.default_rng(0)
    n = int(math.sqrt(EXACT_KS_LIMIT)) + 10  # above the exact limit
    same = sharing.ks_2samp(rng.normal(size=n), rng.normal(size=n))
    shifted = sharing.ks_2samp(rng.normal(size=n), rng.normal(1.0, size=n))
    assert same[1] > 0.05 and shifted[1] < 1e-6
    x, y = rng.normal(size=100), rng.normal(0.4, size=100)  # n m = 10 000: exact, near the asymptotic
    statistic, exact = sharing.ks_2samp(x, y)
    effective = math.sqrt(50)
    assert exact == pytest.approx(kolmogorov_sf((effective + 0.12 + 0.11 / effective) * statistic), rel=0.3)


def test_weighted_jaccard():
    assert sharing.weighted_jaccard(np.array([0.5, 0.5, 0]), np.array([0.5, 0.5, 0])) == 1.0
    assert sharing.weighted_jaccard(np.array([1.0, 0]), np.array([0, 1.0])) == 0.0
    assert sharing.weighted_jaccard(np.array([0.75, 0.25]), np.array([0.25, 0.75])) == pytest.approx(0.5 / 1.5)


def test_job_specs():
    jobs = sharing.document_004_jobs("full")
    assert [j.name for j in jobs] == ["mlp5", "vgg19", "resnet50", "lstm"]
    assert dict(jobs[1].options)["width"] == 64 and dict(jobs[2].options)["image_size"] == 224
    work = sharing.document_004_job("resnet50", "full").build("meta")
    assert sum(p.numel() for p in work.model.parameters()) == 25_557_032  # torchvision's ResNet-50
    work = sharing.document_004_job("vgg19", "full").build("meta")
    assert sum(p.numel() for p in work.model.parameters()) == 143_667_240  # torchvision's VGG-19
    assert sharing.JobSpec("x", "mlp5", options={"b": 1, "a": 2}).options == (("a", 2), ("b", 1))
    with pytest.raises(ValueError, match="batch"):
        sharing.JobSpec("x", "mlp5", batch=0)
    with pytest.raises(ValueError, match="size"):
        sharing.document_004_jobs("huge")
    assert op_type("aten.add_.Tensor") == "add" and op_type("aten.mm.default") == "mm"


def test_unknown_pair_and_bad_arguments():
    with pytest.raises(ValueError, match="iterations"):
        sharing.run_study(["mlp5"], iterations=1, progress=False)
    with pytest.raises(TypeError, match="JobSpec"):
        sharing.run_study([42], progress=False)
