"""MemoryLab driven as altair's JupyterChart tests drive it: set widget values, read the synced chart spec."""

import asyncio

import altair as alt
import pandas as pd
import pytest
import torch
from torch import nn

from udnn_lab.widgets.app import MemoryLab


def rows(chart: alt.JupyterChart) -> list[dict]:
    return [row for values in chart.spec["datasets"].values() for row in values]


def predicted_peak(lab: MemoryLab) -> int:
    return max(r["bytes"] for r in rows(lab.memory_chart) if r.get("category") == "total"
               and r.get("series") == "predicted")


def rule_values(lab: MemoryLab) -> dict[str, float]:
    return {r["label"]: r["value"] for r in rows(lab.memory_chart) if "label" in r}


@pytest.fixture
def lab():
    return MemoryLab("mlp5", batch=8, policy="vdnn-all", hardware="h100-sxm", debounce_s=0)


def test_opens_with_the_prediction_charted(lab):
    assert lab.status.value == ""
    assert lab.network.value == "mlp5" and "mlp5" in lab.network.options
    assert predicted_peak(lab) > 0
    assert rule_values(lab)["budget"] == pytest.approx(lab.budget.value, rel=1e-3)
    assert "minimum feasible" in rule_values(lab) and "vdnn-all" in lab.minimum_text.value
    assert {r["lane"] for r in rows(lab.timeline_chart) if "lane" in r} >= {"compute"}
    assert "peak" in lab.summary.value
    assert lab.plan.policy == "vdnn-all" and lab.simulation.policy == "vdnn-all"  # what Train will run


def test_batch_size_updates_the_same_chart_widget(lab):
    chart, before = lab.memory_chart, predicted_peak(lab)
    lab.batch.value = 64
    assert lab.memory_chart is chart  # updated in place, not re-created
    assert predicted_peak(lab) > before
    assert lab.status.value == ""


def test_budget_slider_moves_the_rule_and_replans(lab):
    lab.policy.value = "pin-dp"
    top = lab.budget.value
    lab.budget.value = top * 0.98
    assert rule_values(lab)["budget"] == pytest.approx(top * 0.98, rel=1e-3)
    assert "budget" in lab.budget_text.value


def test_an_infeasible_budget_is_shown_in_the_app(lab):
    lab.budget.value = lab.budget.max * 0.05
    assert "cannot fit" in lab.status.value and "#d62728" in lab.status.value
    assert lab.budget.style.handle_color == "#d62728"
    assert "does not fit" in lab.summary.value
    lab.budget.value = lab.budget.max
    assert lab.status.value == "" and lab.budget.style.handle_color == "#2ca02c"


def test_a_bad_network_name_is_an_error_in_the_app_and_the_chart_stays(lab):
    spec = lab.memory_chart.spec
    lab.network.value = "resnet_nope"
    assert "UnknownModelError" in lab.status.value and "the zoo knows" in lab.status.value
    assert lab.memory_chart.spec == spec
    lab.network.value = "mlp5"
    assert lab.status.value == ""


def test_policy_and_hardware_change_the_plan(lab):
    lab.policy.value = "keep-all"
    assert "keep-all" in lab.minimum_text.value
    lab.hardware.value = "cpu-amd-epyc-2cpu"
    assert lab.status.value == "" and lab.setting.device == "cpu"


def test_measure_overlays_a_real_step(lab):
    lab.measure_button.click()
    assert "measured on" in lab.status.value
    measured = [r for r in rows(lab.memory_chart) if r.get("series") == "measured"]
    assert measured and max(r["bytes"] for r in measured) > 0
    lab.batch.value = 4  # another step: the old measurement no longer applies
    assert not [r for r in rows(lab.memory_chart) if r.get("series") == "measured"]


def test_your_own_module():
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10))
    lab = MemoryLab(model, input_shape=(32,), batch=4, policy="keep-all", debounce_s=0)
    assert lab.network.value == "Sequential (yours)" and lab.status.value == ""
    assert predicted_peak(lab) > 0
    lab.dtype.value = "float16"
    assert "float32" in lab.status.value


def test_measured_stream_events_join_the_timeline(lab):
    events = pd.DataFrame({"stream": ["compute", "d2h"], "kind": ["op", "offload"], "start_s": [0.0, 0.0],
                           "end_s": [1e-4, 2e-4]})
    lab.show_timeline(events)
    assert {r["source"] for r in rows(lab.timeline_chart) if "source" in r} == {"simulated", "measured"}
    lab.show_timeline(events.drop(columns=["end_s"]))
    assert "end_s" in lab.status.value
    lab.show_timeline(None)
    assert {r["source"] for r in rows(lab.timeline_chart) if "source" in r} == {"simulated"}


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
    assert {r["measure"] for r in rows(lab.training.chart) if "measure" in r} >= {"peak_bytes", "time_s"}
    assert not lab.training.train_button.disabled and lab.training.stop_button.disabled
    assert "trained 3 steps" in lab.status.value


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
