"""``ul.train(..., parallel=spec)``: real gloo ranks on CPU, started by the run itself.

Each spawn costs seconds (every rank imports torch), so each test is one run. A watchdog interrupts a run that
hangs (``RUN_TIMEOUT_S``), which ends its ranks the way Ctrl-C does.
"""

from __future__ import annotations

import _thread
import copy
import threading
from contextlib import contextmanager
from dataclasses import replace

import psutil
import pytest
import torch
import torch.distributed as dist
from torch import nn

import udnn_lab as ul
from udnn_lab import zoo
from udnn_lab.errors import RankFailed

RUN_TIMEOUT_S = 120
# Parameters (and optimizer state) after 3 steps agree with one process on the whole batch up to the order of the
# sums: each rank's mean loss over half the batch, its gradients averaged over ranks, against one mean over the
# whole batch.
TOLERANCE = dict(rtol=1e-5, atol=1e-6)


@contextmanager
def _watchdog():
    timer = threading.Timer(RUN_TIMEOUT_S, _thread.interrupt_main)
    timer.start()
    try:
        yield
    except KeyboardInterrupt:
        if not timer.is_alive():
            pytest.fail(f"the run did not end in {RUN_TIMEOUT_S} s")
        raise
    finally:
        timer.cancel()


def _rank_pids() -> set[int]:
    """This process's children that are ranks (not multiprocessing's resource tracker)."""
    return {child.pid for child in psutil.Process().children(recursive=True)
            if "resource_tracker" not in " ".join(child.cmdline())}


def _gone(pids: set[int]) -> bool:
    return all(not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE for pid in pids)


def _batches(count: int, batch: int, shape: tuple[int, ...], seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, *shape, generator=generator), torch.randint(0, 10, (batch,), generator=generator))
            for _ in range(count)]


def _sgd(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def _adam(model: nn.Module) -> torch.optim.Optimizer:
    # eps well above a gradient's rounding: where a gradient is near zero Adam divides it by about eps, and with
    # the default 1e-8 the last bits that the ranks' order of sums changes would move a weight beyond TOLERANCE
    return torch.optim.Adam(model.parameters(), lr=1e-3, eps=1e-6)


def _one_process(model: nn.Module, batches, loss_fn, steps: int | None = None,
                 make_optimizer=_sgd) -> tuple[nn.Module, torch.optim.Optimizer]:
    reference = copy.deepcopy(model)
    optimizer = make_optimizer(reference)
    ul.train(reference, batches, optimizer, loss_fn=loss_fn, steps=steps, progress=False)
    return reference, optimizer


def _assert_same_optimizer_state(optimizer: torch.optim.Optimizer, model: nn.Module,
                                 reference: torch.optim.Optimizer, reference_model: nn.Module) -> None:
    """``optimizer`` holds, keyed to ``model``'s own parameters, the state ``reference`` holds for its model's."""
    assert len(optimizer.state) == len(reference.state) == len(list(model.parameters()))
    for (name, param), expected_param in zip(model.named_parameters(), reference_model.parameters()):
        state, expected = optimizer.state[param], reference.state[expected_param]
        assert state.keys() == expected.keys() and state, name
        for key, value in state.items():
            assert value.device == param.device and (key == "step" or value.shape == param.shape), (name, key)
            # scaled to the largest: Adam's second moments, squares of small gradients, lie far below TOLERANCE's atol;
            # a state sums gradients that ranks reduce in another order than one process: within 1e-5 of the largest
            scale = expected[key].abs().max()
            assert scale > 0, (name, key)
            torch.testing.assert_close(value / scale, expected[key] / scale, rtol=1e-4, atol=1e-5,
                                       msg=lambda m, n=f"{name}/{key}": f"{n}: {m}")


def _assert_same_parameters(model: nn.Module, reference: nn.Module, start: nn.Module) -> None:
    for (name, trained), expected, before in zip(model.named_parameters(), reference.parameters(),
                                                 start.parameters()):
        assert not torch.equal(trained, before), f"{name} came back untrained"
        torch.testing.assert_close(trained, expected, **TOLERANCE, msg=lambda m, n=name: f"{n}: {m}")


class CountsExamples(nn.Module):
    """A model and the number of examples its forward saw (a buffer: it comes back with the weights)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model
        self.register_buffer("examples", torch.zeros((), dtype=torch.int64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.examples += x.shape[0]
        return self.model(x)


@pytest.mark.compat
@pytest.mark.parametrize(("spec", "ends", "make_optimizer"), [(ul.DDP(2), "batches", _adam),
                                                               (ul.FSDP(2), "stop requested", _sgd)],
                         ids=["DDP, Adam, to the last batch", "FSDP, SGD, stopped from outside"])
def test_ranks_train_what_one_process_trains_on_the_whole_batches(spec, ends, make_optimizer):
    work = zoo.get("mlp3", batch=8, seed=0)
    batches = _batches(3, 8, (784,))
    start = CountsExamples(work.model)
    model = copy.deepcopy(start)
    optimizer = make_optimizer(model)
    seen, pids, stop = [], set(), threading.Event()

    def record(row):
        seen.append(dict(row))
        pids.update(_rank_pids())
        if ends == "stop requested" and row["step"] == 2:
            stop.set()  # as another thread would: the ranks end before step 3

    with _watchdog():
        run = ul.train(model, batches if ends == "batches" else batches * 5, optimizer, loss_fn=work.loss_fn,
                       parallel=spec, callbacks=[record], stop=stop, progress=False)
    reference, reference_optimizer = _one_process(start, batches, work.loss_fn, make_optimizer=make_optimizer)
    _assert_same_parameters(model, reference, start)
    _assert_same_optimizer_state(optimizer, model, reference_optimizer, reference)
    assert reference.examples == 3 * 8 and model.examples == 3 * 4  # rank 0 saw its half of each batch
    assert [row["step"] for row in seen] == [0, 1, 2] and list(run.steps["step"]) == [0, 1, 2]
    assert run.stopped == ends and len(pids) == 2 and _gone(pids)
    for rank in (0, 1):
        assert (run.steps[f"peak_bytes_rank{rank}"] > 0).all() and all(f"peak_bytes_rank{rank}" in r for r in seen)
    assert (run.steps["peak_bytes"] == run.steps["peak_bytes_rank0"]).all()
    assert "over 2 ranks" in run.notes[0] and "gloo" in run.notes[0]
    half = zoo.get("mlp3", batch=4, seed=0)  # each rank's step, as predicted
    counted = CountsExamples(half.model)
    half = replace(half, model=counted, optimizer=make_optimizer(counted))
    for rank in (0, 1):
        traced = ul.trace(half, parallel=replace(spec, rank=rank))
        measured = run.steps[f"peak_bytes_rank{rank}"].iloc[1:]  # the first step lazily builds FSDP and DDP state
        if isinstance(spec, ul.DDP):
            assert (measured == traced.peak_bytes).all()
        else:  # plus, at most, gloo's own copy of a reduce-scatter's input (NCCL makes none)
            largest = max(t.nbytes for t in traced.tensors if t.category == "communication")
            assert (measured >= traced.peak_bytes).all() and (measured <= traced.peak_bytes + largest).all()


def _rank_0_plan(name: str, spec: ul.FSDP, **options) -> ul.Plan:
    """vdnn-all's plan of rank 0's step (it offloads every convolution's input), batch norm in eval mode."""
    work = zoo.get(name, seed=0, **options)
    work.model.eval()
    return ul.plan(ul.trace(work, parallel=replace(spec, rank=0)), None, "vdnn-all", hardware="cpu-amd-epyc-2cpu")


def test_a_callback_stops_every_rank_at_that_step_and_the_weights_and_optimizer_state_come_back():
    # eval mode: batch norm uses its running statistics, so a rank's half batch computes what the whole one does
    work = zoo.get("resnet20", batch=4, seed=0)
    work.model.eval()
    plan = _rank_0_plan("resnet20", ul.FSDP(2), batch=2)  # every rank runs the same ops: one plan for both
    batches = _batches(51, 4, (3, 32, 32))
    start, model = copy.deepcopy(work.model), copy.deepcopy(work.model)
    optimizer = _adam(model)
    ul.train(model, batches[:1], optimizer, loss_fn=work.loss_fn, progress=False)  # the ranks go on from here
    pids: set[int] = set()

    def stop_after_step_1(row):
        pids.update(_rank_pids())
        return row["step"] < 1

    with _watchdog():
        run = ul.train(model, batches[1:], optimizer, loss_fn=work.loss_fn, parallel=ul.FSDP(2), plan=plan,
                       callbacks=[stop_after_step_1], progress=False)
    assert run.stopped == "callback" and list(run.steps["step"]) == [0, 1]
    assert run.policy == "vdnn-all" and (run.steps["d2h_bytes"] > 0).all()
    assert len(pids) == 2 and _gone(pids)
    reference, reference_optimizer = _one_process(work.model, batches, work.loss_fn, steps=3, make_optimizer=_adam)
    _assert_same_parameters(model, reference, start)
    _assert_same_optimizer_state(optimizer, model, reference_optimizer, reference)


def test_a_plan_followed_op_by_op_starts_once_the_wrapped_model_runs_its_traced_step():
    work = zoo.get("resnet20", batch=4, seed=0)
    work.model.eval()
    rank_work = zoo.get("resnet20", batch=2, seed=0)
    rank_work.model.eval()
    plans = []
    for rank in (0, 1):
        graph = ul.trace(rank_work, parallel=ul.DDP(2, rank=rank))
        budget = (ul.min_budget(graph, "recompute") + graph.peak_bytes) // 2
        plans.append(ul.plan(graph, budget, "recompute"))
    assert all(p.recomputes for p in plans)
    batches = _batches(5, 4, (3, 32, 32))
    start, model = copy.deepcopy(work.model), copy.deepcopy(work.model)
    optimizer = _sgd(model)
    ul.train(model, batches[:1], optimizer, loss_fn=work.loss_fn, progress=False)  # the ranks go on from here
    with _watchdog():
        run = ul.train(model, batches[1:], optimizer, loss_fn=work.loss_fn, parallel=ul.DDP(2), plan=plans,
                       progress=False)
    assert list(run.steps["recomputed"] > 0) == [False, False, True, True]
    assert any("the first 2 steps ran without the plan" in note for note in run.notes)
    reference, reference_optimizer = _one_process(work.model, batches, work.loss_fn)
    _assert_same_parameters(model, reference, start)
    _assert_same_optimizer_state(optimizer, model, reference_optimizer, reference)


class FailsOnRank1(nn.Module):
    """A model whose second forward raises on rank 1 of a process group."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 10)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls == 2 and dist.is_initialized() and dist.get_rank() == 1:
            raise RuntimeError("rank one's second batch went wrong")
        return self.layer(x)


def test_a_rank_that_raises_ends_the_other_and_the_error_names_it():
    model = FailsOnRank1()
    pids: set[int] = set()
    with _watchdog(), pytest.raises(RankFailed) as failed:
        ul.train(model, _batches(5, 4, (4,)), _sgd(model), loss_fn=nn.functional.cross_entropy,
                 parallel=ul.DDP(2), callbacks=[lambda row: pids.update(_rank_pids())], progress=False)
    assert failed.value.rank == 1 and "rank 1 failed" in str(failed.value)
    assert "Traceback" in str(failed.value) and "rank one's second batch went wrong" in str(failed.value)
    assert len(pids) == 2 and _gone(pids)


def test_keyboard_interrupt_ends_every_rank():
    model = FailsOnRank1()  # never fails here: the run is interrupted at its first row
    pids: set[int] = set()

    def interrupted(row):
        pids.update(_rank_pids())
        raise KeyboardInterrupt

    before = torch.cat([p.detach().flatten() for p in model.parameters()])
    with pytest.raises(KeyboardInterrupt):
        ul.train(model, _batches(5, 4, (4,)), _sgd(model), loss_fn=nn.functional.cross_entropy,
                 parallel=ul.DDP(2), callbacks=[interrupted], progress=False)
    assert len(pids) == 2 and _gone(pids)
    assert torch.equal(before, torch.cat([p.detach().flatten() for p in model.parameters()]))  # left as it was


def _plan(work: ul.Workload) -> ul.Plan:
    return ul.plan(ul.trace(work), None, "vdnn-all", hardware="cpu-amd-epyc-2cpu")


@pytest.mark.parametrize(("change", "error", "message"), [
    (dict(batches=_batches(2, 7, (784,))), ValueError, "multiple of 2"),
    (dict(plan="three plans"), ValueError, "one Plan per rank"),
    (dict(fuse_optimizer=True), ValueError, "leave fuse_optimizer off"),
    (dict(loss_fn=lambda output, target: output.sum()), TypeError, "does not pickle"),
    (dict(parallel="ddp"), TypeError, "ul.DDP(world_size"),
    (dict(parallel=ul.FSDP(2, offload_params=True)), ValueError, "train them without offload_params here"),
], ids=["indivisible batch", "plans for another world size", "fused optimizer", "lambda loss", "not a spec",
        "parameters offloaded from a CPU"])
def test_a_bad_request_is_a_clear_error_before_any_rank_starts(change, error, message):
    work = zoo.get("mlp3", batch=8, seed=0)
    if change.get("plan") == "three plans":
        change["plan"] = [_plan(work)] * 3
    request = dict(batches=_batches(2, 8, (784,)), loss_fn=work.loss_fn, parallel=ul.DDP(2), progress=False)
    with pytest.raises(error, match=message.replace("(", r"\(")):
        ul.train(work.model, optimizer=work.optimizer, **{**request, **change})
    assert not _rank_pids()


def test_a_list_of_plans_is_for_parallel_runs_only():
    work = zoo.get("mlp3", batch=8, seed=0)
    with pytest.raises(TypeError, match="one per rank, is for parallel="):
        ul.train(work.model, _batches(1, 8, (784,)), work.optimizer, loss_fn=work.loss_fn,
                 plan=[_plan(work)] * 2, progress=False)
