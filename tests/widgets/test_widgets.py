"""MemoryLab driven as altair's JupyterChart tests drive it: set widget values, read the synced chart spec."""

import asyncio
import html
import json

import altair as alt
import pandas as pd
import pytest
import torch
from torch import nn

import udnn_lab as ul
from udnn_lab.units import format_bytes
from udnn_lab.widgets.app import MemoryLab


def rows(chart: alt.JupyterChart) -> list[dict]:
    return [row for values in chart.spec["datasets"].values() for row in values]


def predicted_peak(lab: MemoryLab) -> int:
    return max(r["bytes"] for r in rows(lab.memory_and_streams) if r.get("category") == "total"
               and r.get("series") == "predicted")


def categories(lab: MemoryLab) -> set[str]:
    """The categories the memory chart stacks (besides the total)."""
    return {r["category"] for r in rows(lab.memory_and_streams) if r.get("series") == "predicted"} - {"total"}


def chart_title(lab: MemoryLab) -> str:
    """The memory chart's title (its first line: the subtitle under it is ``chart_subtitle``)."""
    title = lab.memory_and_streams.spec["title"]
    return title["text"] if isinstance(title, dict) else title


def chart_subtitle(lab: MemoryLab) -> list[str]:
    title = lab.memory_and_streams.spec["title"]
    subtitle = title.get("subtitle", []) if isinstance(title, dict) else []
    return [subtitle] if isinstance(subtitle, str) else subtitle


def rule_values(lab: MemoryLab) -> dict[str, float]:
    return {r["label"]: r["value"] for r in rows(lab.memory_and_streams) if "label" in r}


def peak_of(lab: MemoryLab) -> int:
    graph = lab.session.graph(lab.setting)
    return graph.cuda_peak_bytes if graph.device == "cuda" else graph.peak_bytes


def line_legend(lab: MemoryLab) -> list[str]:
    """The legend of the memory chart's total lines."""
    line = next(u for u in units(lab.memory_and_streams.spec) if u["encoding"].get("stroke", {}).get("field") == "line")
    return line["encoding"]["stroke"]["scale"]["domain"]


def units(spec: dict):
    """The single-mark views of a chart's spec, through its layers and concatenations."""
    for key in ("layer", "vconcat", "hconcat"):
        for child in spec.get(key, []):
            yield from units(child)
    if "mark" in spec:
        yield spec


@pytest.fixture(scope="module")
def cnn_lab():
    return MemoryLab("resnet11", batch=64, image_size=32, optimizer="none", policy="vdnn++", hardware="h100-sxm",
                     debounce_s=0)


@pytest.fixture
def lab():
    return MemoryLab("mlp5", batch=8, policy="vdnn-all", hardware="h100-sxm", debounce_s=0)


def test_opens_with_the_prediction_charted(lab):
    assert lab.status.value == ""
    assert lab.network.value == "mlp5" and "mlp5" in lab.network.options
    assert predicted_peak(lab) > 0
    assert rule_values(lab)["budget"] == pytest.approx(lab.budget.value, rel=1e-3)
    assert "minimum feasible" in rule_values(lab) and "vdnn-all" in lab.minimum_text.value
    assert {r["lane"] for r in rows(lab.memory_and_streams) if "lane" in r} >= {"compute"}
    assert "peak" in lab.summary.value
    assert lab.plan.policy == "vdnn-all" and lab.simulation.policy == "vdnn-all"  # what Train will run


def test_batch_size_updates_the_same_chart_widget(lab):
    chart, before = lab.memory_and_streams, predicted_peak(lab)
    lab.batch.value = 64
    assert lab.memory_and_streams is chart  # updated in place, not re-created
    assert predicted_peak(lab) > before
    assert lab.status.value == ""


def test_budget_slider_moves_the_rule_and_replans(lab):
    lab.policy.value = "pin-dp"
    top = lab.budget.value
    lab.budget.value = top * 0.98
    assert rule_values(lab)["budget"] == pytest.approx(top * 0.98, rel=1e-3)
    assert lab.budget_entry.value == format_bytes(lab.budget_bytes)


def test_the_budget_can_be_typed_and_reads_as_every_size_in_the_app(lab):
    lab.budget_entry.value = "3 MiB"
    assert lab.budget_bytes == 3 << 20 and abs(lab.budget.value - 3.0) <= lab.budget.step / 2  # on the grid
    assert rule_values(lab)["budget"] == pytest.approx(3.0)
    assert lab.budget_entry.value == "3.00 MiB" and f"of budget {format_bytes(3 << 20)}" in lab.summary.value
    texts = {r["text"] for r in rows(lab.memory_and_streams) if "text" in r}
    assert f"budget {format_bytes(3 << 20)}" in texts  # the chart writes sizes as the text does
    lab.budget.value = round(lab.budget.value / lab.budget.step) * lab.budget.step  # a browser's slider snaps
    assert lab.budget_bytes == 3 << 20
    lab.budget.value += lab.budget.step  # moved off it: the slider's own value
    assert lab.budget_bytes == int(round(lab.budget.value * 2**20))
    lab.budget_entry.value = "3 MiB"
    lab.budget_entry.value = "three megabytes"
    assert "ValueError" in lab.fit_status.value and "6 GiB" in lab.fit_status.value  # said under the box
    assert lab.budget_bytes == 3 << 20 and lab.budget_entry.value == "3.00 MiB"
    assert lab.budget_entry.description == "budget" and lab.budget.description == ""  # no label to cut


@pytest.mark.parametrize("policy", ["vdnn++", "vdnn-all", "recompute", "auto"])
def test_at_the_peak_as_shown_nothing_moves(policy):
    lab = MemoryLab("mlp5", batch=8, policy=policy, hardware="v100", debounce_s=0)
    peak = peak_of(lab)
    assert lab.budget_bytes == peak
    lab.budget.value = round(lab.budget.value / lab.budget.step) * lab.budget.step  # where a browser's slider snaps
    assert lab.budget_bytes == peak
    lab.budget_entry.value = format_bytes(peak)  # the peak as the app writes it, typed back
    assert lab.budget_bytes == peak
    assert (lab.plan.offloads, lab.plan.recomputes) == ((), ()) and lab.simulation.stall_time_s == 0
    assert "copied 0 B out" in lab.summary.value


def test_precision_optimizer_and_hardware_keep_the_users_budget(lab):
    peak = peak_of(lab)
    lab.budget.value = lab.budget.max * 0.6
    chosen = lab.budget_bytes
    lab.optimizer.value = "adam"  # a larger peak: the budget is in range and stays
    assert lab.budget_bytes == chosen and peak_of(lab) > peak
    lab.hardware.value = "a100-sxm-40gb" if "a100-sxm-40gb" in lab.hardware.options else "v100"
    assert lab.budget_bytes == chosen
    lab.optimizer.value = "none"
    lab.precision.value = "bf16-true"  # a much smaller peak: clamped to the slider's new top
    assert lab.budget_bytes == int(round(lab.budget.max * 2**20)) < chosen
    lab.budget.value = peak_of(lab) / 2**20  # a budget at the peak follows the peak
    lab.precision.value = "32-true"
    assert lab.budget_bytes == peak_of(lab)
    lab.budget.value = lab.budget.max * 0.5
    lab.network.value = "mlp3"  # another network starts at its own peak
    assert lab.budget_bytes == peak_of(lab)


def test_an_infeasible_budget_is_shown_in_the_app(lab):
    lab.budget.value = lab.budget.max * 0.05
    assert "cannot fit" in lab.fit_status.value and "#d62728" in lab.fit_status.value
    assert "white-space:normal" in lab.fit_status.value and lab.layout.grid_template_rows.endswith("auto")  # wraps
    title = chart_title(lab)
    assert title.endswith(f"vdnn-all cannot fit {format_bytes(lab.budget_bytes)} (shown: every tensor kept)")
    assert lab.budget.style.handle_color == "#d62728"
    assert "does not fit" in lab.summary.value
    lab.budget.value = lab.budget.max
    assert lab.status.value == "" and lab.budget.style.handle_color == "#2ca02c"
    assert "cannot fit" not in lab.fit_status.value and ">fits<" in lab.fit_status.value


def test_the_budget_can_count_what_the_caching_allocator_reserves(cnn_lab):
    lab = cnn_lab
    lab.budget_entry.value = "118 MiB"
    allocated = lab.simulation.peak_bytes
    assert "reserved" not in lab.fit_status.value and allocated <= 118 << 20
    lab.counts.value = "reserved"
    reserved = lab.session.reserved_peak(lab.setting, lab.plan, lab.simulation)
    assert f"reserved peak <b>{format_bytes(reserved)}</b>" in lab.fit_status.value
    assert ">fits<" in lab.fit_status.value and reserved <= lab.budget_bytes
    assert lab.simulation.peak_bytes < allocated  # fewer allocated bytes leave room for what the allocator keeps
    lab.budget_entry.value = "100 MiB"  # vdnn++'s least reserves more than that
    assert "counted as reserved bytes" in lab.fit_status.value and "does not fit" in lab.fit_status.value
    lab.hardware.value = "cpu-amd-epyc-2cpu"
    assert "needs a CUDA step" in lab.status.value  # said in the app, in one line
    lab.counts.value = "allocated"
    assert lab.status.value == ""


def test_a_bad_network_name_is_an_error_in_the_app_and_the_chart_stays(lab):
    spec = lab.memory_and_streams.spec
    lab.network.value = "resnet_nope"
    assert "UnknownModelError" in lab.status.value and "the zoo knows" in lab.status.value
    assert lab.memory_and_streams.spec == spec
    lab.network.value = "mlp5"
    assert lab.status.value == ""


def test_policy_and_hardware_change_the_plan(lab):
    lab.policy.value = "keep-all"
    assert "keep-all" in lab.minimum_text.value
    lab.hardware.value = "cpu-amd-epyc-2cpu"
    assert lab.status.value == "" and lab.setting.device == "cpu"
    assert lab.device_note.value == ""
    lab.policy.value = "auto"
    assert chart_title(lab).endswith(f"auto (chose {lab.plan.chosen_policy})") \
        or chart_title(lab).endswith(": auto")


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has the profile's device")
def test_the_app_says_when_the_prediction_is_for_a_device_this_machine_lacks(lab):
    assert lab.setting.device == "cuda" and "no CUDA device" in lab.device_note.value
    assert "run on its CPU" in lab.device_note.value


def test_measure_overlays_a_real_step(lab):
    lab.measure_button.click()
    assert "measured on" in lab.status.value
    measured = [r for r in rows(lab.memory_and_streams) if r.get("series") == "measured"]
    assert measured and max(r["bytes"] for r in measured) > 0
    lab.batch.value = 4  # another step: the old measurement no longer applies
    assert not [r for r in rows(lab.memory_and_streams) if r.get("series") == "measured"]


def test_measure_compares_like_with_like_and_names_both_lines():
    lab = MemoryLab("resnet11", batch=16, image_size=32, optimizer="none", policy="vdnn-all", hardware="h100-sxm",
                    debounce_s=0)
    here = lab.session.local_device(lab.setting)
    local = ul.trace(lab.session.workload(lab.setting, here))
    floor = ul.min_budget(local, "vdnn-all", hardware=lab.session.local_hardware(here, "h100-sxm"))
    lab.budget_entry.value = str((floor + lab.budget_bytes) // 2)  # under the peak, within reach of the plan here
    lab.measure()
    status = html.unescape(lab.status.value)
    assert "measured on" in status and f"made for this machine's {here}" in status
    assert line_legend(lab) == [f"predicted ({here}, vdnn-all)", f"measured ({here}, vdnn-all)"]
    totals = [r for r in rows(lab.memory_and_streams) if r.get("category") == "total"]
    predicted_ops = sorted(r["index"] for r in totals if r["series"] == "predicted")
    assert predicted_ops == sorted(r["index"] for r in totals if r["series"] == "measured")  # one op axis
    assert predicted_ops[-1] + 1 == len(lab._measured.graph.ops) == len(lab._measured.measurement.ops)
    assert lab._measured.prediction.d2h_bytes > 0  # the plan was applied there, not every tensor kept
    assert stream_rows(lab) == timeline_rows(lab._measured.prediction)  # its streams under its curve
    assert f"on this machine's {here}" in chart_title(lab)
    lab.budget.value = lab.budget.max  # another budget: measured under another plan, so it goes
    assert line_legend(lab) == [f"predicted ({lab.setting.device}, vdnn-all)"]


def test_measure_says_when_the_plan_cannot_be_applied_here(lab):
    lab.budget.value = lab.budget.max * 0.05
    lab.measure()
    status = html.unescape(lab.status.value)
    assert "cannot be applied on this machine's" in status and "every tensor kept" in status
    assert [line.split(" (")[0] for line in line_legend(lab)] == ["predicted", "measured"]
    assert all(line.endswith(", keep-all)") for line in line_legend(lab))


def test_your_own_module():
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10))
    lab = MemoryLab(model, input_shape=(32,), batch=4, policy="keep-all", debounce_s=0)
    assert lab.network.value == "Sequential (yours)" and lab.status.value == ""
    assert predicted_peak(lab) > 0
    assert lab.precision.value == "32-true"  # your module's own
    lab.precision.value = "16-true"  # never converted by the app: the error says how to
    assert "model.to(torch.float16)" in lab.status.value
    lab.precision.value = "bf16-mixed"  # autocast over its float32 weights
    assert lab.status.value == "" and "weight_cast" in categories(lab)


def test_measured_stream_events_join_the_timeline(lab):
    events = pd.DataFrame({"stream": ["compute", "d2h"], "kind": ["op", "offload"], "start_s": [0.0, 0.0],
                           "end_s": [1e-4, 2e-4]})
    lab.show_timeline(events)
    assert {r["source"] for r in rows(lab.memory_and_streams) if "source" in r} == {"simulated", "measured"}
    lab.show_timeline(events.drop(columns=["end_s"]))
    assert "end_s" in lab.status.value
    lab.show_timeline(None)
    assert {r["source"] for r in rows(lab.memory_and_streams) if "source" in r} == {"simulated"}


def test_measure_train_and_stop_buttons_are_in_the_app(lab):
    buttons = lab.actions.children[0].children
    assert lab.measure_button in buttons
    assert lab.training.train_button in buttons and lab.training.stop_button in buttons
    assert lab.training.chart in lab.center.children


def test_changes_are_debounced_in_a_running_event_loop():
    async def drive():
        lab = MemoryLab("mlp5", batch=8, policy="keep-all", debounce_s=0.05)
        before = predicted_peak(lab)
        lab.batch.value = 16
        lab.batch.value = 32
        assert predicted_peak(lab) == before  # not yet: waiting for the values to settle
        await asyncio.sleep(0.3)
        return before, predicted_peak(lab), lab
    before, after, lab = asyncio.run(drive())
    assert after > before
    assert list(lab.session._graphs)[-1].batch == 32 and len(lab.session._graphs) == 2  # 16 was never traced


def test_train_runs_in_the_background_and_charts_each_step():
    lab = MemoryLab("mlp3", batch=8, policy="vdnn-all", hardware="cpu-amd-epyc-2cpu", debounce_s=0)
    lab.train(steps=3, wait=True)
    run = lab.training.run
    assert run is not None and len(run.steps) == 3 and run.policy == "vdnn-all"
    assert lab.training.progress.value == 3 and not lab.training.running
    assert {r["measure"] for r in rows(lab.training.chart) if "measure" in r} >= {"peak_bytes", "time_s", "loss"}
    assert not lab.training.train_button.disabled and lab.training.stop_button.disabled
    assert "trained 3 steps" in lab.status.value


def test_train_plans_in_the_bytes_the_budget_counts_and_says_so_where_a_cpu_has_no_reserve(monkeypatch):
    from udnn_lab.widgets import _training

    asked = []
    real_plan = _training.plan
    monkeypatch.setattr(_training, "plan", lambda *args, **kwargs: asked.append(kwargs["counts"]) or real_plan(
        *args, **kwargs))
    lab = MemoryLab("mlp3", batch=8, policy="vdnn-all", hardware="cpu-amd-epyc-2cpu", debounce_s=0)
    lab.train(steps=1, wait=True)
    assert asked == ["allocated"] and "counted allocated" not in lab.status.value
    lab.counts.value = "reserved"  # a CUDA profile's count: this step runs on the CPU
    lab.train(steps=1, wait=True)
    assert asked[-1] == "allocated" and "trained 1 steps" in lab.status.value
    assert "the budget counted allocated bytes: the step runs on cpu" in lab.status.value


def test_another_network_clears_the_training_view():
    lab = MemoryLab("mlp3", batch=8, policy="keep-all", hardware="cpu-amd-epyc-2cpu", debounce_s=0)
    lab.train(steps=2, wait=True)
    assert lab.training.chart.spec is not None and lab.training.progress.value == 2
    lab.batch.value = 16  # the same network: the run stays on screen
    assert lab.training.chart.spec is not None
    lab.network.value = "mlp5"
    assert lab.training.chart.spec is None and lab.training.progress.value == 0 and lab.training.rows == []
    assert lab.training.progress.description == ""


def test_stop_pressed_during_a_step_ends_the_run_after_that_step():
    lab = MemoryLab("mlp3", batch=8, policy="keep-all", hardware="cpu-amd-epyc-2cpu", debounce_s=0)
    work = lab.session.trainable(lab.setting)
    seen = []

    def press_stop_during_step_6(module, inputs):
        if len(lab.training.rows) == 5 and not seen:  # five steps done: the sixth is running
            seen.append(lab.status.value)
            lab.training.stop_button.click()
    hook = work.model.register_forward_pre_hook(press_stop_during_step_6)
    try:
        lab.train(steps=50, wait=True)
    finally:
        hook.remove()
    assert "step 5/50 done" in seen[0] and "step 6 running" in seen[0]  # what the user read when pressing Stop
    assert len(lab.training.run.steps) == 6 and lab.training.progress.value == 6
    assert "stopped after step 6 as asked" in lab.status.value


def test_stop_ends_training_and_the_model_trains_on():
    lab = MemoryLab("mlp3", batch=8, policy="keep-all", hardware="cpu-amd-epyc-2cpu", debounce_s=0)
    lab.training._stop.set()  # pressed before the first step ends
    original = lab.training.stop
    lab.training.stop = lambda: None  # keep the pre-pressed state through start()
    thread = lab.training.start(lab.session.trainable(lab.setting), "keep-all", None, 500, None)
    lab.training.stop = original
    lab.training.stop()
    thread.join(timeout=60)
    assert lab.training.run.stopped == "stop requested" and len(lab.training.run.steps) < 500
    work = lab.session.trainable(lab.setting)
    work.loss_fn(work.model(work.example_input), work.target).backward()  # a plain, usable model
    assert torch._C._len_torch_dispatch_stack() == 0


def test_train_errors_are_shown_not_raised():
    lab = MemoryLab("mlp3", batch=8, policy="auto", hardware="cpu-amd-epyc-2cpu", debounce_s=0)
    lab.budget.value = 0.001  # far below anything that fits
    lab.train(steps=2, wait=True)
    assert "PlanInfeasible" in lab.status.value and lab.training.run is None


def click_on_op(chart: alt.JupyterChart, op: int) -> None:
    """What the chart's JavaScript syncs when a click picks the op ``op`` on the memory curve."""
    chart._vl_selections = {ul.charts.OP_SELECTION: {"value": {"vlPoint": {"or": [{"index": op}]}},
                                                     "store": [{"unit": "view", "fields": [], "values": [op]}]}}


def picked_in_chart(lab: MemoryLab) -> list:
    params = {p["name"]: p for p in lab.memory_and_streams.spec.get("params", [])}
    return params[ul.charts.OP_SELECTION].get("value")


def test_the_live_tensors_at_the_peak_are_listed_until_an_op_is_picked(lab):
    sim, graph = lab.simulation, lab.session.graph(lab.setting)
    peak = int(sim.curve["live_bytes"].to_numpy().argmax())  # mlp5 on h100-sxm: a CUDA step
    peak = int(sim.curve["cuda_live_bytes"].to_numpy().argmax()) if graph.device == "cuda" else peak
    assert lab.drill.op.value == peak and not lab.drill.picked
    assert f"live at op {peak}" in lab.drill.table.value
    on = lab.drill.frame[lab.drill.frame["on_device"]]
    assert on["nbytes"].sum() == sim.curve["live_bytes"].iloc[peak]
    assert picked_in_chart(lab) == [{"index": peak}]


def test_a_click_on_the_memory_curve_lists_the_tensors_live_at_that_op(lab):
    graph, sim = lab.session.graph(lab.setting), lab.simulation
    click_on_op(lab.memory_and_streams, 3)
    assert lab.drill.op.value == 3 and lab.drill.picked
    expected = ul.frames.live_tensors(graph, 3, sim)
    pd.testing.assert_frame_equal(lab.drill.frame, expected)
    table = lab.drill.table.value
    assert f"live at op 3</b> ({html.escape(graph.ops[3].name)}" in table
    assert table.count("class='udnn-live-tensor'") == min(len(expected), 20)
    assert html.escape(expected["tensor"].iloc[0]) in table and format_bytes(int(expected["nbytes"].iloc[0])) in table
    lab.budget.value = lab.budget.value * 0.9  # another plan: the same op, under it, marked on the new chart
    assert lab.drill.op.value == 3 and lab.drill.frame.attrs["policy"] == lab.simulation.policy
    assert picked_in_chart(lab) == [{"index": 3}]
    lab.drill.op.value = 5  # the box picks an op too
    assert "live at op 5</b>" in lab.drill.table.value


def stream_rows(lab: MemoryLab) -> list[tuple]:
    """The bars under the memory curve: (lane, kind, first op, last op) of each, in order."""
    spec = lab.memory_and_streams.spec
    bars = next(u for u in units(spec) if u["mark"]["type"] == "bar")
    return sorted((r["lane"], r["kind"], r["op"], r["last_op"]) for r in spec["datasets"][bars["data"]["name"]])


def timeline_rows(simulation) -> list[tuple]:
    frame = ul.frames.timeline(simulation)
    return sorted(zip(frame["lane"], frame["kind"], frame["op"], frame["last_op"]))


def test_the_memory_curve_and_the_streams_select_in_each_other():
    """One chart: a range of ops dragged on the curve fades the bars outside it, a span of time dragged on the
    streams marks the ops that start in it; the bars are the streams of the plan the curve shows."""
    lab = MemoryLab("resnet11", batch=16, image_size=32, optimizer="none", policy="vdnn-all", hardware="h100-sxm",
                    debounce_s=0)
    spec = lab.memory_and_streams.spec
    params = {p["name"]: p for p in spec["params"]}
    memory, streams = spec["vconcat"]
    on_memory, on_streams = {u.get("name") for u in units(memory)}, {u.get("name") for u in units(streams)}
    assert set(params[ul.charts.OP_RANGE]["views"]) <= on_memory
    assert set(params[ul.charts.TIME_RANGE]["views"]) <= on_streams
    bars = next(u for u in units(streams) if u["mark"]["type"] == "bar")
    assert f"{ul.charts.OP_RANGE}.index" in bars["encoding"]["opacity"]["condition"]["test"]
    assert [u for u in units(memory) if f"{ul.charts.TIME_RANGE}.start_ms" in json.dumps(u.get("transform", []))]
    assert stream_rows(lab) == timeline_rows(lab.simulation)
    lab.budget_entry.value = str((lab._minimum + peak_of(lab)) // 2)  # a plan that moves tensors: its own streams
    assert stream_rows(lab) == timeline_rows(lab.simulation) and lab.simulation.d2h_bytes > 0


def test_a_range_dragged_on_the_curve_leaves_the_drill_down_as_it_was(lab):
    click_on_op(lab.memory_and_streams, 3)
    lab.memory_and_streams._vl_selections = {
        **lab.memory_and_streams._vl_selections,
        ul.charts.OP_RANGE: {"value": {"index": [2, 9]},
                             "store": [{"unit": "concat_0_layer_2", "fields": [{"field": "index", "channel": "x",
                                                                                 "type": "R"}], "values": [[2, 9]]}]}}
    assert getattr(lab.memory_and_streams.selections, ul.charts.OP_RANGE).value == {"index": [2, 9]}
    assert lab.drill.op.value == 3 and "live at op 3</b>" in lab.drill.table.value
    click_on_op(lab.memory_and_streams, 5)
    assert lab.drill.op.value == 5


def test_the_drill_down_says_why_the_plan_does_what_it_does_with_each_tensor():
    lab = MemoryLab("resnet20", batch=32, policy="vdnn-all", hardware="h100-sxm", debounce_s=0)
    lab.budget_entry.value = str((lab._minimum + peak_of(lab)) // 2)  # below the peak: vdnn-all offloads
    assert lab.plan.offloads
    expected = ul.frames.plan_reasons(lab.session.graph(lab.setting), lab.plan, lab.simulation)
    assert lab.drill.reasons == dict(zip(expected["id"], expected["reason"]))
    table = lab.drill.table.value
    assert "why (the plan)" in table and "class='udnn-why'" in table
    shown = lab.drill.frame.head(20)
    offloaded = shown[shown["id"].isin([o.tensor for o in lab.plan.offloads])]
    assert len(offloaded) and all(html.escape(lab.drill.reasons[i]) in table for i in offloaded["id"])
    lab.policy.value = "keep-all"  # nothing moved: nothing to explain
    assert lab.drill.reasons == {} and "why (the plan)" not in lab.drill.table.value
