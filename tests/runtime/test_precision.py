"""The runtime under today's steps: autocast's casts and the GradScaler keep the run in step with the plan,
and gradients stay exactly eager's; train runs the step trace and measure run."""

import copy

import pytest
import torch

import udnn_lab as ul
from udnn_lab import zoo
from udnn_lab.analysis.step import grad_scaler, run_step, split_input
from udnn_lab.runtime import OffloadRuntime

CPU = ul.Hardware.load("cpu-amd-epyc-2cpu")
SMALL_GPT2 = {"small": True, "seq_len": 32}


def _step(model, work, runtime=None):
    """One step of a fresh optimizer and GradScaler, seeded (GPT-2's dropout)."""
    args, kwargs = split_input(work.example_input)
    optimizer = type(work.optimizer)(model.parameters(), lr=1e-3)
    scaler = grad_scaler(work.step_options, torch.device("cpu"))
    torch.manual_seed(0)
    with runtime if runtime is not None else OffloadRuntime(None):
        _, loss = run_step(model, args, kwargs, loss_fn=work.loss_fn, target=work.target, optimizer=optimizer,
                           options=work.step_options, scaler=scaler)
    return loss.detach(), [p.grad for p in model.parameters()], [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("precision, step, policy, by_hooks", [
    ("bf16-mixed", {}, "vdnn-all", True),
    ("16-mixed", {"clip_grad_norm": 1.0}, "vdnn-all", True),
    ("16-mixed", {"grad_accumulation": 2, "clip_grad_norm": 1.0}, "recompute", True),
])
def test_the_runtime_is_exact_under_autocast_and_the_grad_scaler(precision, step, policy, by_hooks):
    pytest.importorskip("transformers")
    work = ul.workload.as_workload(zoo.get("hf:gpt2", batch=2, precision=precision, **SMALL_GPT2), **step)
    chosen = ul.plan(ul.trace(work), None, policy, hardware=CPU)
    assert chosen.offloads or chosen.recomputes
    loss, grads, params = _step(copy.deepcopy(work.model), work)
    runtime = OffloadRuntime(chosen)
    loss_b, grads_b, params_b = _step(copy.deepcopy(work.model), work, runtime)
    assert torch.isfinite(loss) and all(torch.isfinite(g).all() for g in grads)  # a step that was not skipped
    assert torch.equal(loss, loss_b)
    assert all(torch.equal(a, b) for a, b in zip(grads, grads_b))
    assert all(torch.equal(a, b) for a, b in zip(params, params_b))
    # followed by its module and saved-tensor hooks, every call (autocast's casts, the scaled loss) as traced
    assert runtime.last_step.by_hook_events == by_hooks
    assert runtime.last_step.d2h_bytes > 0 if chosen.offloads else runtime.last_step.recomputed > 0


def test_training_under_a_plan_matches_plain_training_with_a_grad_scaler():
    precision = "16-mixed"  # one GradScaler across the run's steps (bf16-mixed: the test above)
    work = zoo.get("resnet20", batch=2, precision=precision)
    chosen = ul.plan(ul.trace(work), None, "vdnn-all", hardware=CPU)
    batches = [(work.example_input, work.target)] * 3
    plain, planned = copy.deepcopy(work.model), copy.deepcopy(work.model)
    runs = [ul.train(model, batches, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
                     loss_fn=work.loss_fn, plan=plan, progress=False, precision=precision)
            for model, plan in ((plain, None), (planned, chosen))]
    assert all(torch.equal(a, b) for a, b in zip(plain.parameters(), planned.parameters()))
    assert (runs[1].steps["d2h_bytes"] > 0).all() and runs[1].options.precision == precision


def test_a_step_takes_grad_accumulation_batches():
    work = zoo.get("mlp3", batch=4)
    accumulated, reference = copy.deepcopy(work.model), copy.deepcopy(work.model)
    batches = [(work.example_input, work.target)] * 5
    run = ul.train(accumulated, batches, torch.optim.SGD(accumulated.parameters(), lr=0.1), loss_fn=work.loss_fn,
                   grad_accumulation=2, clip_grad_norm=0.5, progress=False)
    assert len(run.steps) == 2 and run.stopped == "batches"  # the fifth batch alone does not make a step
    assert (run.options.grad_accumulation, run.options.clip_grad_norm) == (2, 0.5)
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    for _ in range(2):  # the same micro-batch twice: the mean of two equal losses
        optimizer.zero_grad()
        work.loss_fn(reference(work.example_input), work.target).backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.5)
        optimizer.step()
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(accumulated.parameters(), reference.parameters()))


@pytest.mark.parametrize("options", [{"grad_accumulation": 2}, {"clip_grad_norm": 1.0}, {"precision": "16-mixed"}])
def test_an_optimizer_fused_into_backward_cannot_accumulate_clip_or_unscale(options):
    work = zoo.get("mlp3", batch=4)
    with pytest.raises(ValueError, match="fuse_optimizer"):
        ul.train(work.model, [(work.example_input, work.target)], work.optimizer, loss_fn=work.loss_fn,
                 fuse_optimizer=True, progress=False, **options)


def test_a_model_in_another_precision_is_refused_not_converted():
    work = zoo.get("mlp3", batch=4)
    with pytest.raises(ValueError, match=r"model\.to\(torch\.bfloat16\)"):
        ul.train(work.model, [(work.example_input, work.target)], work.optimizer, precision="bf16-true",
                 progress=False)
    assert all(p.dtype == torch.float32 for p in work.model.parameters())


@pytest.mark.parametrize("policy", ["vdnn-all", "recompute"])
def test_autocast_s_weight_copies_are_offloaded_or_rebuilt_and_gradients_stay_eager_s(policy):
    pytest.importorskip("transformers")
    work = zoo.get("hf:llama-3-8b", batch=2, precision="bf16-mixed", **SMALL_GPT2)
    graph = ul.trace(work)
    chosen = ul.plan(graph, None, policy, hardware=CPU)
    acted = {o.tensor for o in chosen.offloads} | {t for r in chosen.recomputes for t in r.tensors}
    assert any(graph.tensors[t].category == "weight_cast" for t in acted)
    loss, grads, params = _step(copy.deepcopy(work.model), work)
    loss_b, grads_b, params_b = _step(copy.deepcopy(work.model), work, OffloadRuntime(chosen))
    assert torch.equal(loss, loss_b) and all(torch.equal(a, b) for a, b in zip(grads, grads_b))
    assert all(torch.equal(a, b) for a, b in zip(params, params_b))
