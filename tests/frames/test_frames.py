import numpy as np
import pandas as pd
import pytest

import udnn_lab as ul
from udnn_lab import frames
from udnn_lab.frames.streams import TIMELINE_FRAME_COLUMNS
from udnn_lab.frames.sweeps import MODEL_SIZES
from udnn_lab.vocabulary import CATEGORIES

HW = "titan-x-maxwell"


@pytest.fixture(scope="module")
def measured():
    work = ul.zoo.get("mlp5", batch=4)
    return ul.trace(work), ul.measure(work, repeats=1)


@pytest.fixture(scope="module")
def big():
    """DenseNet-201: ~5,500 ops, more than altair's 5,000 rows."""
    graph = ul.trace(ul.zoo.get("densenet201", batch=2, image_size=32, device="meta"), device="cuda")
    return graph, ul.simulate(graph, ul.plan(graph, None, "vdnn-all", hardware=HW), hardware=HW)


def test_downsample_keeps_each_buckets_peak_and_the_phases():
    curve = pd.DataFrame({"phase": ["forward"] * 600 + ["backward"] * 400,
                          "live_bytes": np.r_[np.arange(600), np.arange(400)[::-1] * 3]})
    sampled = frames.downsample(curve, points=50)
    assert len(sampled) <= 52
    assert sampled["live_bytes"].max() == curve["live_bytes"].max()
    assert list(dict.fromkeys(sampled["phase"])) == ["forward", "backward"]
    assert frames.downsample(curve, points=None).equals(curve)
    with pytest.raises(ValueError, match="positive"):
        frames.downsample(curve, points=0)


def test_memory_curve_stacks_categories_and_totals(small):
    graph, sim = small
    frame = frames.memory_curve(graph, points=None)
    assert set(frame["series"]) == {"predicted"}
    assert set(frame["category"]) - {"total"} <= set(CATEGORIES)
    parts = frame[frame["category"] != "total"].groupby("index")["bytes"].sum()
    assert (parts.to_numpy() == graph.memory_curve()["live_bytes"].to_numpy()).all()
    total = frame[frame["category"] == "total"]
    assert total["bytes"].max() == graph.cuda_peak_bytes  # as the budget counts them on CUDA
    assert {"module", "op", "phase"} <= set(frame.columns)
    timed = frames.memory_curve(graph, sim)
    assert timed["start_s"].notna().all() and timed["bytes"].max() <= sim.peak_bytes


def test_memory_curve_overlays_a_measurement(measured):
    graph, measurement = measured
    frame = frames.memory_curve(graph, measurement=measurement)
    mine = frame[frame["series"] == "measured"]
    assert len(mine) == len(graph.ops) and set(mine["category"]) == {"total"}
    assert mine["bytes"].max() == measurement.compare(graph)["measured_bytes"].max()
    versus = frames.predicted_vs_measured(graph, measurement)
    assert set(versus["series"]) == {"predicted", "measured"}


def test_big_model_curve_is_downsampled_under_altairs_limit_and_keeps_its_peak(big):
    graph, sim = big
    assert len(graph.ops) > 5000
    frame = frames.memory_curve(graph, sim)
    assert len(frame) < 5000
    assert frame[frame["category"] == "total"]["bytes"].max() == sim.peak_bytes
    assert len(frames.memory_by_category(graph)) < 5000


def test_timeline_from_a_simulation(small):
    _, sim = small
    frame = frames.timeline(sim)
    assert list(frame.columns) == TIMELINE_FRAME_COLUMNS
    assert set(frame["source"]) == {"simulated"}
    assert set(frame["lane"]) <= set(frames.LANES) and "d2h" in set(frame["lane"])
    assert (frame["stall"] == frame["kind"].isin(frames.STALL_KINDS)).all()
    assert len(frame) == len(sim.timeline) and frame["count"].eq(1).all()


def test_big_timeline_is_coalesced_without_losing_time_or_bytes(big):
    _, sim = big
    frame = frames.timeline(sim, max_rows=1000)
    assert len(sim.timeline) > 1000 >= len(frame)
    assert frame["count"].sum() == len(sim.timeline)
    assert frame["nbytes"].sum() == sim.timeline["nbytes"].sum()
    assert frame["end_s"].max() == pytest.approx(sim.timeline["end_s"].max())
    for lane, rows in frame.groupby("lane"):
        assert set(rows["kind"]) == set(sim.timeline[sim.timeline["stream"] == lane]["kind"])


def test_timeline_takes_measured_events_from_a_run():
    events = pd.DataFrame({"stream": ["compute", "d2h", "compute"], "kind": ["op", "offload", "stall_prefetch"],
                           "start_s": [0.0, 0.001, 0.002], "end_s": [0.001, 0.003, 0.004]})
    frame = frames.timeline(events)
    assert set(frame["source"]) == {"measured"} and frame["stall"].sum() == 1
    assert (frame["nbytes"] == 0).all() and (frame["module"] == "").all()
    with pytest.raises(ValueError, match="missing"):
        frames.timeline(events.drop(columns=["kind"]))
    with pytest.raises(ValueError, match="unknown stream"):
        frames.timeline(events.assign(stream="gpu"))
    with pytest.raises(TypeError, match="Simulation"):
        frames.timeline([1, 2])


def test_layers_counts_each_modules_own_work(small):
    graph, sim = small
    table = frames.layers(graph, sim)
    counted = {op.module for op in graph.ops} & set(table["module"])
    flops = sum(op.flops for op in graph.ops if op.phase != "optimizer" and op.module in counted)
    assert table["flops"].sum() == flops
    assert (table["time_s"] > 0).any()
    assert table["offloaded_bytes"].sum() == sim.d2h_bytes
    assert table["order"].is_monotonic_increasing
    assert np.isnan(frames.layers(graph)["time_s"]).all()
    assert len(frames.layers(graph, top=5)) == 5


def test_budget_sweep_marks_the_pareto_front(small):
    graph, _ = small
    sweep = pd.DataFrame({"budget_bytes": [1, 2, 3, 1, 2, 3], "policy": list("aaabbb"),
                          "fits": [False, True, True, True, True, True],
                          "step_time_s": [np.nan, 5.0, 2.0, 6.0, 4.0, 3.0], "d2h_bytes": [0] * 6})
    frame = frames.budget_sweep(sweep, graph)
    assert frame["pareto"].tolist() == [False, False, True, True, True, False]
    assert frame["slowdown"].min() == 1.0
    assert (frame["kept_bytes"] == frame["saved_bytes"]).all() and frame["saved_bytes"].iloc[0] > 0
    with pytest.raises(ValueError, match="ul.sweep"):
        frames.budget_sweep(sweep.drop(columns=["fits"]))


def test_bandwidth_measured_and_modelled():
    sweep = pd.DataFrame({"device": "cpu", "direction": "memcpy", "pinned": False, "nbytes": [4096, 1 << 20],
                          "seconds": [1e-6, 1e-4], "seconds_min": 0.0, "repeats": 1, "bytes_per_s": 0.0})
    hw = ul.Hardware.load("h100-sxm")
    frame = frames.bandwidth(sweep, hw)
    assert set(frame["source"]) == {"measured", "h100-sxm"}
    model = frame[(frame["source"] == "h100-sxm") & (frame["series"] == "h2d pinned")]
    assert len(model) == 2
    assert model["seconds"].iloc[-1] == pytest.approx(hw.transfer_time_s(1 << 20, "h2d", True))
    assert len(frames.bandwidth(hardware=[hw])) == 4 * len(MODEL_SIZES)
    with pytest.raises(ValueError, match="measure"):
        frames.bandwidth()


def test_simulations_and_savings(small):
    graph, sim = small
    table = frames.savings(frames.simulations({"keep": ul.simulate(graph, hardware=HW), "vdnn": sim}))
    base = table[table["policy"] == "keep-all"].iloc[0]
    assert base["peak_saved"] == 0 and base["time_paid"] == 0
    curve = sim.memory_curve()["cuda_live_bytes"]
    row = table[table["policy"] == "vdnn-all"].iloc[0]
    assert curve.min() <= row["average_bytes"] <= curve.max()
    labelled = frames.simulations([({"hardware": HW, "batch": 2}, sim)])
    assert labelled.loc[0, "hardware"] == HW and labelled.loc[0, "batch"] == 2
    with pytest.raises(ValueError, match="baseline"):
        frames.savings(table[table["policy"] != "keep-all"])


def test_live_tensors_at_an_op_sum_to_the_curve_kept_all_and_under_a_plan(small):
    graph, sim = small
    kept, planned = graph.memory_curve(), sim.memory_curve()
    states = set()
    for i in range(len(graph.ops)):
        alone = frames.live_tensors(graph, i)
        assert alone["on_device"].all() and alone["nbytes"].sum() == kept["live_bytes"].iloc[i]
        assert alone["cuda_nbytes"].sum() == kept["cuda_live_bytes"].iloc[i]
        under = frames.live_tensors(graph, i, sim)
        on = under[under["on_device"]]
        assert on["nbytes"].sum() == planned["live_bytes"].iloc[i]
        assert on["cuda_nbytes"].sum() == planned["cuda_live_bytes"].iloc[i]
        states |= set(under["state"])
    assert {"on device", "offloaded"} <= states and states <= {"on device", "offloading", "prefetching",
                                                                 "offloaded", "dropped"}


def test_live_tensors_name_their_producer_module_and_life(small):
    graph, sim = small
    peak = int(graph.memory_curve()["live_bytes"].idxmax())
    frame = frames.live_tensors(graph, peak, sim)
    assert list(frame.columns) == frames.LIVE_TENSOR_COLUMNS
    on = frame[frame["on_device"]]
    assert on["nbytes"].is_monotonic_decreasing
    for row in frame.itertuples():
        t = graph.tensors[row.id]
        assert (row.tensor, row.nbytes, row.category, row.module) == (t.name, t.nbytes, t.category, t.module)
        assert row.alloc_op <= peak and (pd.isna(row.free_op) or row.free_op >= peak)
        if t.producer is None:
            assert row.producer == -1
        else:
            assert (row.producer, row.producer_op) == (t.producer, graph.ops[t.producer].name)
        last = len(graph.ops) - 1 if pd.isna(row.free_op) else row.free_op
        assert row.lifetime_ops == last - max(row.alloc_op, 0) + 1
        starts, ends = sim.curve["start_s"], sim.curve["end_s"]
        assert row.lifetime_s == pytest.approx(ends.iloc[last] - starts.iloc[max(row.alloc_op, 0)])
    assert frames.live_tensors(graph, peak)["lifetime_s"].isna().all()
    assert frame.attrs["op"] == graph.ops[peak].name
    with pytest.raises(IndexError, match="op_index"):
        frames.live_tensors(graph, len(graph.ops))
