"""What MemoryLab says and where: the line under the budget, the chart's title and subtitle after Measure, both
lines where they coincide, the live-tensor table's long names, the profile it used, and altair left as it was."""

import html
import re
import warnings

import altair as alt
import pytest

from tests.widgets.test_widgets import chart_subtitle, chart_title, rows, rule_values, units
from udnn_lab.charts.base import byte_unit
from udnn_lab.hardware import PREDICTED_DEVICE
from udnn_lab.simulation.simulator import resolve_hardware
from udnn_lab.units import format_bytes
from udnn_lab.widgets._drill import ROWS_SHOWN
from udnn_lab.widgets._offline_chart import offline_javascript
from udnn_lab.widgets._texts import sentences
from udnn_lab.widgets.app import MemoryLab


@pytest.fixture
def lab():
    return MemoryLab("mlp5", batch=8, policy="vdnn-all", hardware="h100-sxm", debounce_s=0)


def text_of(widget) -> str:
    """What a user reads in an HTML widget: its text without tags, entities decoded."""
    return html.unescape(re.sub(r"<[^>]+>", "", widget.value))


def test_the_fit_line_sits_right_under_the_budget_and_says_whether_the_plan_fits(lab):
    sidebar = list(lab.left_sidebar.children)
    assert sidebar.index(lab.budget_entry) + 1 == sidebar.index(lab.budget)
    assert sidebar.index(lab.budget) + 1 == sidebar.index(lab.fit_status)  # directly under the slider
    assert lab.fit_status not in lab.footer.children
    assert text_of(lab.fit_status) == f"fits: peak {format_bytes(lab.simulation.peak_bytes)} within the budget"
    lab.budget.value = lab.budget.max * 0.05
    said = text_of(lab.fit_status)
    assert said.startswith("does not fit · PlanInfeasible: policy 'vdnn-all' cannot fit mlp5 into")
    assert "#d62728" in lab.fit_status.value and lab.status.value == ""  # said once, under the budget
    lab.budget_entry.value = "lots"
    assert text_of(lab.fit_status).startswith("ValueError:")  # a budget the box cannot read: said there too


def test_the_infeasible_message_is_whole_sentences(lab):
    lab.budget.value = lab.budget.max * 0.05
    said = text_of(lab.fit_status)
    assert "lowers only the rest. The chart shows every tensor kept." in said, said  # its floor is its weights
    assert not re.search(r"[a-z] The chart", said)  # no two sentences run together
    assert sentences("one", "two.", "", "  three?  ") == "one. two. three?"


def test_the_chart_names_the_device_and_profile_of_its_prediction(lab):
    assert chart_title(lab) == "mlp5, batch 8: vdnn-all"
    assert chart_subtitle(lab) == [f"predicted for CUDA with the profile h100-sxm (NVIDIA H100 SXM5 80 GB), "
                                   f"{len(lab.session.graph(lab.setting).ops)} ops"]


def test_measure_says_what_the_chart_switched_to_and_keeps_the_minimum_rule(lab):
    before = len(lab.session.graph(lab.setting).ops)
    assert "minimum feasible" in rule_values(lab)
    lab.measure()
    measured = lab._measured
    here, ops = measured.graph.device, len(measured.graph.ops)
    assert f"on this machine's {here}" in chart_title(lab)
    shown, *why = chart_subtitle(lab)
    assert shown == (f"predicted for this machine's {here.upper()} (profile {measured.hardware_name}) "
                     f"beside the step measured there, {ops} ops")
    if here != "cuda":  # the chart changed device: one line says from what, and how to go back
        assert why == [f"Measure ran it on this machine's {here.upper()}, replacing the h100-sxm (CUDA) prediction "
                       f"of {before} ops; change a setting to go back"]
    assert measured.min_budget_bytes is not None
    unit, scale = byte_unit(max(r["bytes"] for r in rows(lab.memory_and_streams) if "bytes" in r))
    assert rule_values(lab)["minimum feasible"] == pytest.approx(measured.min_budget_bytes / scale)
    assert f"{format_bytes(measured.min_budget_bytes)} on this machine's {here.upper()}" in text_of(lab.minimum_text)
    lab.batch.value = 4  # another step: back to the profile's prediction, its own minimum
    assert len(chart_subtitle(lab)) == 1 and chart_subtitle(lab)[0].startswith("predicted for CUDA")
    assert "this machine" not in text_of(lab.minimum_text)


def test_a_measured_line_that_coincides_with_the_predicted_one_still_shows(lab):
    lab.measure()
    lines = [u for u in units(lab.memory_and_streams.spec) if u["encoding"].get("stroke", {}).get("field") == "line"]
    datasets = lab.memory_and_streams.spec["datasets"]
    series = [{r["series"] for r in datasets[u["data"]["name"]]} for u in lines]
    assert series == [{"measured"}, {"predicted"}]  # measured drawn first: under the predicted line
    width = lines[0]["encoding"]["strokeWidth"]["scale"]
    widths = dict(zip(width["domain"], width["range"]))
    opacity = lines[0]["encoding"]["strokeOpacity"]["scale"]
    opacities = dict(zip(opacity["domain"], opacity["range"]))
    measured, predicted = (next(n for n in widths if n.startswith(s)) for s in ("measured", "predicted"))
    assert widths[measured] >= 3 * widths[predicted] and opacities[measured] < 1 == opacities[predicted]


def test_the_live_tensor_table_shows_long_module_names_whole_with_a_tooltip():
    lab = MemoryLab("resnet18", batch=2, image_size=32, policy="keep-all", hardware="h100-sxm", debounce_s=0)
    shown = lab.drill.frame.head(ROWS_SHOWN)
    longest = max((m for m in shown["module"] if m), key=len)
    cell = re.search(rf"<td class='udnn-wraps' title='{re.escape(html.escape(longest))}' style='([^']*)'>"
                     rf"([^<]*(<wbr>[^<]*)*)</td>", lab.drill.table.value)
    assert cell, f"no wrapping cell for the module {longest!r}"
    assert "white-space:normal" in cell.group(1) and "nowrap" not in cell.group(1)
    assert cell.group(2).replace("<wbr>", "") == html.escape(longest) and "<wbr>" in cell.group(2)  # at its dots
    assert lab.center.layout.min_width == "0"  # the centre is as wide as the app, and the table wraps in it


def test_with_no_hardware_named_the_app_uses_the_profile_for_this_machine_and_names_it():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the closest shipped profile is named with a warning where there is no GPU
        expected = resolve_hardware(None, PREDICTED_DEVICE)
        lab = MemoryLab("mlp5", batch=8, policy="keep-all", debounce_s=0)
    assert lab.hardware.value == expected.name and lab.setting.device == expected.device_type
    assert f"profile {expected.name} ({expected.title}" in text_of(lab.summary)
    assert "with the profile " + expected.name in chart_subtitle(lab)[0]


def test_creating_an_app_leaves_altairs_renderer_and_chart_class_as_they_were():
    active, options, offline = alt.renderers.active, dict(alt.renderers.options), alt.JupyterChart._is_offline
    alt.renderers.enable("default")  # as a fresh process has them, whatever ran before in this one
    alt.JupyterChart.enable_offline(False)
    try:
        lab = MemoryLab("mlp3", batch=4, policy="keep-all", hardware="h100-sxm", debounce_s=0)
        assert (alt.renderers.active, alt.renderers.options) == ("default", {})
        assert not alt.JupyterChart._is_offline
        assert lab.memory_and_streams._esm == lab.training.chart._esm == offline_javascript()  # its own: no CDN
    finally:
        alt.renderers.enable(active, **options)
        alt.JupyterChart.enable_offline(offline)


def test_on_a_cuda_step_the_fit_line_says_the_peak_as_max_memory_allocated_counts_it(lab):
    """NOTE [whole blocks]: a plan is held to its budget with the caching allocator's whole blocks counted, so the
    line says that figure, and the live tensors' beside it, where the two differ."""
    from udnn_lab.widgets._texts import fit_line

    simulation = lab.simulation
    counted = lab.session.counted_peak(lab.setting, lab.plan, simulation)
    assert counted is not None and counted >= simulation.peak_bytes  # a CUDA step: the allocator's count
    whole = simulation.peak_bytes + (1 << 20)  # one block handed out whole beyond its request
    said = text_of(type(lab.fit_status)(value=fit_line(simulation, budget_bytes=whole, counted_bytes=whole)))
    assert said == (f"fits: peak {format_bytes(whole)} as torch.cuda.max_memory_allocated counts it (live tensors "
                    f"{format_bytes(simulation.peak_bytes)}, the rest the caching allocator's whole blocks) within the "
                    "budget")
    said = text_of(type(lab.fit_status)(value=fit_line(simulation, budget_bytes=whole - 1, counted_bytes=whole)))
    assert said.startswith("does not fit: peak") and said.endswith("over the budget")
