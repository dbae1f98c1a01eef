import contextlib
import copy
import dataclasses
import threading

import pytest
import torch
from torch import nn

import udnn_lab as ul
from udnn_lab import zoo
from udnn_lab.analysis.step import run_step, split_input
from udnn_lab.planning import POLICIES, PlanInfeasible, plan
from udnn_lab.planning.registry import SOLVER_POLICIES
from udnn_lab.runtime import HostMemoryError, OffloadRuntime, PlanMismatch
from udnn_lab.simulation.simulator import simulate
from udnn_lab.units import cuda_block_bytes
from udnn_lab.workload import optimizer_like

CPU = ul.Hardware.load("cpu-amd-epyc-2cpu")
# The same CPU with copies that take no time: the runtime's CPU copies are synchronous memcpys.
INSTANT = dataclasses.replace(CPU, **{f"{d}_{m}_{k}": (1e18 if k == "bytes_per_s" else 0.0)
                                      for d in ("h2d", "d2h") for m in ("pinned", "pageable")
                                      for k in ("bytes_per_s", "latency_s")})

ZOO = [("alexnet", {"image_size": 64}), ("vgg11", {"image_size": 32}), ("vgg16", {"image_size": 32}),
       ("vgg19", {"image_size": 32}), ("googlenet", {"image_size": 64}), ("inception_v3", {}),
       ("inception_v4", {"image_size": 80}),
       ("resnet18", {"image_size": 32}), ("resnet34", {"image_size": 32}), ("resnet50", {"image_size": 32}),
       ("resnet101", {"image_size": 32}), ("resnet152", {"image_size": 32}), ("densenet121", {"image_size": 32}),
       ("densenet201", {"image_size": 32}), ("resnet164", {}), ("resnet1001", {}), ("mlp5", {}), ("lstm", {}),
       ("transformer", {"input_shape": (16,)})]


def _step(model, work, runtime=None):
    args, kwargs = split_input(work.example_input)
    optimizer = optimizer_like(work.optimizer, model.parameters())
    torch.manual_seed(0)
    if runtime is None:
        _, loss = run_step(model, args, kwargs, loss_fn=work.loss_fn, target=work.target, optimizer=optimizer)
    else:
        with runtime:
            _, loss = run_step(model, args, kwargs, loss_fn=work.loss_fn, target=work.target, optimizer=optimizer)
    return loss.detach(), [p.grad for p in model.parameters()], list(model.state_dict().values())


SOLVER_OPS = 3000


def _policy_plans(graph):
    """Every policy, at a budget halfway between the lowest any offload reaches and the keep-all peak, so
    that budgeted policies act (without a budget where that one keeps everything); policies that come to the
    same actions are run once."""
    budget = (ul.min_budget(graph, "vdnn-all", hardware=CPU) + graph.peak_bytes) // 2
    plans, seen = {}, set()
    for name in POLICIES:
        if name in SOLVER_POLICIES and len(graph.ops) > SOLVER_OPS:
            continue  # the solver's plans are run on the smaller models: ResNet-1001's alone takes half a minute
        try:
            chosen = plan(graph, budget, name, hardware=CPU)
        except PlanInfeasible:
            chosen = plan(graph, None, name, hardware=CPU)
        if not (chosen.offloads or chosen.recomputes):
            chosen = plan(graph, None, name, hardware=CPU)
        if (chosen.offloads, chosen.recomputes) not in seen:
            seen.add((chosen.offloads, chosen.recomputes))
            plans[name] = chosen
    return plans


@pytest.mark.parametrize("name, options", [  # ResNet-18 in the compatibility subset (make test-compat)
    pytest.param(*z, id=z[0], marks=pytest.mark.compat if z[0] == "resnet18" else ()) for z in ZOO])
def test_every_policy_is_exact_on_every_zoo_model(name, options):
    if name == "inception_v4":
        pytest.importorskip("timm")
    work = zoo.get(name, batch=2, **options)
    graph = ul.trace(work)
    loss, grads, state = _step(copy.deepcopy(work.model), work)
    acted = 0
    for policy, chosen in _policy_plans(graph).items():
        runtime = OffloadRuntime(chosen)
        loss_b, grads_b, state_b = _step(copy.deepcopy(work.model), work, runtime)
        assert torch.equal(loss, loss_b), policy
        assert all(torch.equal(a, b) for a, b in zip(grads, grads_b)), policy
        assert all(torch.equal(a, b) for a, b in zip(state, state_b)), policy  # parameters and running stats
        acted += bool(chosen.offloads or chosen.recomputes)
    assert acted >= 1


def test_measured_live_bytes_follow_the_plan_on_cpu():
    work = zoo.get("resnet18", batch=4, image_size=32)
    graph = ul.trace(work)
    for policy in ("vdnn-all", "recompute"):
        chosen = plan(graph, None, policy, hardware=INSTANT)
        predicted = simulate(graph, chosen, hardware=INSTANT)
        summary = ul.measure(work, plan=chosen, repeats=0).summary(predicted)
        assert summary["peak_relative_error"] <= 0.01, summary
        assert summary["max_step_relative_error"] <= 0.01, summary
        assert predicted.peak_bytes <= graph.peak_bytes


def test_a_storage_saved_several_times_is_copied_once():
    work = zoo.get("resnet18", batch=4, image_size=32)
    graph = ul.trace(work)
    chosen = plan(graph, None, "vdnn-all", hardware=CPU)
    runtime = OffloadRuntime(chosen)
    _step(copy.deepcopy(work.model), work, runtime)
    assert runtime.last_step.d2h_bytes == sum(graph.tensors[o.tensor].nbytes for o in chosen.offloads)
    assert runtime.last_step.h2d_bytes == runtime.last_step.d2h_bytes and runtime.last_step.on_demand == 0
    shared = [o for o in chosen.offloads if len(graph.tensors[o.tensor].saved_by) > 1]
    assert shared  # some offloaded storages are saved by more than one op


def test_disabled_runtime_is_a_null_context():
    model = nn.Linear(4, 2)
    for runtime in (OffloadRuntime(None), OffloadRuntime(plan(ul.trace(model, torch.randn(3, 4)), None, "keep-all",
                                                              hardware=CPU), enabled=False)):
        with runtime as entered:
            model(torch.randn(3, 4)).sum().backward()
        assert entered is runtime and runtime.last_step is None and runtime.pool is None
        assert torch._C._len_torch_dispatch_stack() == 0


def test_a_failing_step_leaves_nothing_behind_and_the_model_trains_on():
    work = zoo.get("resnet18", batch=4, image_size=32)
    chosen = plan(ul.trace(work), None, "vdnn-all", hardware=CPU)
    runtime = OffloadRuntime(chosen)
    model = copy.deepcopy(work.model)
    for error in (RuntimeError("boom"), KeyboardInterrupt()):
        with pytest.raises(type(error)):
            with runtime:
                loss = work.loss_fn(model(work.example_input), work.target)
                raise error
        del loss
        assert torch._C._len_torch_dispatch_stack() == 0
        assert runtime.pool is None or runtime.pool.stats().in_use_bytes == 0
        with torch.autograd.graph.saved_tensors_hooks(lambda t: ("plain", t), lambda p: p[1]):
            model(work.example_input).sum().backward()  # our hooks are gone: these are the innermost
    loss, grads, _ = _step(copy.deepcopy(work.model), work)
    loss_b, grads_b, _ = _step(model, work, runtime)
    assert torch.equal(loss, loss_b) and all(torch.equal(a, b) for a, b in zip(grads, grads_b))


def test_two_hundred_steps_hold_memory_flat():
    work = zoo.get("mlp4", batch=16)
    graph = ul.trace(work)
    chosen = plan(graph, None, "vdnn-all", hardware=CPU)
    assert chosen.offloads
    batches = [(work.example_input, work.target)] * 200
    run = ul.train(work.model, batches, work.optimizer, loss_fn=work.loss_fn, plan=chosen, progress=False)
    assert len(run.steps) == 200 and run.stopped == "batches"
    assert run.steps["peak_bytes"].iloc[2:].nunique() == 1
    assert (run.steps["d2h_bytes"] == run.steps["d2h_bytes"].iloc[0]).all()
    assert run.pinned_bytes > 0


def test_host_memory_cap_is_refused_before_swapping():
    work = zoo.get("resnet18", batch=4, image_size=32)
    chosen = plan(ul.trace(work), None, "vdnn-all", hardware=CPU)
    runtime = OffloadRuntime(chosen, host_cap_bytes=1024)
    with pytest.raises(HostMemoryError, match="host memory"):
        _step(copy.deepcopy(work.model), work, runtime)
    assert torch._C._len_torch_dispatch_stack() == 0


def test_a_plan_for_another_step_is_refused():
    work = zoo.get("resnet18", batch=4, image_size=32)
    chosen = plan(ul.trace(work), None, "vdnn-all", hardware=CPU)
    other = zoo.get("resnet18", batch=2, image_size=32)
    with pytest.raises(PlanMismatch, match="plan"):
        _step(copy.deepcopy(other.model), other, OffloadRuntime(chosen))


def test_a_plan_must_know_where_its_tensors_are():
    graph = ul.trace(zoo.get("resnet18", batch=2, image_size=32))
    unlocated = POLICIES["vdnn-all"](graph, None, None)
    with pytest.raises(ValueError, match="located"):
        OffloadRuntime(unlocated)


@pytest.mark.gpu
@pytest.mark.parametrize("policy", ["vdnn-all", "vdnn++", "recompute", "auto"])
def test_every_policy_is_exact_on_cuda(policy):
    work = zoo.get("resnet50", batch=16, image_size=64, device="cuda")
    graph = ul.trace(work)
    budget = None if policy == "vdnn-all" else \
        (ul.min_budget(graph, policy, hardware="h100-sxm") + graph.cuda_peak_bytes) // 2  # weights dominate here
    chosen = plan(graph, budget, policy, hardware="h100-sxm")
    assert chosen.offloads or chosen.recomputes
    with torch.backends.cudnn.flags(enabled=True, benchmark=False, deterministic=True):
        loss, grads, _ = _step(copy.deepcopy(work.model), work)
        loss, grads = loss.cpu(), [g.cpu() for g in grads]  # the eager step's memory must not count below
        model = copy.deepcopy(work.model)
        work.model.to("cpu")
        outside = torch.cuda.memory_allocated() - _cuda_bytes([*model.parameters(), *model.buffers(),
                                                                work.example_input, work.target])
        torch.cuda.reset_peak_memory_stats()
        loss_b, grads_b, _ = _step(model, work, OffloadRuntime(chosen))
        measured = torch.cuda.max_memory_allocated() - outside
    assert torch.equal(loss, loss_b.cpu()) and all(torch.equal(a, b.cpu()) for a, b in zip(grads, grads_b))
    assert budget is None or measured <= budget, \
        f"measured step peak {measured} over the budget {budget} (keep-all predicted {graph.cuda_peak_bytes})"


def _cuda_bytes(tensors) -> int:
    """Bytes the caching allocator counts for these tensors (blocks rounded up to 512 bytes)."""
    return sum(cuda_block_bytes(t.untyped_storage().nbytes()) for t in tensors)


@pytest.mark.parametrize("policy", ["recompute", "vdnn-all"])
def test_a_step_holds_no_memory_after_it_ends_without_the_garbage_collector(policy):
    """The runtime's step object is a reference cycle: what it recorded must be dropped at exit, not at gc."""
    import gc

    from udnn_lab.runtime.live_bytes import LiveBytes

    work = zoo.get("resnet18", batch=2, image_size=32)
    graph = ul.trace(work)
    budget = None if policy == "vdnn-all" else (ul.min_budget(graph, policy, hardware=CPU) + graph.peak_bytes) // 2
    runtime = OffloadRuntime(plan(graph, budget, policy, hardware=CPU))
    args, kwargs = split_input(work.example_input)
    counter = LiveBytes([*work.model.parameters(), *work.model.buffers(), work.example_input, work.target])
    runtime.observer = counter  # prefetched and recomputed storages are made out of the counter's sight
    before = counter.live
    gc.disable()
    try:
        with counter, runtime:
            loss = work.loss_fn(work.model(*args, **kwargs), work.target)
            loss.backward()
        del loss
        work.model.zero_grad(set_to_none=True)
        held = counter.live - before
    finally:
        gc.enable()
    assert held == 0, f"{held} bytes held after the step until the garbage collector runs"


def _small_convnet(activation: type[nn.Module]) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 32, 3, padding=1), nn.BatchNorm2d(32), activation(),
                         nn.Conv2d(32, 32, 3, padding=1), activation(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(32, 4))


def _run_under(chosen, model: nn.Module, loss_fn=nn.functional.cross_entropy) -> None:
    x, y = torch.randn(4, 3, 64, 64), torch.tensor([0, 3, 1, 2])
    with OffloadRuntime(chosen):
        loss_fn(model(x), y).backward()


@pytest.mark.parametrize("change", ["activation", "eval mode", "loss"])
def test_plan_mismatch_a_plan_for_another_step_is_refused_at_the_first_op_that_differs(change):
    model = _small_convnet(nn.ReLU)
    x, y = torch.randn(4, 3, 64, 64), torch.tensor([0, 3, 1, 2])
    graph = ul.trace(model, x, loss_fn=nn.functional.cross_entropy, target=y, optimizer=None)
    chosen = plan(graph, None, "vdnn-all", hardware=CPU)
    assert chosen.offloads
    _run_under(chosen, copy.deepcopy(model))  # the step it was made for runs
    other, loss_fn = copy.deepcopy(model), nn.functional.cross_entropy
    if change == "activation":
        other = _small_convnet(nn.GELU)
    elif change == "eval mode":
        other.eval()
    else:
        loss_fn = lambda out, target: nn.functional.mse_loss(out, nn.functional.one_hot(target, 4).float())  # noqa: E731
    with pytest.raises(PlanMismatch, match=r"not the one the plan was made for: (after )?its op \d+") as refused:
        _run_under(chosen, other, loss_fn)
    said = str(refused.value)  # both ways of following a step name the causes, the tracer's own among them
    assert "changed since the plan was made" in said and ("if nothing changed" in said or "if none of these" in said)
    _run_under(chosen, copy.deepcopy(model))  # the runtime is left usable


def test_a_step_followed_op_by_op_that_differs_names_the_tracer_among_the_causes():
    model = _small_convnet(nn.ReLU)
    x, y = torch.randn(4, 3, 64, 64), torch.tensor([0, 3, 1, 2])
    graph = ul.trace(model, x, loss_fn=nn.functional.cross_entropy, target=y, optimizer=None)
    chosen = plan(graph, None, "vdnn-all", hardware=CPU).located(graph, on_hooks=False)
    assert OffloadRuntime(chosen).follows.startswith("op by op")
    with pytest.raises(PlanMismatch, match=r"not the one the plan was made for: its op \d+") as refused:
        _run_under(chosen, _small_convnet(nn.GELU))
    assert "fake kernels took another path" in str(refused.value) and "fake=False" in str(refused.value)


class _OwnGeneratorDropout(nn.Module):
    """A dropout mask drawn from the model's own torch.Generator, not the default one."""

    def __init__(self) -> None:
        super().__init__()
        self.generator = torch.Generator().manual_seed(7)

    def forward(self, x):
        mask = torch.rand(x.shape, generator=self.generator) > 0.5
        return x * mask * 2


def test_user_generator_recompute_replays_a_user_generator_s_draws_and_leaves_it_as_eager_does():
    torch.manual_seed(0)
    layers = []
    for _ in range(6):
        layers += [nn.Linear(256, 256), nn.Tanh(), _OwnGeneratorDropout()]
    model = nn.Sequential(*layers, nn.Linear(256, 4))
    x, y = torch.randn(64, 256), torch.randint(0, 4, (64,))
    graph = ul.trace(model, x, loss_fn=nn.functional.cross_entropy, target=y, optimizer=None)
    chosen = plan(graph, None, "recompute", hardware=CPU)
    assert chosen.recomputes
    results = []
    for runtime in (None, OffloadRuntime(chosen)):
        twin = copy.deepcopy(model)
        with runtime or contextlib.nullcontext():
            nn.functional.cross_entropy(twin(x), y).backward()
        states = [m.generator.get_state() for m in twin if isinstance(m, _OwnGeneratorDropout)]
        results.append(([p.grad for p in twin.parameters()], states))
    (grads, states), (grads_b, states_b) = results
    assert all(torch.equal(a, b) for a, b in zip(grads, grads_b))
    assert all(torch.equal(a, b) for a, b in zip(states, states_b))


class _ModifiesItsSavedOutput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(*[layer for _ in range(4) for layer in (nn.Linear(256, 256), nn.Tanh())])
        self.first, self.second = nn.Linear(256, 256), nn.Linear(256, 4)

    def forward(self, x):
        hidden = torch.relu(self.first(self.stem(x)))  # relu saves its output for backward
        out = self.second(hidden)
        hidden.add_(1)  # ... which is then modified in place: eager's backward refuses the step
        return out


@pytest.mark.parametrize("policy", ["vdnn-all", "recompute"])
def test_a_step_eager_rejects_is_rejected_under_the_runtime_too(policy):
    torch.manual_seed(0)
    model, x, y = _ModifiesItsSavedOutput(), torch.randn(256, 256), torch.randint(0, 4, (256,))
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        nn.functional.cross_entropy(copy.deepcopy(model)(x), y).backward()
    graph = ul.trace(model, x, loss_fn=nn.functional.cross_entropy, target=y, optimizer=None)
    chosen = plan(graph, None, policy, hardware=CPU)
    assert chosen.offloads or chosen.recomputes
    twin = copy.deepcopy(model)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        with OffloadRuntime(chosen):
            nn.functional.cross_entropy(twin(x), y).backward()


def test_plans_are_followed_by_hooks_with_a_dispatch_mode_only_where_a_recomputation_records():
    """An offload plan: no dispatch mode at all; a recompute plan: one only in its recording windows (NOTE [hook
    points] 6); the same plan located with on_hooks=False: one throughout. Eager's gradients in every case."""
    work = zoo.get("resnet18", batch=8, image_size=32)  # activations above the weights
    graph = ul.trace(work)
    loss, grads, _ = _step(copy.deepcopy(work.model), work)
    budget = (ul.min_budget(graph, "recompute", hardware=CPU) + graph.peak_bytes) // 2
    recomputing = plan(graph, budget, "recompute", hardware=CPU)
    cases = ((plan(graph, None, "vdnn-all", hardware=CPU), True, {0}),
             (recomputing, True, {0, 1}), (recomputing.located(graph, on_hooks=False), False, {1}))
    for chosen, by_hooks, modes in cases:
        modes_seen = []
        model = copy.deepcopy(work.model)
        for module in model.modules():
            module.register_forward_pre_hook(lambda *_: modes_seen.append(torch._C._len_torch_dispatch_stack()))
        runtime = OffloadRuntime(chosen)
        loss_b, grads_b, _ = _step(model, work, runtime)
        assert runtime.last_step.by_hook_events is by_hooks
        assert set(modes_seen) == modes, chosen
        assert torch.equal(loss, loss_b) and all(torch.equal(a, b) for a, b in zip(grads, grads_b))
    assert sum(modes_seen) == len(modes_seen)  # op by op: the mode throughout


def test_hook_windows_saved_tensor_hooks_are_on_only_in_the_windows_that_hold_planned_tensors():
    work = zoo.get("resnet18", batch=2, image_size=32)
    graph = ul.trace(work)
    everything = plan(graph, None, "vdnn-all", hardware=CPU)
    chosen = dataclasses.replace(everything, offloads=everything.offloads[:3]).located(graph)
    runtime = OffloadRuntime(chosen)
    schedule = runtime.hook_schedule()
    assert schedule is not None and not schedule.whole_step
    traced_packs = sum(event.kind == "pack" for event in graph.hook_events)
    window_packs = sum(event.kind == "pack" for event in schedule.events)
    assert 0 < window_packs < traced_packs / 2
    planned = {o.tensor for o in chosen.offloads}
    assert {e.tensor for e in graph.hook_events if e.kind == "pack" and e.tensor in planned} == \
        {e.tensor for e in schedule.events if e.kind == "pack" and e.tensor in planned}
    outside = []  # packs that reach the hooks beneath the runtime's: those outside its windows

    def count(tensor):
        outside.append(tensor.shape)
        return tensor

    loss, grads, _ = _step(copy.deepcopy(work.model), work)
    with torch.autograd.graph.saved_tensors_hooks(count, lambda tensor: tensor):
        loss_b, grads_b, _ = _step(copy.deepcopy(work.model), work, runtime)
    assert runtime.last_step.by_hook_events and runtime._schedule.seen == len(schedule.events)
    assert len(outside) + window_packs == traced_packs
    assert torch.equal(loss, loss_b) and all(torch.equal(a, b) for a, b in zip(grads, grads_b))


def test_hook_windows_hooks_pushed_inside_the_step_are_refused_and_the_runtime_stays_usable():
    work = zoo.get("resnet18", batch=2, image_size=32)
    runtime = OffloadRuntime(plan(ul.trace(work), None, "vdnn-all", hardware=CPU))
    model = copy.deepcopy(work.model)
    with pytest.raises(PlanMismatch, match="saved-tensor hooks were pushed inside the step"):
        with runtime, torch.autograd.graph.save_on_cpu():
            work.loss_fn(model(work.example_input), work.target).backward()
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
    loss, grads, _ = _step(copy.deepcopy(work.model), work)
    loss_b, grads_b, _ = _step(copy.deepcopy(work.model), work, runtime)
    assert torch.equal(loss, loss_b) and all(torch.equal(a, b) for a, b in zip(grads, grads_b))


def test_an_offload_plan_followed_op_by_op_is_exact_too():
    work = zoo.get("resnet18", batch=2, image_size=32)
    graph = ul.trace(work)
    chosen = plan(graph, None, "vdnn-all", hardware=CPU).located(graph, on_hooks=False)
    loss, grads, state = _step(copy.deepcopy(work.model), work)
    runtime = OffloadRuntime(chosen)
    loss_b, grads_b, state_b = _step(copy.deepcopy(work.model), work, runtime)
    assert not runtime.last_step.by_hook_events and runtime.last_step.ops
    assert torch.equal(loss, loss_b) and all(torch.equal(a, b) for a, b in zip(grads, grads_b))
    assert all(torch.equal(a, b) for a, b in zip(state, state_b))


def test_module_calls_in_another_thread_do_not_disturb_a_step():
    work = zoo.get("resnet18", batch=2, image_size=32)
    graph = ul.trace(work)
    chosen = plan(graph, None, "vdnn-all", hardware=CPU)
    assert chosen.offloads and chosen.hook_events
    stop = threading.Event()
    other = nn.Sequential(nn.Linear(4, 4), nn.ReLU())

    def busy():
        while not stop.is_set():
            other(torch.randn(1, 4))

    thread = threading.Thread(target=busy)
    thread.start()
    try:
        for _ in range(3):
            _step(copy.deepcopy(work.model), work, OffloadRuntime(chosen))
    finally:
        stop.set()
        thread.join()


class _PendingCopies:
    """CUDA's copy semantics on the CPU: each copy returns a token that stays pending until the host waits on it
    (as a copy queued behind the GPU would), and the compute stream's waits are noted, not made."""

    def __init__(self, device):
        from udnn_lab.runtime._copies import Copies

        self.inner, self.device, self.cuda = Copies(device), device, True
        self.wait_s, self.host_waits, self.stream_waits = 0.0, [], 0
        self.compute = self

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def wait_event(self, token):
        self.stream_waits += 1

    def to_host(self, source, host):
        self.inner.to_host(source, host)
        return _Pending(self)

    def to_device(self, host):
        target, _ = self.inner.to_device(host)
        return target, _Pending(self)

    def done(self, token):
        return token is None or token.query()

    def use(self, token):
        if token is not None and not token.query():
            self.wait_event(token)
            return True
        return False

    def finish(self, token):
        if token is not None and not token.query():
            token.synchronize()


class _Pending:
    def __init__(self, copies):
        self.copies, self.completed = copies, False

    def query(self):
        return self.completed

    def synchronize(self):
        self.copies.host_waits.append(self.copies.inner.device)
        self.completed = True


@pytest.mark.parametrize("policy", ["vdnn-all", "vdnn-conv"])
def test_the_host_never_waits_for_a_copy_inside_the_step(monkeypatch, policy):
    """NOTE [offload runtime] 7: on a GPU a host wait inside the step drains the device's queue, and the device
    idles while the host issues the next ops; with every copy still pending, only the step's end waits."""
    import udnn_lab.runtime._step as step_module

    made = []
    monkeypatch.setattr(step_module, "Copies", lambda device: made.append(_PendingCopies(device)) or made[-1])
    work = zoo.get("resnet18", batch=8, image_size=64)
    graph = ul.trace(work)
    chosen = plan(graph, None, policy, hardware=CPU)
    assert len(chosen.offloads) > 5
    runtime = OffloadRuntime(chosen)
    args, kwargs = split_input(work.example_input)
    model = copy.deepcopy(work.model)
    with runtime:
        work.loss_fn(model(*args, **kwargs), work.target).backward()
        waits_in_step = len(made[0].host_waits)
    runtime.release()
    assert waits_in_step == 0 and made[0].stream_waits >= len(chosen.offloads)
    assert made[0].host_waits  # the step's end waits for the copies still in flight (NOTE [offload runtime] 9)
