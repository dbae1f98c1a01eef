import re

import altair as alt
import pandas as pd
import pytest
import vl_convert

import udnn_lab as ul
from udnn_lab import charts, frames
from udnn_lab.charts.base import CATEGORY_COLORS
from udnn_lab.vocabulary import CATEGORIES
from udnn_lab.widgets._offline_chart import OfflineChart, offline_javascript

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
    assert line["encoding"]["stroke"]["field"] == "line"  # e.g. "predicted (cuda, vdnn-all)"
    assert line["encoding"]["stroke"]["scale"]["domain"] == ["predicted (cuda, vdnn-all)"]
    assert any(mark_type(u) == "rect" for u in units)  # forward | backward | optimizer bands
    rule = next(u for u in units if mark_type(u) == "rule")
    budgets = {r["label"]: r["value"] for r in rows(spec) if "label" in r}
    assert budgets == {"budget": 40.0, "minimum feasible": 30.0} and rule["encoding"]["y"]["field"] == "value"


def test_memory_curve_labels_stay_off_the_data(small):
    graph, sim = small
    frame = frames.memory_curve(graph, sim)
    budget, minimum = sim.peak_bytes, int(sim.peak_bytes * 0.9)
    spec = charts.memory_curve(frame, budget_bytes=budget, min_budget_bytes=minimum, height=260).to_dict()
    units = layers_of(spec)
    texts = {r["text"] for r in rows(spec) if "text" in r}
    assert {f"budget {ul.format_bytes(budget)}", f"minimum feasible {ul.format_bytes(minimum)}"} <= texts
    rule_labels = [u for u in units if mark_type(u) == "text" and u["encoding"].get("text", {}).get("field") == "text"]
    assert len(rule_labels) == 2
    for unit in rule_labels:  # right of the plot, clear of every op's bytes
        assert unit["mark"]["x"] == "width" and unit["mark"]["dx"] > 0 and unit["mark"]["align"] == "left"
    assert {u["mark"]["baseline"] for u in rule_labels} == {"bottom", "top"}  # close rules: one above, one below
    legends = [u["encoding"][c]["legend"] for u in units for c in ("color", "stroke")
               if c in u["encoding"] and u["encoding"][c].get("legend")]
    longest = max(len(t) for t in texts)
    assert legends and all(legend["offset"] >= longest * 6 for legend in legends)  # legends clear of the labels
    phase = next(u for u in units if mark_type(u) == "text" and u["encoding"]["text"]["field"] == "phase")
    assert phase["encoding"]["y"] == {"value": 0} and phase["mark"]["baseline"] == "top"
    area = next(u for u in units if mark_type(u) == "area")
    top = area["encoding"]["y"]["scale"]["domain"][1]
    highest = max(r["value"] for r in rows(spec) if "value" in r and "category" in r)
    assert highest <= top * (260 - 24) / 260  # the strip the phases are named in stays free of data


def test_sizes_on_charts_read_as_format_bytes_writes_them():
    from udnn_lab.charts.base import byte_unit

    for nbytes in (3 << 10, 1_711_276_032, 5 << 30, 700 << 20):
        assert ul.format_bytes(nbytes).endswith(byte_unit(nbytes)[0])


def test_training_charts_the_loss(small):
    steps = pd.DataFrame({"step": [0, 1, 2], "loss": [2.0, 1.5, 1.2], "time_s": [0.01] * 3,
                          "peak_bytes": [3 << 20] * 3})
    spec = charts.training(frames.training(steps), budget_bytes=4 << 20, predicted_peak_bytes=3 << 20).to_dict()
    titles = [u["encoding"]["y"].get("title") for u in layers_of(spec) if "y" in u["encoding"]]
    assert "loss" in titles
    assert {r["value"] for r in rows(spec) if r.get("measure") == "loss"} == {2.0, 1.5, 1.2}


def test_step_times_name_the_stalled_part_in_a_legend(small):
    graph, sim = small
    table = frames.simulations({"keep-all": ul.simulate(graph, hardware=HW), "vdnn-all": sim})
    units = layers_of(charts.step_times(table.assign(hardware=HW)).to_dict())
    stalls = next(u for u in units if u["encoding"].get("x", {}).get("field") == "stall_ms")
    color = stalls["encoding"]["color"]
    assert color["field"] == "part" and color.get("legend", {}) is not None  # a legend of null would hide it
    assert "stalled" in color["scale"]["domain"][0]


def test_published_values_are_named_in_a_legend_not_on_the_bars(small):
    graph, sim = small
    table = frames.savings(frames.simulations({"a": ul.simulate(graph, hardware=HW), "b": sim}))
    published = pd.DataFrame({"model": ["resnet18"], "value": [0.9], "label": ["paper: -90%"]})
    units = layers_of(charts.policy_savings(table, published=published).to_dict())
    assert not any(mark_type(u) == "text" for u in units)
    rule = next(u for u in units if mark_type(u) == "rule")
    assert rule["encoding"]["strokeDash"]["field"] == "label"
    assert rule["encoding"]["strokeDash"]["scale"]["domain"] == ["paper: -90%"]


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


def _params(spec: dict) -> dict[str, dict]:
    return {param["name"]: param for param in spec.get("params", [])}


def _layers(spec: dict) -> list[dict]:
    """Every unit spec under ``spec``, depth first."""
    found = []
    for key in ("layer", "vconcat", "hconcat"):
        for child in spec.get(key, []):
            found += _layers(child) if any(k in child for k in ("layer", "vconcat", "hconcat")) else [child]
    return found


def test_memory_curve_can_pick_an_op_and_marks_it(small):
    graph, sim = small
    frame = frames.memory_curve(graph, sim)
    assert charts.OP_SELECTION not in _params(charts.memory_curve(frame).to_dict())
    spec = charts.memory_curve(frame, select_op=True).to_dict()
    picked = _params(spec)[charts.OP_SELECTION]
    assert picked["select"] == {"type": "point", "fields": ["index"], "nearest": True, "on": "click"}
    picker = next(layer for layer in _layers(spec) if layer.get("name") in picked["views"])
    assert picker["mark"]["type"] == "point"  # vega-lite's nearest works on point marks only
    assert _params(charts.memory_curve(frame, select_op=True, picked_op=7).to_dict())[charts.OP_SELECTION][
        "value"] == [{"index": 7}]
    marked = [layer for layer in _layers(spec)
              if layer.get("transform", [{}])[0].get("filter") == {"param": charts.OP_SELECTION, "empty": False}]
    assert len(marked) == 1 and marked[0]["mark"]["type"] == "rule" and marked[0]["encoding"]["x"]["field"] == "index"


def test_linked_memory_and_streams_selects_across_the_op_and_time_axes(small):
    graph, sim = small
    spec = charts.linked_memory_and_streams(frames.memory_curve(graph, sim), frames.timeline(sim),
                                            budget_bytes=sim.peak_bytes).to_dict()
    params = _params(spec)
    assert params[charts.OP_RANGE]["select"] == {"type": "interval", "encodings": ["x"]}
    assert params[charts.TIME_RANGE]["select"] == {"type": "interval", "encodings": ["x"]}
    assert charts.OP_SELECTION in params
    memory, streams = spec["vconcat"]
    assert params[charts.OP_RANGE]["views"] == params[charts.OP_SELECTION]["views"]
    assert params[charts.TIME_RANGE]["views"] != params[charts.OP_RANGE]["views"]
    bars = next(layer for layer in streams["layer"] if layer["mark"]["type"] == "bar")
    faded = bars["encoding"]["opacity"]["condition"]["test"]
    assert f"{charts.OP_RANGE}.index" in faded and "datum.op" in faded and "datum.last_op" in faded
    assert bars["name"] in params[charts.TIME_RANGE]["views"]
    marked = [layer for layer in memory["layer"] if "transform" in layer
              and f"{charts.TIME_RANGE}.start_ms" in str(layer["transform"][0].get("filter"))]
    assert len(marked) == 1 and marked[0]["encoding"]["x"]["field"] == "index"
    assert all(len(params[name]["views"]) == 1 for name in (charts.OP_RANGE, charts.TIME_RANGE))
    vl_convert.vegalite_to_svg(spec)  # vega compiles it: one definition of each selection's signals
    with pytest.raises(ValueError, match="frames.timeline"):
        charts.linked_memory_and_streams(frames.memory_curve(graph, sim), frames.memory_curve(graph, sim))


def test_every_memory_category_has_a_colour_of_its_own():
    assert list(CATEGORY_COLORS) == list(CATEGORIES)  # communication included, in the stacking order
    assert len(set(CATEGORY_COLORS.values())) == len(CATEGORIES)


def test_predicted_and_measured_lines_that_coincide_both_show():
    """A measured line equal to the predicted one is drawn wide and pale under it: both stay visible."""
    same = [{"index": i, "phase": "forward", "module": "m", "op": "aten.mm", "bytes": b} for i, b in
            enumerate([1 << 20, 3 << 20, 2 << 20])]
    frame = pd.DataFrame([{**row, "series": series} for series in ("predicted", "measured") for row in same])
    spec = charts.predicted_vs_measured(frame).to_dict()
    lines = spec["layer"]
    assert [{r["series"] for r in spec["datasets"][u["data"]["name"]]} for u in lines] == [{"measured"}, {"predicted"}]
    encoding = lines[0]["encoding"]
    widths = dict(zip(encoding["strokeWidth"]["scale"]["domain"], encoding["strokeWidth"]["scale"]["range"]))
    opacity = dict(zip(encoding["strokeOpacity"]["scale"]["domain"], encoding["strokeOpacity"]["scale"]["range"]))
    assert widths["measured"] >= 3 * widths["predicted"] and opacity["measured"] < opacity["predicted"] == 1
    assert lines[0]["encoding"]["stroke"]["scale"] == lines[1]["encoding"]["stroke"]["scale"]  # one legend


def test_a_linked_chart_takes_a_subtitle_and_an_offline_widget_leaves_altair_as_it_was(small):
    graph, sim = small
    chart = charts.linked_memory_and_streams(frames.memory_curve(graph, sim), frames.timeline(sim), title="step",
                                             subtitle=["predicted for CUDA", "why it changed"])
    assert chart.to_dict()["title"] == {"text": "step", "subtitle": ["predicted for CUDA", "why it changed"],
                                        "anchor": "start"}
    offline = alt.JupyterChart._is_offline
    widget = OfflineChart(chart)
    assert alt.JupyterChart._is_offline == offline and widget._esm == offline_javascript()
    assert "https://" not in widget._esm[:2000]  # bundled, not imported from a CDN
