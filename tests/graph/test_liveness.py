import numpy as np
import pytest
import torch

import udnn_lab as ul
from udnn_lab import zoo
from udnn_lab.units import cuda_block_bytes
from udnn_lab.vocabulary import CATEGORIES


@pytest.fixture(scope="module")
def graph():
    return ul.trace(zoo.get("resnet18", batch=2, image_size=32, device="meta"))


def test_curve_has_one_row_per_op_and_categories_add_up(graph):
    curve = graph.memory_curve()
    assert len(curve) == len(graph.ops)
    assert list(curve["index"]) == list(range(len(graph.ops)))
    assert (curve[list(CATEGORIES)].sum(axis=1) == curve["live_bytes"]).all()
    assert curve["live_bytes"].max() == graph.peak_bytes
    assert curve.attrs["baseline_bytes"] == graph.baseline_bytes


def test_curve_follows_allocations_and_releases(graph):
    curve = graph.memory_curve()
    live = curve["live_bytes"].to_numpy()
    previous = np.concatenate([[graph.baseline_bytes], live[:-1]])
    released_before = np.concatenate([[0], curve["released_bytes"].to_numpy()[:-1]])
    # live(i) = live(i-1) - released after op i-1 + allocated by op i
    assert (live == previous - released_before + curve["allocated_bytes"].to_numpy()).all()


def test_live_bytes_match_a_direct_count_of_tensor_lives(graph):
    step = len(graph.ops) // 2
    alive = sum(t.nbytes for t in graph.tensors
                if t.alloc_step <= step and (t.free_step is None or t.free_step >= step))
    assert graph.memory_curve()["live_bytes"].iloc[step] == alive


def test_cuda_sizes_round_each_storage_to_512_bytes(graph):
    curve = graph.memory_curve()
    step = graph.peak_step
    alive = [t for t in graph.tensors if t.alloc_step <= step and (t.free_step is None or t.free_step >= step)]
    assert curve["cuda_live_bytes"].iloc[step] == sum(cuda_block_bytes(t.nbytes) for t in alive)
    assert graph.cuda_peak_bytes >= graph.peak_bytes
    assert all(t.cuda_nbytes % 512 == 0 for t in graph.tensors)


def test_breakdown_at_peak_sums_to_the_peak(graph):
    table = graph.breakdown()
    assert table.loc["total", "bytes_at_peak"] == graph.peak_bytes
    assert table.drop("total")["bytes_at_peak"].sum() == graph.peak_bytes
    assert table.drop("total")["share_at_peak"].sum() == pytest.approx(1.0)
    assert (table["max_bytes"] >= table["bytes_at_peak"]).all()
    assert table.loc["feature_map", "max_bytes"] > 0


def test_layers_report_order_outputs_and_saved_bytes(graph):
    layers = graph.layers().set_index("module")
    assert layers.loc["conv1", "order"] < layers.loc["layer1.0.conv1", "order"] < layers.loc["fc", "order"]
    assert layers.loc["conv1", "output_bytes"] == 2 * 64 * 16 * 16 * 4
    assert layers.loc["layer1.0.relu", "calls"] == 2  # BasicBlock applies its ReLU twice
    assert layers.loc["conv1", "parameter_bytes"] == 64 * 3 * 7 * 7 * 4
    assert layers.loc["", "saved_bytes"] >= layers.loc["layer1", "saved_bytes"] >= layers.loc["layer1.0", "saved_bytes"]
    assert layers.loc["conv1", "backward_ops"] >= 1


def test_schedule_goes_forward_then_backward_and_names_tensors(graph):
    table = graph.schedule()
    phases = list(table["phase"])
    assert phases == sorted(phases, key=["forward", "backward"].index)
    first = table.iloc[0]
    assert first["module"] == "conv1" and first["reads"] == ("input",)
    made = {name for row in table["allocates"] for name in row}
    freed = {name for row in table["releases"] for name in row}
    assert freed <= made | {"input"}
    # a backward step reads something produced long before, in forward (document 000's Step 10 in {t0, t7})
    forward_made = {name for row in table[table.phase == "forward"]["allocates"] for name in row}
    assert any(set(row) & forward_made for row in table[table.phase == "backward"]["reads"])
    assert len(graph.schedule(level="op")) == sum(op.phase != "optimizer" for op in graph.ops)
    with pytest.raises(ValueError, match="layer"):
        graph.schedule(level="module")


def test_parameters_can_be_shown_in_the_schedule(graph):
    with_params = graph.schedule(include_parameters=True)
    assert "conv1.weight" in with_params.iloc[0]["reads"]


def test_an_empty_step_is_handled():
    model = torch.nn.Linear(2, 2)
    graph = ul.trace(model, torch.randn(1, 2), optimizer=None)
    assert graph.peak_bytes >= graph.baseline_bytes > 0
