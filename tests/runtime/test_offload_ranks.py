"""The offload runtime under DDP and FSDP2: real ranks, gloo on CPU, each following the plan of its own trace.

This process traces each rank of each case (``ul.trace(..., parallel=spec)``) and plans it for vdnn-all,
recompute and auto, at the middle between the policy's least budget and the rank's peak. One spawn of two
ranks then runs, for each case, the step without the runtime and under each plan, from the same weights after
the same warm-up, and measures each plan's step as ``ul.measure`` counts (live storages after each op).

A rank's measured step holds what gloo holds besides the trace (NOTE in test_one_rank_gloo.py: its
reduce-scatter buffer, and communication buffers it lets go of late); the budget is checked on the measured
curve without those, which test_one_rank_gloo.py checks to be the trace's where gloo lets go in time.

A second spawn shows a rank that fails in the middle of a step under a plan ending the other (gloo tells it its
peer is gone), whose runtime leaves no hook behind on its way out, for each way a plan is followed.
"""

from __future__ import annotations

import contextlib
import copy
import pickle
import time
from dataclasses import dataclass, replace
from datetime import timedelta
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.modules import module as module_hooks

import udnn_lab as ul
from udnn_lab import zoo
from udnn_lab.analysis.step import preserved, run_step, same_optimizer, split_input
from udnn_lab.errors import ReplayError
from udnn_lab.graph.liveness import op_table
from udnn_lab.graph.plan_ir import Recompute
from udnn_lab.parallel import DDP, FSDP
from udnn_lab.planning import PlanInfeasible
from udnn_lab.runtime import OffloadRuntime
from udnn_lab.runtime._replay import Replay
from udnn_lab.vocabulary import CATEGORIES, PLANNED_CATEGORIES

from ..analysis.test_one_rank_gloo import _gloo_view, _live
from ..spawned_ranks import RANKS_TIMEOUT_S, spawned

RANKS = 2
CPU = ul.Hardware.load("cpu-amd-epyc-2cpu")
CASES = {  # name: (zoo model, spec for a world size)
    "mlp3 DDP": ("mlp3", lambda world: DDP(world)),
    "mlp3 FSDP": ("mlp3", lambda world: FSDP(world)),
    "resnet20 DDP": ("resnet20", lambda world: DDP(world)),
    "resnet20 FSDP": ("resnet20", lambda world: FSDP(world)),
    "gpt2-small FSDP": ("hf:gpt2", lambda world: FSDP(world)),
}
POLICIES = ("vdnn-all", "recompute", "auto")
WARMUP_STEPS = 2  # FSDP's lazy init in the first, DDP's bucket rebuild in the second: then the traced step
_COMMUNICATION = CATEGORIES.index("communication")


def _workload(name: str) -> ul.Workload:
    if name.startswith("hf:"):
        return zoo.get(name, batch=2, seq_len=32, small=True, optimizer="adam", seed=0)
    # mlp3 at a batch whose feature maps are worth moving (at 4 rows no policy acts on them)
    return zoo.get(name, batch=256 if name == "mlp3" else 4, optimizer="adam", seed=0)


def _planned(graph: ul.Graph, policy: str) -> ul.Plan:
    """The policy's plan at the middle between the least budget it reaches and the peak; without a budget (its
    least peak) where that is the peak itself (mlp3's peak is the optimizer step, which no policy lowers)."""
    try:
        budget = (ul.min_budget(graph, policy, hardware=CPU) + graph.peak_bytes) // 2
        chosen = ul.plan(graph, budget, policy, hardware=CPU)
    except PlanInfeasible:
        chosen = ul.plan(graph, None, policy, hardware=CPU)
    return chosen if chosen.offloads or chosen.recomputes else ul.plan(graph, None, policy, hardware=CPU)


@dataclass(frozen=True)
class RankRun:
    """What one rank saw of one plan's step, against the same step without the runtime."""

    same_gradients: bool
    same_parameters: bool  # after the optimizer step (an FSDP rank's local shards)
    follows: str
    moved_bytes: int  # copied to the host and back, as the runtime counted
    recomputed: int
    hooks_left: tuple[str, ...]  # what the runtime left installed after the step
    measured: ul.Graph  # ul.measure's recording of a step under the plan


def _wrapped(spec: DDP | FSDP, model: torch.nn.Module) -> torch.nn.Module:
    if isinstance(spec, DDP):
        return spec.apply(model)
    return spec.apply(model, mesh=DeviceMesh.from_group(dist.group.WORLD, "cpu"))


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (FSDP2), a plain tensor itself."""
    to_local = getattr(tensor, "to_local", None)
    return (to_local() if to_local is not None else tensor).detach().clone()


def _warm(work: ul.Workload, spec: DDP | FSDP) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A wrapped copy of the model and its optimizer after the warm-up steps: at the step its trace is of."""
    model = _wrapped(spec, copy.deepcopy(work.model))
    optimizer = same_optimizer(work.optimizer, [{"params": list(model.parameters())}])
    args, kwargs = split_input(work.example_input)
    for _ in range(WARMUP_STEPS):
        run_step(model, args, kwargs, loss_fn=work.loss_fn, target=work.target, optimizer=optimizer)
    return model, optimizer


def _stepped(work: ul.Workload, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
             runtime: OffloadRuntime | None) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """One step (under ``runtime`` if given) from the model's state, which is restored afterwards: the step's
    gradients and the parameters after its optimizer step."""
    args, kwargs = split_input(work.example_input)
    with preserved(model, optimizer):
        torch.manual_seed(0)
        with runtime if runtime is not None else contextlib.nullcontext():
            run_step(model, args, kwargs, loss_fn=work.loss_fn, target=work.target, optimizer=optimizer)
        params = list(model.parameters())
        return [_local(p.grad) for p in params], [_local(p) for p in params]


def hooks_left(model: torch.nn.Module | None = None, wrappers_hooks: int = 0) -> tuple[str, ...]:
    """The runtime's kinds of hooks still installed in this process, and on ``model``'s modules beyond the
    ``wrappers_hooks`` DDP or FSDP keeps there (none once a step is over)."""
    left = []
    if model is not None and _module_hooks(model) != wrappers_hooks:
        left.append("module hooks")
    if torch._C._autograd._top_saved_tensors_default_hooks(False) is not None:
        left.append("saved-tensor hooks")
    if module_hooks._global_forward_pre_hooks or module_hooks._global_forward_hooks:
        left.append("global module hooks")
    if torch._C._len_torch_dispatch_stack():
        left.append("a dispatch mode")
    return tuple(left)


def _module_hooks(model: torch.nn.Module) -> int:
    return sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules())


def _rank(rank: int, store: str, out: str, plans: dict) -> None:
    """One real rank: for each case, from one warm state, the step without the runtime, and for each policy the
    step under its plan and ul.measure's recording of it."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=RANKS)
    runs = {}
    try:
        for case, (name, spec_for) in CASES.items():
            work, spec = _workload(name), replace(spec_for(RANKS), rank=rank)
            model, optimizer = _warm(work, spec)
            grads, params = _stepped(work, model, optimizer, None)
            for policy in POLICIES:
                graph, plan = plans[case, rank][0], plans[case, rank][1][policy]
                runtime = OffloadRuntime(plan, model=model)  # as ul.train's ranks: its modules hooked by path
                wrappers_hooks = _module_hooks(model)
                grads_b, params_b = _stepped(work, model, optimizer, runtime)
                left = hooks_left(model, wrappers_hooks)
                stats = runtime.last_step
                measured = ul.measure(model, work.example_input, work.loss_fn, optimizer, target=work.target,
                                      plan=plan, warmup=0, graph=graph, name=case)
                runs[case, policy] = RankRun(
                    all(torch.equal(a, b) for a, b in zip(grads, grads_b, strict=True)),
                    all(torch.equal(a, b) for a, b in zip(params, params_b, strict=True)),
                    runtime.follows, stats.d2h_bytes + stats.h2d_bytes if stats else 0,
                    stats.recomputed if stats else 0, left + hooks_left(), measured.recorded)
    finally:
        dist.destroy_process_group()
    Path(out, f"rank{rank}.pkl").write_bytes(pickle.dumps(runs))


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """{(case, policy): [(traced Graph, Plan, RankRun) of each rank]}."""
    plans = {}
    for case, (name, spec_for) in CASES.items():
        for rank in range(RANKS):
            graph = ul.trace(_workload(name), parallel=replace(spec_for(RANKS), rank=rank))
            plans[case, rank] = (graph, {policy: _planned(graph, policy) for policy in POLICIES})
    out = tmp_path_factory.mktemp("ranks")
    spawned(_rank, (str(out / "store"), str(out), plans), RANKS)
    runs = [pickle.loads(Path(out, f"rank{rank}.pkl").read_bytes()) for rank in range(RANKS)]
    return {(case, policy): [(plans[case, r][0], plans[case, r][1][policy], runs[r][case, policy])
                             for r in range(RANKS)]
            for case in CASES for policy in POLICIES}


RUNS = [(case, policy) for case in CASES for policy in POLICIES]


@pytest.mark.parametrize(("case", "policy"), RUNS)
def test_each_rank_under_its_plan_steps_as_without_the_runtime(ranks, case, policy):
    for rank, (_, plan, run) in enumerate(ranks[case, policy]):
        assert run.same_gradients, f"rank {rank}: gradients differ under the {policy} plan ({run.follows})"
        assert run.same_parameters, f"rank {rank}: parameters differ after the optimizer step ({run.follows})"
        assert run.hooks_left == (), f"rank {rank} left {run.hooks_left} behind"
        if run.follows.startswith("by module") and (plan.offloads or plan.recomputes):  # the wrapper's paths match
            assert "every module" not in run.follows, f"rank {rank}: {run.follows}"
        if plan.offloads:
            assert run.moved_bytes > 0, f"rank {rank} moved nothing of its plan's {len(plan.offloads)} offloads"
        if plan.recomputes:
            assert run.recomputed > 0, f"rank {rank} recomputed nothing of its plan"


@pytest.mark.parametrize(("case", "policy"), RUNS)
def test_each_rank_under_its_plan_stays_within_its_budget(ranks, case, policy):
    """The measured curve without what gloo holds besides the trace (the module's doc) is within the budget
    (the traced peak for a plan made without one)."""
    for rank, (traced, plan, run) in enumerate(ranks[case, policy]):
        names, alloc, released, baseline = _gloo_view(run.measured)
        assert names == [op.name for op in traced.ops], f"rank {rank} ran other ops than its trace"
        traced_released = op_table(traced).release[:, _COMMUNICATION]
        late = np.cumsum(traced_released) - np.cumsum(released[:, 0])  # communication bytes gloo still held
        assert (late >= 0).all(), f"rank {rank} released a communication buffer before the trace did"
        budget = plan.budget_bytes if plan.budget_bytes is not None else traced.peak_bytes
        peak = int((_live(alloc, released, baseline) - late).max())
        assert peak <= budget, f"rank {rank}: {peak} bytes live under a plan for {budget}"


def test_every_case_is_planned_below_its_peak_where_a_policy_can_go_below_it(ranks):
    """The plans act, on feature maps only: at a budget below the peak wherever the least budget is below it."""
    for (case, policy), per_rank in ranks.items():
        for traced, plan, _ in per_rank:
            acts = bool(plan.offloads or plan.recomputes)
            # mlp3's peak is Adam's step, which no plan lowers: auto keeps all, and FSDP's recompute finds no source
            assert acts or (case.startswith("mlp3") and policy != "vdnn-all"), f"{case}, {policy}: no action"
            planned = [o.tensor for o in plan.offloads] + [t for r in plan.recomputes for t in r.tensors]
            # never FSDP's unsharded parameters or a collective's buffer: FSDP frees those by resizing storage
            assert {traced.tensors[t].category for t in planned} <= set(PLANNED_CATEGORIES), f"{case}, {policy}"
            rerun = {traced.ops[i].name for r in plan.recomputes for i in r.ops}
            assert not any(name.startswith("c10d.") for name in rerun), f"{case}, {policy} re-runs a collective"
            if plan.budget_bytes is not None:
                assert plan.budget_bytes < traced.peak_bytes, f"{case}, {policy}"


def _failing_rank(process: int, store: str, out: str, plans: tuple[ul.Plan, ...]) -> None:
    """Two pairs of ranks, each following a plan of its own kind: in each, rank 1 raises in the middle of forward
    under the runtime, and rank 0 finds out from gloo (its peer is gone, or the collective times out); each says
    what it saw: its error, and the hooks left after it."""
    pair, rank = divmod(process, RANKS)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}{pair}", rank=rank, world_size=RANKS,
                            timeout=timedelta(seconds=5))
    try:
        work = _workload("mlp3")
        model = _wrapped(DDP(RANKS), work.model)
        optimizer = same_optimizer(work.optimizer, [{"params": list(model.parameters())}])
        args, kwargs = split_input(work.example_input)
        for _ in range(WARMUP_STEPS):
            run_step(model, args, kwargs, loss_fn=work.loss_fn, target=work.target, optimizer=optimizer)
        if rank == 1:
            middle = model.module.net[2]  # the second of mlp3's three Linear layers
            middle.register_forward_hook(_fail)
        try:
            with OffloadRuntime(plans[pair]):
                run_step(model, args, kwargs, loss_fn=work.loss_fn, target=work.target, optimizer=optimizer)
        except Exception as err:
            seen = (type(err).__name__, str(err)[:200], hooks_left())
            Path(out, f"pair{pair}-rank{rank}.pkl").write_bytes(pickle.dumps(seen))
            raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _fail(*_) -> None:
    raise RuntimeError("rank 1 fails mid-step")


# how gloo tells the surviving rank that its peer is gone, by when the peer's socket closed
GLOO_PEER_GONE = ("closed by peer", "reset by peer", "Timed out")

# (policy, on hooks): how the runtime follows its plan (NOTE [hook points] 4 and 6)
FOLLOWING = {("recompute", False): "op by op", ("recompute", True): "by module and saved-tensor hooks",
             ("vdnn-all", True): "by module and saved-tensor hooks"}


def test_a_rank_that_fails_mid_step_ends_the_other_which_leaves_no_hook(tmp_path):
    """Each way of following a plan (a dispatch mode; global module hooks, with a recording mode in windows) is
    undone on the error path."""
    graph = ul.trace(_workload("mlp3"), parallel=DDP(RANKS))
    plans = tuple(_planned(graph, policy).located(graph, on_hooks=on_hooks) for policy, on_hooks in FOLLOWING)
    for plan, follows in zip(plans, FOLLOWING.values(), strict=True):
        assert (plan.offloads or plan.recomputes) and OffloadRuntime(plan).follows.startswith(follows)
    started = time.monotonic()
    context = spawned(_failing_rank, (str(tmp_path / "store"), str(tmp_path), plans), wait_each=True,
                      processes=RANKS * len(plans))
    assert time.monotonic() - started < RANKS_TIMEOUT_S, "a surviving rank hung until it was killed"
    assert all(p.exitcode != 0 for p in context.processes), "every rank ends with an error"
    for pair, policy in enumerate(FOLLOWING):
        seen = [pickle.loads(Path(tmp_path, f"pair{pair}-rank{rank}.pkl").read_bytes()) for rank in range(RANKS)]
        assert seen[1][1] == "rank 1 fails mid-step"
        assert seen[0][0] == "RuntimeError" and any(says in seen[0][1] for says in GLOO_PEER_GONE), \
            f"{policy}: rank 0 ends by gloo's error, not {seen[0]}"
        assert seen[0][2] == () and seen[1][2] == (), f"{policy}: hooks left after the error: {seen}"


def test_a_recomputation_never_re_runs_a_collective():
    """A rank cannot re-run a collective alone: the replay refuses one before it runs (DDP's buffer broadcast
    opens its forward, so a segment from the start of forward would hold it)."""
    replay = Replay(Recompute((0,), (0, 1), 5))
    replay.refuse(torch.ops.aten.relu.default)
    with pytest.raises(ReplayError, match="collective that every rank calls together"):
        replay.refuse(torch.ops.c10d.broadcast_.default)
