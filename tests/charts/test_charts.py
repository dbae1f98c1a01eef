import re

import pandas as pd
import pytest

import udnn_lab as ul
from udnn_lab import charts, frames

HW = "titan-x-maxwell"


def layers_of(spec: dict) -> list[dict]:
    """Every unit spec (one mark) in a chart spec, however nested."""
    found = []
    for key in ("layer", "vconcat", "hconcat", "concat"):
        for child in spec.get(key, []):
            found += layers_of(child)
    if "spec" in spec:
        found += layers_of(spec["spec"])
    if "mark" in spec:
        found.append(spec)
    return found


def mark_type(unit: dict) -> str:
    return unit["mark"] if isinstance(unit["mark"], str) else unit["mark"]["type"]


def rows(spec: dict) -> list[dict]:
    return [row for values in spec.get("datasets", {}).values() for row in values]


def test_memory_curve_encodes_categories_totals_phases_and_the_budget(small):
    graph, sim = small
    frame = frames.memory_curve(graph, sim)
    spec = charts.memory_curve(frame, budget_bytes=40 << 20, min_budget_bytes=30 << 20).to_dict()
    units = layers_of(spec)
    area = next(u for u in units if mark_type(u) == "area")
    assert area["encoding"]["color"]["field"] == "category"
    assert area["encoding"]["y"]["stack"] == "zero"
    tips = {t["field"] for t in area["encoding"]["tooltip"]}
    assert {"op", "module", "phase", "category"} <= tips
    line = next(u for u in units if mark_type(u) == "line")
    assert line["encoding"]["stroke"]["field"] == "series"
    assert any(mark_type(u) == "rect" for u in units)  # forward | backward | optimizer bands
    rule = next(u for u in units if mark_type(u) == "rule")
    budgets = {r["label"]: r["value"] for r in rows(spec) if "label" in r}
    assert budgets == {"budget": 40.0, "minimum feasible": 30.0} and rule["encoding"]["y"]["field"] == "value"


@pytest.mark.parametrize("points", [None, 100])
def test_memory_curve_without_a_budget_has_no_rule(small, points):
    graph, _ = small
    spec = charts.memory_curve(frames.memory_curve(graph, points=points)).to_dict()
    assert not any(mark_type(u) == "rule" for u in layers_of(spec))


def test_an_ultra_deep_network_charts_under_the_row_limit(resnet1001):
    graph, sim = resnet1001
    assert len(graph.ops) > 8000
    for chart in (charts.memory_curve(frames.memory_curve(graph, sim), budget_bytes=sim.peak_bytes),
                  charts.timeline(frames.timeline(sim)), charts.layer_bars(frames.layers(graph, sim)),
                  charts.memory_by_category(frames.memory_by_category(graph))):
        spec = chart.to_dict()  # altair raises MaxRowsError past 5,000 rows
        assert all(len(values) < 5000 for values in spec["datasets"].values())
    assert "1000 modules with most" in charts.layer_bars(frames.layers(graph, sim)).to_dict()["title"]


def test_timeline_lanes_and_stalls(small):
    _, sim = small
    measured = pd.DataFrame({"stream": ["compute", "h2d"], "kind": ["op", "prefetch"], "start_s": [0.0, 0.0],
                             "end_s": [0.001, 0.002]})
    frame = pd.concat([frames.timeline(sim), frames.timeline(measured)], ignore_index=True)
    spec = charts.timeline(frame).to_dict()
    units = layers_of(spec)
    bar = next(u for u in units if mark_type(u) == "bar")
    assert bar["encoding"]["y"]["field"] == "track" and bar["encoding"]["x2"]["field"] == "end_ms"
    assert bar["encoding"]["color"]["field"] == "kind"
    assert any(mark_type(u) == "tick" for u in units)  # stalls ticked
    tracks = {r["track"] for r in rows(spec) if "track" in r}
    assert "simulated · compute" in tracks and "measured · host → device" in tracks


def test_layer_bars_and_sweeps(small):
    graph, sim = small
    spec = charts.layer_bars(frames.layers(graph, sim)).to_dict()
    assert len(spec["vconcat"]) == 3
    assert {r.get("fate") for r in rows(spec)} >= {"kept", "offloaded"}
    assert len(charts.layer_bars(frames.layers(graph), measures=("saved_bytes", "time_s")).to_dict()["vconcat"]) == 1
    budgets = [int(graph.cuda_peak_bytes * f) for f in (0.7, 0.85, 1.0, 1.1)]
    sweep = frames.budget_sweep(ul.sweep(graph, budgets, ["keep-all", "vdnn-all", "vdnn++"], hardware=HW), graph)
    spec = charts.budget_sweep(sweep, budget_bytes=budgets[1]).to_dict()
    assert sum(mark_type(u) == "line" for u in layers_of(spec)) == 2  # the policies and the Pareto front
    assert charts.budget_sweep(sweep, y="kept_bytes").to_dict()
    bandwidth = frames.bandwidth(hardware=[ul.Hardware.load(HW)])
    spec = charts.bandwidth(bandwidth).to_dict()
    assert layers_of(spec)[0]["encoding"]["x"]["scale"]["type"] == "log"
    batch = pd.DataFrame({"batch": [8, 16, 32], "policy": "vdnn-all", "min_budget_bytes": [1 << 30, 2 << 30, 4 << 30]})
    assert [r["under"] for r in rows(charts.batch_sweep(batch, budget_bytes=3 << 30).to_dict())
            if "under" in r] == [True, True, False]
    table = frames.savings(frames.simulations({"a": ul.simulate(graph, hardware=HW), "b": sim}))
    published = pd.DataFrame({"model": ["resnet18"], "value": [0.9], "label": ["paper: -90%"]})
    assert charts.policy_savings(table, published=published).to_dict()["facet"]
    assert charts.step_times(table.assign(hardware=HW)).to_dict()


def test_charts_say_which_frame_they_need(small):
    graph, _ = small
    with pytest.raises(ValueError, match="frames.timeline"):
        charts.timeline(frames.memory_curve(graph))
    with pytest.raises(TypeError, match="DataFrame"):
        charts.memory_curve(graph)


def test_save_html_png_svg_offline(small, tmp_path):
    graph, sim = small
    chart = charts.memory_curve(frames.memory_curve(graph, sim), budget_bytes=sim.peak_bytes)
    page = charts.save(chart, tmp_path / "curve.html").read_text()
    assert "cdn.jsdelivr" not in page
    assert not re.search(r"<script[^>]+src=[\"']?(https?:)?//", page)
    assert "vega" in page.lower() and "<script" in page
    assert charts.save(chart, tmp_path / "curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "<svg" in charts.save(charts.timeline(frames.timeline(sim)), tmp_path / "streams.svg").read_text()
    with pytest.raises(ValueError, match=".png"):
        charts.save(chart, tmp_path / "curve.gif")
