import pandas as pd
import pytest

from tests.charts.test_charts import layers_of, mark_type, rows
from udnn_lab import charts

GIB = 2**30
MEMORIES = {"24 GB": 24 * GIB, "80 GB": 80 * GIB}


def test_breakdown_bars_stack_categories_per_configuration_in_gib_with_memory_rules():
    frame = pd.DataFrame([
        {"configuration": "full", "category": "parameter", "bytes": 16 * GIB},
        {"configuration": "full", "category": "optimizer_state", "bytes": 32 * GIB},
        {"configuration": "LoRA", "category": "parameter", "bytes": 16 * GIB},
        {"configuration": "LoRA", "category": "gradient_map", "bytes": 0},
    ])
    spec = charts.breakdown_bars(frame, memories=MEMORIES).to_dict()
    bar = next(u for u in layers_of(spec) if mark_type(u) == "bar")
    assert bar["encoding"]["x"]["stack"] == "zero"
    assert bar["encoding"]["y"]["sort"] == ["full", "LoRA"]
    assert bar["encoding"]["color"]["scale"]["domain"] == ["parameter", "gradient_map", "optimizer_state"]
    values = {(r["configuration"], r["category"]): r["value"] for r in rows(spec) if "category" in r}
    assert values == {("full", "parameter"): 16, ("full", "optimizer_state"): 32, ("LoRA", "parameter"): 16}
    rule = next(u for u in layers_of(spec) if mark_type(u) == "rule")
    assert rule["encoding"]["x"]["field"] == "value"
    assert sorted(r["value"] for r in rows(spec) if "label" in r and "text" in r)[-1] == 80


def test_peak_by_size_draws_one_line_per_configuration_and_a_rule_per_memory():
    frame = pd.DataFrame({"configuration": ["a", "a", "b"], "size": [1024, 2048, 1024],
                          "peak_bytes": [10 * GIB, 20 * GIB, 30 * GIB]})
    spec = charts.peak_by_size(frame, memories=MEMORIES, title="t").to_dict()
    line = next(u for u in layers_of(spec) if mark_type(u) == "line")
    assert line["encoding"]["color"]["field"] == "configuration"
    assert line["encoding"]["y"]["title"] == "peak (GiB)"
    assert sorted(r["value"] for r in rows(spec) if "configuration" in r) == [10, 20, 30]
    assert {r["label"] for r in rows(spec) if "label" in r} == set(MEMORIES)


def test_fit_charts_name_the_missing_columns():
    with pytest.raises(ValueError, match="missing \\['bytes'\\]"):
        charts.breakdown_bars(pd.DataFrame({"configuration": ["a"], "category": ["parameter"]}))
    with pytest.raises(ValueError, match="missing \\['peak_bytes'\\]"):
        charts.peak_by_size(pd.DataFrame({"configuration": ["a"], "size": [1]}))


def test_by_world_size_draws_each_setups_peak_and_step_time_on_a_log_world_axis():
    frame = pd.DataFrame({"world_size": [1, 8, 1, 8], "setup": ["DDP", "DDP", "FSDP2", "FSDP2"],
                          "peak_bytes": [90 * GIB, 90 * GIB, 90 * GIB, 30 * GIB],
                          "step_time_s": [1.0, 1.1, 1.0, float("nan")], "fits": [False, False, False, True]})
    spec = charts.by_world_size(frame, memories={"80 GB": 80 * GIB}, title="t").to_dict()
    left, right = spec["hconcat"]
    line = next(u for u in layers_of(left) if mark_type(u) == "line")
    assert line["encoding"]["x"]["scale"] == {"type": "log", "base": 2}
    assert line["encoding"]["color"]["field"] == "setup" and line["encoding"]["y"]["title"] == "peak per rank (GiB)"
    assert sorted(r["value"] for r in rows(spec) if "value" in r and "setup" in r)[:2] == [30, 90]
    assert right["encoding"]["y"]["title"] == "predicted step (ms)"
    shown = {(r["setup"], r["world_size"], r["fitting"]) for r in rows(spec) if "fitting" in r}
    assert ("FSDP2", 8, "fits") in shown and ("DDP", 8, "does not fit") in shown
    with pytest.raises(ValueError, match="missing \\['fits'\\]"):
        charts.by_world_size(frame.drop(columns="fits"))
