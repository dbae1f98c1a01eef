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
