import copy
import threading

import torch

import udnn_lab as ul
from udnn_lab import zoo


def _batches(work, count):
    return [(work.example_input, work.target)] * count


def _optimizer(model):
    return torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)


def test_a_run_has_one_row_per_step():
    work = zoo.get("mlp3", batch=8)
    run = ul.train(work.model, _batches(work, 10), work.optimizer, loss_fn=work.loss_fn, steps=4, progress=False)
    assert list(run.steps["step"]) == [0, 1, 2, 3] and run.stopped == "steps"
    assert (run.steps["time_s"] > 0).all() and (run.steps["peak_bytes"] > 0).all()
    assert run.steps["loss"].iloc[-1] < run.steps["loss"].iloc[0]
    assert "4 steps" in repr(run)


def test_training_under_a_plan_matches_plain_training():
    work = zoo.get("resnet18", batch=4, image_size=32)
    chosen = ul.plan(ul.trace(work), None, "vdnn-all", hardware="cpu-amd-epyc-2cpu")
    plain, planned = copy.deepcopy(work.model), copy.deepcopy(work.model)
    ul.train(plain, _batches(work, 3), _optimizer(plain), loss_fn=work.loss_fn, progress=False)
    run = ul.train(planned, _batches(work, 3), _optimizer(planned), loss_fn=work.loss_fn, plan=chosen, progress=False)
    assert all(torch.equal(a, b) for a, b in zip(plain.parameters(), planned.parameters()))
    assert (run.steps["d2h_bytes"] > 0).all() and run.policy == "vdnn-all"


def test_stop_from_another_thread_leaves_the_model_trainable():
    work = zoo.get("mlp3", batch=8)
    stop = threading.Event()
    seen = []

    def after_two(row):
        seen.append(row["step"])
        if row["step"] == 1:
            stop.set()

    result = {}
    worker = threading.Thread(target=lambda: result.update(run=ul.train(
        work.model, _batches(work, 1000), work.optimizer, loss_fn=work.loss_fn, callbacks=[after_two], stop=stop,
        progress=False)))
    worker.start()
    worker.join(timeout=60)
    run = result["run"]
    assert run.stopped == "stop requested" and len(run.steps) == 2
    work.loss_fn(work.model(work.example_input), work.target).backward()  # still a plain, trainable model
    assert torch._C._len_torch_dispatch_stack() == 0


def test_a_callback_can_stop_the_run():
    work = zoo.get("mlp3", batch=8)
    run = ul.train(work.model, _batches(work, 50), work.optimizer, loss_fn=work.loss_fn,
                   callbacks=[lambda row: row["step"] < 2], progress=False)
    assert run.stopped == "callback" and len(run.steps) == 3


def test_fused_optimizer_updates_the_same_and_frees_gradients():
    work = zoo.get("mlp4", batch=16)
    plain, fused = copy.deepcopy(work.model), copy.deepcopy(work.model)
    plain_optimizer, fused_optimizer = _optimizer(plain), _optimizer(fused)
    a = ul.train(plain, _batches(work, 3), plain_optimizer, loss_fn=work.loss_fn, progress=False)
    b = ul.train(fused, _batches(work, 3), fused_optimizer, loss_fn=work.loss_fn, fuse_optimizer=True,
                 progress=False)
    assert all(torch.equal(x, y) for x, y in zip(plain.parameters(), fused.parameters()))
    assert all(p.grad is None for p in fused.parameters())
    assert fused_optimizer.state  # the user's optimizer holds the state the fused steps built
    gradient_bytes = sum(p.numel() * p.element_size() for p in plain.parameters())
    saved = a.steps["peak_bytes"].iloc[-1] - b.steps["peak_bytes"].iloc[-1]
    assert saved >= 0.5 * gradient_bytes  # most parameter-gradient memory is never held at once
    assert b.fused_optimizer and not any(p._post_accumulate_grad_hooks for p in fused.parameters())
