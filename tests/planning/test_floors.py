"""What sets a peak no plan of saved tensors lowers (planning/floors.py): a plan that moves tensors yet peaks no
lower than keeping them all says so in one line, with what would help. Only a plan made without a budget can:
under a budget below the keep-all peak a plan that fits is lower, and at or above it every policy keeps all."""

import torch
from torch import nn

import udnn_lab as ul
from udnn_lab.planning import unlowered
from udnn_lab.planning.floors import UNLOWERED

CPU = "cpu-amd-epyc-2cpu"


def _wide_with_adam() -> ul.Graph:
    """Weights, gradients and Adam's state are 80% of the peak: recomputing activations cannot lower it."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10))
    return ul.trace(model, torch.randn(4, 1024), nn.functional.cross_entropy, torch.optim.Adam(model.parameters()),
                    target=torch.randint(10, (4,)))


def test_a_plan_that_moves_tensors_but_not_the_peak_says_so_and_what_would_lower_it():
    graph = _wide_with_adam()
    chosen = ul.plan(graph, None, "recompute", hardware=CPU)
    kept = ul.simulate(graph, ul.Plan.keep_all(graph), hardware=CPU)
    planned = ul.simulate(graph, chosen, hardware=CPU)
    assert chosen.recomputes and planned.peak_bytes >= kept.peak_bytes  # moved something, lowered nothing
    said = unlowered(chosen)
    assert said.startswith(UNLOWERED) and "\n" not in said
    assert f"in {planned.step_time_s / kept.step_time_s:.2f}x the step time" in said
    assert "optimizer state" in said and "shard them (FSDP)" in said and "8 bits" in said


def test_a_plan_that_lowers_the_peak_has_no_such_note():
    graph = ul.trace(ul.zoo.get("resnet18", batch=16, image_size=64))
    chosen = ul.plan(graph, None, "recompute", hardware=CPU)
    assert chosen.recomputes and ul.simulate(graph, chosen, hardware=CPU).peak_bytes < graph.peak_bytes
    assert unlowered(chosen) == ""
    assert unlowered(ul.plan(graph, None, "keep-all", hardware=CPU)) == ""  # moves nothing: nothing to say
