"""Recompute by calling a module's forward again (runtime/_rerun.py, NOTE [hook points] 7)."""

import copy
import dataclasses

import pytest
import torch
from torch import nn

import udnn_lab as ul
from udnn_lab.analysis.step import ensure_optimizer_state, run_step, split_input
from udnn_lab.errors import ReplayError
from udnn_lab.graph.reruns import NOT_RERUN, module_reruns
from udnn_lab.planning.segments import block_plans, repeated_block
from udnn_lab.runtime import OffloadRuntime
from udnn_lab.runtime._rerun import rerun_calls
from udnn_lab.runtime.live_bytes import LiveBytes, resident
from udnn_lab.workload import Workload, optimizer_like

CPU = ul.Hardware.load("cpu-amd-epyc-2cpu")


class Block(nn.Module):
    """A transformer-like block: dropout draws random numbers, the keyword argument scales the residual."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(width), nn.Linear(width, 4 * width), nn.Linear(4 * width, width)
        self.drop = nn.Dropout(0.1)

    def forward(self, x, *, scale: float = 1.0, shift: torch.Tensor | None = None):
        if shift is not None:
            x = x + shift  # an addition saves neither input: forward lets ``shift`` go when it returns
        return x + scale * self.drop(self.down(nn.functional.gelu(self.up(self.norm(x)))))


class Stack(nn.Module):
    def __init__(self, width: int = 32, depth: int = 4, argument=None) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, 10)
        self.argument = argument

    def forward(self, x):
        shift = torch.full_like(x, 0.25)  # made before the blocks and read by each
        for block in self.blocks:
            x = block(x, scale=0.5 if self.argument is None else self.argument, shift=shift)
        return self.head(x).mean(dim=1)


class PairBlock(Block):
    """Takes its extras in a tuple: the runtime keeps a container argument for the re-run as it keeps a flat one."""

    def forward(self, x, extras=()):
        shift, scale = extras
        return super().forward(x, scale=scale, shift=shift)


class PairStack(Stack):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(PairBlock(32) for _ in range(4))

    def forward(self, x):
        shift = torch.full_like(x, 0.25)
        for block in self.blocks:
            x = block(x, (shift, 0.5))
        return self.head(x).mean(dim=1)


class ConvBlock(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv, self.bn = nn.Conv2d(channels, channels, 3, padding=1), nn.BatchNorm2d(channels)

    def forward(self, x):
        return x + torch.relu(self.bn(self.conv(x)))


def _work(model: nn.Module, example: torch.Tensor) -> Workload:
    return Workload(model, example, torch.randint(10, (example.shape[0],)), nn.functional.cross_entropy,
                    torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), name="blocks")


def _step(model, work, runtime=None):
    args, kwargs = split_input(work.example_input)
    optimizer = optimizer_like(work.optimizer, model.parameters())
    torch.manual_seed(0)
    with runtime if runtime is not None else torch.enable_grad():
        _, loss = run_step(model, args, kwargs, loss_fn=work.loss_fn, target=work.target, optimizer=optimizer,
                           options=work.step_options)
    return loss.detach(), [p.grad for p in model.parameters()], [t.clone() for t in model.state_dict().values()]


def _convnet() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), *(ConvBlock(8) for _ in range(3)), nn.Flatten(),
                         nn.Linear(8 * 8 * 8, 10))


@pytest.mark.parametrize("make, example", [
    pytest.param(Stack, torch.randn(4, 16, 32), id="dropout-and-keywords"),
    pytest.param(PairStack, torch.randn(4, 16, 32), id="a-tuple-argument"),
    pytest.param(_convnet, torch.randn(4, 3, 8, 8), id="batch-norm")])
def test_a_plan_of_whole_blocks_re_runs_them_exactly_at_the_simulated_peak(make, example):
    """Every recomputation re-runs its block's forward (no recording window, no dispatch mode): loss, gradients,
    parameters and running statistics equal to eager's; the measured peak is the simulated one."""
    torch.manual_seed(0)
    work = _work(make(), example)
    graph = ul.trace(work)
    plans = block_plans(graph, None)
    assert plans and len(repeated_block(graph)) >= 3
    expected = _step(copy.deepcopy(work.model), work)
    for chosen in plans:
        located = chosen.located(graph)
        assert located.reruns and NOT_RERUN not in located.reruns and located.recording == ()
        runtime = OffloadRuntime(located)
        model = copy.deepcopy(work.model)
        modes = []
        for module in model.modules():
            module.register_forward_pre_hook(lambda *_: modes.append(torch._C._len_torch_dispatch_stack()))
        got = _step(model, work, runtime)
        assert set(modes) == {0} and runtime.last_step.by_hook_events
        assert runtime.last_step.recomputed == sum(len(r.tensors) for r in chosen.recomputes)
        for a, b in zip(expected, got):
            assert all(torch.equal(x, y) for x, y in zip(a, b) if x is not None) if isinstance(a, list) \
                else torch.equal(a, b)
        predicted = ul.simulate(graph, located, hardware=CPU)
        assert ul.measure(work, plan=located, repeats=0).peak_bytes == predicted.peak_bytes


def test_a_source_forward_lets_go_is_held_until_the_last_recomputation_reading_it():
    """The blocks read a tensor forward lets go when it returns: the plan is valid, and the simulation holds it
    until the first block's re-run has run (the runtime keeps the block's arguments until then, and lets go of them
    before the op it re-ran for): at that op it counts in the re-run's scratch alone."""
    torch.manual_seed(0)
    work = _work(Stack(), torch.randn(4, 16, 32))
    graph = ul.trace(work)
    chosen = block_plans(graph, None)[0]
    chosen.validate(graph)
    shift = next(t for t in graph.tensors if t.producer is not None and graph.ops[t.producer].name.startswith(
        "aten.full_like"))
    assert shift.free_step < min(r.at_op for r in chosen.recomputes)
    simulation = ul.simulate(graph, chosen, hardware=CPU)
    held = [change for change in simulation.device_changes if change[2] == shift.id]
    last = max(r.at_op for r in chosen.recomputes)
    assert [sign for _, sign, _ in held] == [1, -1]
    assert held[0][0] == shift.free_step + 1 and held[1][0] == last
    assert simulation.scratch_by_op is not None and simulation.scratch_by_op[last] >= shift.nbytes


def test_a_call_with_an_argument_its_forward_could_change_is_replayed_instead():
    """A block that takes an object (a cache, here one that keeps what it saw) is not re-run: its forward would change
    the object again. The plan records and replays its ops, exactly."""
    torch.manual_seed(0)
    work = _work(Stack(argument=0.5), torch.randn(4, 16, 32))
    graph = ul.trace(work)
    chosen = block_plans(graph, None)[0]
    assert module_reruns(graph, chosen.recomputes)  # plain arguments: re-run

    class Cache:
        def __init__(self) -> None:
            self.seen: list[int] = []

    class Cached(Block):
        def forward(self, x, cache: Cache):
            cache.seen.append(x.shape[0])
            return super().forward(x)

    class CachedStack(Stack):
        def forward(self, x):
            cache = Cache()
            for block in self.blocks:
                x = block(x, cache)
            return self.head(x).mean(dim=1)

    torch.manual_seed(0)
    model = CachedStack()
    model.blocks = nn.ModuleList(Cached(32) for _ in range(4))
    work = _work(model, torch.randn(4, 16, 32))
    graph = ul.trace(work)
    chosen = block_plans(graph, None)[0]
    assert module_reruns(graph, chosen.recomputes) == ()
    located = chosen.located(graph)
    assert located.recording and not located.reruns
    expected = _step(copy.deepcopy(work.model), work)
    got = _step(copy.deepcopy(work.model), work, OffloadRuntime(located))
    assert all(torch.equal(a, b) for a, b in zip(expected[1], got[1]))


def test_a_block_that_takes_another_path_when_called_again_is_refused_in_one_line():
    class Moody(Block):
        calls = 0

        def forward(self, x, *, scale: float = 1.0, shift: torch.Tensor | None = None):
            type(self).calls += 1
            out = super().forward(x, scale=scale, shift=shift)
            return torch.sigmoid(out) if type(self).calls > 4 else out  # the re-runs save one tensor more

    torch.manual_seed(0)
    model = Stack()
    model.blocks = nn.ModuleList(Moody(32) for _ in range(4))
    work = _work(model, torch.randn(4, 16, 32))
    Moody.calls = -100  # the trace sees the plain path
    graph = ul.trace(work)
    located = block_plans(graph, None)[0].located(graph)
    assert located.reruns
    Moody.calls = 0
    runtime = OffloadRuntime(located)
    with pytest.raises(ReplayError, match="re-running Moody.*takes another path.*on_hooks=False"):
        _step(work.model, work, runtime)
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None  # nothing left behind
    Moody.calls = -100
    _step(work.model, work, runtime)  # the runtime and the model go on


def test_a_re_run_is_priced_by_its_hook_calls_not_per_replayed_op():
    torch.manual_seed(0)
    work = _work(Stack(), torch.randn(4, 16, 32))
    graph = ul.trace(work)
    chosen = block_plans(graph, None)[0]
    pricey = dataclasses.replace(CPU, replay_op_s=1.0, hook_call_s=1e-9, dispatch_mode_op_s=None)
    rerun = ul.simulate(graph, chosen.located(graph), hardware=pricey).step_time_s
    replayed = ul.simulate(graph, chosen.located(graph, on_hooks=False), hardware=pricey).step_time_s
    assert rerun < 1.0 < replayed


def test_a_re_run_pays_one_hook_call_per_pack_inside_the_call():
    """NOTE [simulated streams] 6: the call's module calls run without the runtime's hooks."""
    torch.manual_seed(0)
    work = _work(Stack(), torch.randn(4, 16, 32))
    graph = ul.trace(work)
    located = block_plans(graph, None)[0].located(graph)
    free = dataclasses.replace(CPU, replay_op_s=0.0, hook_call_s=0.0, offload_action_s=0.0, dispatch_mode_op_s=None)
    priced = dataclasses.replace(free, hook_call_s=1e-3)
    followed = sum(located.hook_calls(graph).values())
    packs_re_run = sum(len(call.packs) for call in rerun_calls(located).values())
    assert packs_re_run and located.reruns
    extra = ul.simulate(graph, located, hardware=priced).step_time_s - \
        ul.simulate(graph, located, hardware=free).step_time_s
    assert extra == pytest.approx((followed + packs_re_run) * 1e-3, rel=1e-6)


class Watching(nn.Module):
    """Notes, at each call, whether any global module hook is in force."""

    def __init__(self) -> None:
        super().__init__()
        self.hooked: list[bool] = []

    def forward(self, x):
        from torch.nn.modules import module

        self.hooked.append(bool(module._global_forward_pre_hooks or module._global_forward_hooks))
        return x


def test_a_re_run_calls_its_modules_without_the_runtimes_hooks():
    """NOTE [hook points] 7: torch's fast path for the re-run's module calls, and the hooks back after it."""
    torch.manual_seed(0)
    model = Stack()
    for block in model.blocks:
        block.norm = nn.Sequential(Watching(), block.norm)
    work = _work(model, torch.randn(4, 16, 32))
    graph = ul.trace(work)
    located = block_plans(graph, None)[0].located(graph)
    runtime = OffloadRuntime(located)
    expected = _step(copy.deepcopy(model), work)
    for block in model.blocks:
        block.norm[0].hooked.clear()
    got = _step(model, work, runtime)
    assert all(torch.equal(a, b) for a, b in zip(expected[1], got[1]))
    seen = [block.norm[0].hooked for block in model.blocks]
    re_run = len(rerun_calls(located))
    assert re_run and sorted(seen) == [[True]] * (len(seen) - re_run) + [[True, False]] * re_run
    assert not torch.nn.modules.module._global_forward_pre_hooks  # removed with the step


def test_a_plan_file_keeps_which_calls_are_re_run(tmp_path):
    torch.manual_seed(0)
    work = _work(Stack(), torch.randn(4, 16, 32))
    graph = ul.trace(work)
    located = block_plans(graph, None)[0].located(graph)
    loaded = ul.Plan.load(located.save(tmp_path / "plan.json"), graph)
    assert loaded.reruns == located.reruns and loaded == located
    expected = _step(copy.deepcopy(work.model), work)
    runtime = OffloadRuntime(loaded)
    got = _step(copy.deepcopy(work.model), work, runtime)
    assert runtime.last_step.recomputed and all(torch.equal(a, b) for a, b in zip(expected[1], got[1]))


def test_re_runs_under_autocast_and_gradient_accumulation_are_exact():
    """bf16-mixed: the re-run casts as forward did (autocast's state at the call's start); two micro-batches: each
    call of each is re-run once."""
    torch.manual_seed(0)
    work = dataclasses.replace(_work(Stack(), torch.randn(4, 16, 32)), precision="bf16-mixed", grad_accumulation=2)
    graph = ul.trace(work)
    located = block_plans(graph, None)[0].located(graph)
    assert len(located.reruns) == 8 and NOT_RERUN not in located.reruns
    expected = _step(copy.deepcopy(work.model), work)
    runtime = OffloadRuntime(located)
    got = _step(copy.deepcopy(work.model), work, runtime)
    assert torch.equal(expected[0], got[0]) and all(torch.equal(a, b) for a, b in zip(expected[1], got[1]))


def test_the_runtime_says_how_many_module_calls_it_re_runs():
    torch.manual_seed(0)
    work = _work(Stack(), torch.randn(4, 16, 32))
    graph = ul.trace(work)
    located = block_plans(graph, None)[0].located(graph)
    assert OffloadRuntime(located).follows.startswith("by module and saved-tensor hooks (4 module calls re-run, ")
    assert "re-run" not in OffloadRuntime(located.located(graph, on_hooks=False)).follows


def test_the_plan_s_reasons_say_which_module_a_tensor_is_rebuilt_by_calling_again():
    torch.manual_seed(0)
    work = _work(Stack(), torch.randn(4, 16, 32))
    graph = ul.trace(work)
    chosen = block_plans(graph, None)[0]
    reasons = ul.frames.plan_reasons(graph, chosen, ul.simulate(graph, chosen, hardware=CPU))
    rebuilt = reasons[reasons["action"] == "recompute"]["reason"]
    assert len(rebuilt) and rebuilt.str.endswith("by calling its Block again").all()
    replayed = ul.frames.plan_reasons(graph, chosen.located(graph, on_hooks=False),
                                      ul.simulate(graph, chosen, hardware=CPU))
    assert not replayed["reason"].str.contains("calling").any()


class ScaledBlock(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x):
        h = self.up(x)
        with torch.no_grad():  # a scale from every pair of features: a large tensor made and let go, saved by none
            scale = (h.unsqueeze(-1) * h.unsqueeze(-2)).amax()
        return x + self.down(torch.relu(h / scale))


class ScaledStack(nn.Module):
    def __init__(self, width: int = 16, depth: int = 3) -> None:
        super().__init__()
        self.blocks, self.head = nn.Sequential(*(ScaledBlock(width) for _ in range(depth))), nn.Linear(width, 10)

    def forward(self, x):
        return self.head(self.blocks(x)).mean(dim=1)


def test_a_count_of_live_bytes_sees_the_peak_of_what_a_re_run_makes():
    """A re-run runs out of the step's dispatch modes' sight (NOTE [offload runtime] 8): what it makes and lets go (the
    pairs' products) is told to the count, and to ``ul.measure``'s recording, which then peak where the simulation
    does; without it they missed the re-run of the first block, at backward's end, and peaked below the simulation on
    two of the three plans."""
    torch.manual_seed(0)
    work = _work(ScaledStack(), torch.randn(8, 32, 16))
    graph = ul.trace(work)
    model = copy.deepcopy(work.model)
    optimizer = optimizer_like(work.optimizer, model.parameters())
    ensure_optimizer_state(optimizer)  # the traced step is a steady one: momentum there from its start
    plans = block_plans(graph, None)
    assert len(plans) == 3
    for chosen in plans:
        located = chosen.located(graph)
        assert located.reruns and NOT_RERUN not in located.reruns
        args, kwargs = split_input(work.example_input)
        runtime = OffloadRuntime(located)
        counter = LiveBytes(resident(model, optimizer, None, [(args, kwargs, work.target)]))
        runtime.observer = counter
        with counter, runtime:
            run_step(model, args, kwargs, loss_fn=work.loss_fn, target=work.target, optimizer=optimizer)
        simulated = ul.simulate(graph, located, hardware=CPU).peak_bytes
        assert counter.peak == simulated
        assert ul.measure(work, plan=located, repeats=0).peak_bytes == simulated  # its recording is told the same
