"""Whether a step writes, under autograd, into a storage a view shares (analysis/_view_writes.py, NOTE [view replay]
4): the trace says so, and the runtime turns view replay on for such steps only."""

import copy
import dataclasses

import pytest
import torch
from torch import nn

import udnn_lab as ul
from udnn_lab import zoo
from udnn_lab.analysis.recording import real_step_ops
from udnn_lab.analysis.step import run_step, split_input
from udnn_lab.runtime import OffloadRuntime, PlanMismatch
from udnn_lab.workload import Workload, optimizer_like

CPU = ul.Hardware.load("cpu-amd-epyc-2cpu")


class Writes(nn.Module):
    """Three linear layers; between the first two, ``how`` writes in place into what the first made."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.first, self.second, self.head = nn.Linear(16, 64), nn.Linear(64, 64), nn.Linear(64, 4)

    def forward(self, x):
        x = self.first(x)
        if self.how == "into-a-view":
            x[:, :8].mul_(2)  # the slice's history is rebuilt (CopySlices)
        elif self.how == "into-a-viewed-base":
            flat = x.view(-1)
            x.add_(1)
            x = flat.view(x.shape) * 3  # the view's history is rebuilt: its base was written
        elif self.how == "into-a-view-without-grad":
            with torch.no_grad():
                self.first.bias[:4].mul_(1)
        return self.head(torch.relu(self.second(torch.relu(x))))


def _work(how: str) -> Workload:
    torch.manual_seed(0)
    model = Writes(how)
    return Workload(model, torch.randn(512, 16), torch.randint(4, (512,)), nn.functional.cross_entropy,
                    torch.optim.SGD(model.parameters(), lr=0.1), name=how)


@pytest.mark.compat
@pytest.mark.parametrize("how, rebuilds", [("into-a-view", True), ("into-a-viewed-base", True),
                                           ("into-a-view-without-grad", False), ("plain", False)])
@pytest.mark.parametrize("fake", [True, False], ids=["fake", "real"])
def test_the_trace_says_whether_the_step_rebuilds_a_views_history(how, rebuilds, fake):
    assert ul.trace(_work(how), fake=fake).rebuilds_views is rebuilds


def _step(work: Workload, runtime=None):
    model = copy.deepcopy(work.model)
    replaying = []
    model.head.register_forward_pre_hook(lambda *_: replaying.append(torch._C._is_view_replay_enabled()))
    args, kwargs = split_input(work.example_input)
    with runtime if runtime is not None else torch.enable_grad():
        run_step(model, args, kwargs, loss_fn=work.loss_fn, target=work.target, replay_views=False,
                 optimizer=optimizer_like(work.optimizer, model.parameters()))
    return [p.grad for p in model.parameters()], replaying


@pytest.mark.compat
@pytest.mark.parametrize("how", ["into-a-view", "plain"])
@pytest.mark.parametrize("on_hooks", [True, False], ids=["by-hooks", "op-by-op"])
def test_the_runtime_replays_views_only_for_a_step_that_rebuilds_them(how, on_hooks):
    work = _work(how)
    graph = ul.trace(work)
    chosen = ul.plan(graph, ul.min_budget(graph, "recompute", hardware=CPU), "recompute", hardware=CPU)
    located = chosen.located(graph, on_hooks=on_hooks)
    assert located.recomputes and located.replays_views is graph.rebuilds_views
    expected, _ = _step(work)
    got, replaying = _step(work, OffloadRuntime(located))
    assert replaying == [graph.rebuilds_views]
    assert all(torch.equal(a, b) for a, b in zip(expected, got))


@pytest.mark.compat
def test_a_step_that_rebuilds_a_views_history_has_other_ops_without_view_replay():
    """Why the flag is needed: followed op by op without view replay, such a step is not the traced one."""
    work = _work("into-a-view")
    graph = ul.trace(work)
    chosen = ul.plan(graph, None, "vdnn-all", hardware=CPU).located(graph, on_hooks=False)
    _step(work, OffloadRuntime(chosen))
    with pytest.raises(PlanMismatch):
        _step(work, OffloadRuntime(dataclasses.replace(chosen, replays_views=False)))


@pytest.mark.parametrize("name, options", [
    ("resnet18", {"image_size": 32}), ("densenet121", {"image_size": 32}), ("googlenet", {"image_size": 64}),
    ("transformer", {}), ("lstm", {}), ("hf:gpt2", {"small": True, "seq_len": 16}),
    ("hf:bert-base", {"small": True, "seq_len": 16}), ("hf:vit-b-16", {"small": True}),
    ("writes-into-a-view", {})])
def test_a_step_the_trace_says_rebuilds_no_view_runs_the_same_ops_without_view_replay(name, options):
    work = _work("into-a-view") if name == "writes-into-a-view" else zoo.get(name, batch=2, **options)
    rebuilds = ul.trace(work).rebuilds_views
    same = real_step_ops(work, replay_views=True) == real_step_ops(work, replay_views=False)
    assert same or rebuilds
    assert not same or name != "writes-into-a-view"  # the comparison sees the difference where there is one
