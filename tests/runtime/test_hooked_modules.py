"""Given the traced model, the runtime hooks only the modules the plan acts at (NOTE [hook points] 8)."""

import copy

import pytest
import torch
from torch import nn
from torch.nn.modules import module as torch_module

import udnn_lab as ul
from udnn_lab.analysis.step import run_step, split_input
from udnn_lab.errors import PlanForAnotherStep, PlanMismatch
from udnn_lab.planning.segments import block_plans
from udnn_lab.runtime import OffloadRuntime
from udnn_lab.runtime._host_probe import offload_plans
from udnn_lab.workload import Workload, optimizer_like

CPU = ul.Hardware.load("cpu-amd-epyc-2cpu")


class Hooked(nn.Module):
    """Notes, at each call, whether any global module hook is in force and how many hooks it has itself."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[bool, int]] = []

    def forward(self, x):
        globally = bool(torch_module._global_forward_pre_hooks or torch_module._global_forward_hooks)
        self.seen.append((globally, len(self._forward_pre_hooks) + len(self._forward_hooks)))
        return x


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.watch = Hooked()
        self.norm, self.up, self.down = nn.LayerNorm(width), nn.Linear(width, 4 * width), nn.Linear(4 * width, width)
        self.drop = nn.Dropout(0.1)

    def forward(self, x):
        return x + self.drop(self.down(nn.functional.gelu(self.up(self.norm(self.watch(x))))))


class Stack(nn.Module):
    def __init__(self, width: int = 32, depth: int = 4) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, 10)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x).mean(dim=1)


def _work() -> Workload:
    torch.manual_seed(0)
    model = Stack()
    return Workload(model, torch.randn(4, 16, 32), torch.randint(10, (4,)), nn.functional.cross_entropy,
                    torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), name="stack")


def _step(model, work, runtime=None):
    args, kwargs = split_input(work.example_input)
    optimizer = optimizer_like(work.optimizer, model.parameters())
    torch.manual_seed(0)
    with runtime if runtime is not None else torch.enable_grad():
        run_step(model, args, kwargs, loss_fn=work.loss_fn, target=work.target, optimizer=optimizer,
                 options=work.step_options)
    return [p.detach().clone() for p in model.parameters()] + [b.clone() for b in model.buffers()]


_PLANS = {  # name -> the plan for the traced step
    "re-run blocks": lambda graph: block_plans(graph, None)[0].located(graph),
    "offload every activation": lambda graph: offload_plans(graph)[1],
    "recompute least": lambda graph: ul.plan(graph, ul.min_budget(graph, "recompute", hardware=CPU), "recompute",
                                             hardware=CPU),
}


def _traced(name: str) -> tuple[Workload, ul.Graph, ul.Plan]:
    """A fresh workload, its traced step, and the plan ``name`` for it."""
    work = _work()
    graph = ul.trace(work)
    return work, graph, _PLANS[name](graph)


@pytest.mark.parametrize("name", ["re-run blocks", "offload every activation", "recompute least"])
def test_the_runtime_given_the_model_hooks_few_modules_makes_the_priced_calls_and_is_exact(name):
    work, graph, plan = _traced(name)
    assert plan.offloads or plan.recomputes
    expected = _step(copy.deepcopy(work.model), work)
    model = copy.deepcopy(work.model)
    runtime = OffloadRuntime(plan, model=model)
    hooked = runtime.hook_schedule().modules
    assert hooked is not None and 0 < len(hooked) < len(list(model.modules()))
    assert runtime.follows.endswith(f"{len(hooked)} module{'s' if len(hooked) > 1 else ''} hooked)")
    got = _step(model, work, runtime)
    assert all(torch.equal(a, b) for a, b in zip(expected, got))
    # the calls it handled are those the simulator prices, fewer than with every module hooked
    assert runtime.last_step.hook_calls == sum(plan.hook_calls(graph).values())
    assert sum(plan.hook_calls(graph).values()) < sum(plan.hook_calls(graph, every_module=True).values())
    # no global module hook; a module it does not hook has no hook of its own during the step
    seen = [call for block in model.blocks for call in block.watch.seen[-1:]]
    assert not any(globally for globally, _ in seen) and all(own == 0 for _, own in seen)
    assert all(not m._forward_pre_hooks and not m._forward_hooks for m in model.modules())  # removed after it


def test_without_the_model_every_module_is_hooked_and_the_step_is_the_same():
    work, graph, plan = _traced("re-run blocks")
    runtime = OffloadRuntime(plan)
    assert runtime.hook_schedule().modules is None and runtime.follows.endswith("every module hooked)")
    got = _step(copy.deepcopy(work.model), work, runtime)
    assert all(torch.equal(a, b) for a, b in zip(_step(copy.deepcopy(work.model), work), got))
    assert runtime.last_step.hook_calls == sum(plan.hook_calls(graph, every_module=True).values())


def test_a_runtime_for_a_copy_of_the_model_follows_the_copy_it_is_given():
    work, graph, plan = _traced("re-run blocks")
    runtime = OffloadRuntime(plan, model=work.model)
    with pytest.raises(PlanMismatch, match="called none of the modules the runtime hooks") as refused:
        _step(copy.deepcopy(work.model), work, runtime)
    assert len(str(refused.value).splitlines()[0]) < 240 and "for_model" in str(refused.value)
    copied = copy.deepcopy(work.model)
    _step(copied, work, runtime.for_model(copied))
    assert runtime.last_step.recomputed > 0


def test_a_module_in_another_mode_than_traced_is_refused_as_the_step_starts():
    work, graph, plan = _traced("re-run blocks")
    model = copy.deepcopy(work.model)
    runtime = OffloadRuntime(plan, model=model)
    model.blocks[2].drop.eval()  # a module the runtime does not hook
    assert all(m is not model.blocks[2].drop for m in runtime.hook_schedule().modules)
    with pytest.raises(PlanForAnotherStep, match=r"its module blocks\.2\.drop \(Dropout\) is in eval mode"):
        _step(model, work, runtime)
    model.blocks[2].drop.train()
    _step(model, work, runtime)  # nothing was left behind
    assert runtime.last_step.recomputed > 0


def test_a_model_with_another_module_at_a_traced_path_is_followed_call_by_call():
    work, graph, plan = _traced("offload every activation")
    model = copy.deepcopy(work.model)
    model.blocks[0].norm = nn.Identity()
    runtime = OffloadRuntime(plan, model=model)
    assert runtime.hook_schedule().modules is None  # every module hooked: the step's first difference is named
    with pytest.raises(PlanMismatch, match="Identity"):
        _step(model, work, runtime)
