"""The step as today's users run it, traced: precision (autocast, GradScaler, true half precision), the
optimizer's kernels, gradient clipping and accumulation."""

import pytest
import torch
from torch import nn

import udnn_lab as ul
from udnn_lab import zoo
from udnn_lab.analysis._substitution import CPU_AUTOCAST_NOTE
from udnn_lab.analysis.step import grad_scaler, run_step, split_input
from udnn_lab.errors import FakeTensorUnsupported
from udnn_lab.workload import StepOptions


def _names(graph, phase=None, module=None):
    return [op.name for op in graph.ops if (phase is None or op.phase == phase)
            and (module is None or op.module == module)]


def _first(graph, module):
    return next(op.index for op in graph.ops if op.module == module)


def test_autocast_copies_of_the_weights_are_their_own_category():
    work = zoo.get("mlp3", batch=4, device="meta", precision="bf16-mixed")
    graph = ul.trace(work)
    casts = [t for t in graph.tensors if t.category == "weight_cast"]
    parameters = {t.name: t for t in graph.tensors if t.category == "parameter"}
    assert len(casts) == len(parameters) == 6 and all(t.dtype == "bfloat16" for t in casts)
    for cast in casts:  # each made in forward by a cast of one parameter, at half its size
        producer = graph.ops[cast.producer]
        assert producer.phase == "forward" and producer.name == "aten._to_copy.default"
        [source] = [graph.tensors[i] for i in producer.inputs]
        assert source.category == "parameter" and cast.nbytes * 2 == source.nbytes
    backward = next(op.index for op in graph.ops if op.phase == "backward")
    saved = [t.name for t in casts if t.saved]
    # the matmuls of the layers that pass a gradient on save their weights' casts for backward; autocast's cache
    # lets every other cast go when forward (and autocast) ends
    assert [graph.tensors[i].shape for i in (graph.ops[graph.tensor(name).producer].inputs[0] for name in saved)] \
        == [(1024, 1024), (10, 1024)]
    assert all(t.free_step >= backward for t in casts if t.saved)
    assert all(t.free_step == backward - 1 for t in casts if not t.saved)
    breakdown = graph.breakdown()
    assert breakdown.loc["weight_cast", "max_bytes"] == sum(t.nbytes for t in casts)
    assert "weight_cast" in graph.memory_curve()
    plain = ul.trace(zoo.get("mlp3", batch=4, device="meta"))
    assert not any(t.category == "weight_cast" for t in plain.tensors)
    true_half = ul.trace(zoo.get("mlp3", batch=4, device="meta", precision="bf16-true"))
    assert not any(t.category == "weight_cast" for t in true_half.tensors)
    assert all(t.dtype == "bfloat16" for t in true_half.tensors if t.category in ("parameter", "optimizer_state")
               and t.shape)  # weights and momentum in bfloat16 (the step counter aside)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU kernels stand in for CUDA ones only without a GPU")
def test_cpu_kernels_standing_in_for_cuda_say_autocast_ran_the_cpu_lists():
    mixed = ul.trace(zoo.get("mlp3", batch=4, device="meta", precision="bf16-mixed"), device="cuda")
    assert CPU_AUTOCAST_NOTE in mixed.notes and mixed.device == "cuda"
    plain = ul.trace(zoo.get("mlp3", batch=4, device="meta"), device="cuda")
    assert CPU_AUTOCAST_NOTE not in plain.notes


@pytest.mark.parametrize("optimizer", ["sgd", "adamw-fused"])
def test_the_grad_scaler_is_part_of_the_16_mixed_step(optimizer):
    graph = ul.trace(zoo.get("mlp3", batch=4, device="meta", precision="16-mixed", optimizer=optimizer))
    scale = graph.tensor("grad_scaler.scale")
    assert (scale.category, scale.nbytes, scale.dtype, scale.alloc_step) == ("optimizer_state", 4, "float32", -1)
    assert graph.tensor("grad_scaler.growth_tracker").category == "optimizer_state"
    assert any(op.name == "aten.mul.Tensor" and scale.id in op.inputs for op in graph.ops
               if op.phase == "forward" and op.module == "<loss>")  # the scaled loss
    scaler_ops = _names(graph, "optimizer", "<grad scaler>")
    assert "aten._amp_update_scale_.default" in scaler_ops
    stepping = _names(graph, "optimizer", "<optimizer>")
    if optimizer == "sgd":  # unscaled, checked on the host (the steady step: no inf), then stepped
        assert "aten._amp_foreach_non_finite_check_and_unscale_.default" in scaler_ops
        assert "aten._local_scalar_dense.default" in stepping and "aten.add_.Tensor" in stepping
    else:  # a fused optimizer unscales in its own kernel, and the scaler does not read on the host
        assert "aten._amp_foreach_non_finite_check_and_unscale_.default" not in scaler_ops
        assert "aten._fused_adamw_.default" in stepping and "aten._local_scalar_dense.default" not in stepping


def test_clipping_holds_a_norm_per_gradient_beside_them_all_and_follows_the_unscaling():
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(4, 4, bias=False) for _ in range(64)])  # many gradients, tiny activations
    work = ul.Workload(model, torch.randn(1, 4), optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    plain = ul.trace(work)
    clipped = ul.trace(work, clip_grad_norm=1.0)
    clip_ops = [op.index for op in clipped.ops if op.module == "<clip grad norm>"]
    assert {"aten._foreach_norm.Scalar", "aten._foreach_mul_.Tensor"} <= {clipped.ops[i].name for i in clip_ops}
    # (as the real step: clip_grad_norm_(foreach=None) would norm fake gradients one at a time)
    assert [op.name for op in clipped.ops if op.module != "<clip grad norm>"] == [op.name for op in plain.ops]
    curve = clipped.memory_curve()
    gradients = sum(t.nbytes for t in plain.tensors if t.category == "parameter_gradient")
    assert (curve["parameter_gradient"][clip_ops] == gradients).all()
    extra = curve["live_bytes"][clip_ops].max() - curve["live_bytes"][clip_ops[0] - 1]
    assert 64 * 4 < extra <= 4 * (2 * 64 + 4)  # float32 norms of the 64 gradients, their stack, a few scalars
    assert clipped.peak_bytes == max(plain.peak_bytes, curve["live_bytes"][clip_ops].max()) > plain.peak_bytes
    assert clipped.ops[clipped.peak_step].module == "<clip grad norm>"
    mixed = ul.trace(zoo.get("mlp3", batch=4, device="meta", precision="16-mixed"), clip_grad_norm=1.0)
    assert _first(mixed, "<grad scaler>") < _first(mixed, "<clip grad norm>") < _first(mixed, "<optimizer>")


def test_accumulation_runs_each_micro_batch_and_adds_into_the_gradients():
    one = ul.trace(zoo.get("mlp3", batch=4, device="meta"))
    two = ul.trace(zoo.get("mlp3", batch=4, device="meta"), grad_accumulation=2)
    runs = []
    for op in two.ops:
        if not runs or runs[-1][0] != op.phase:
            runs.append((op.phase, []))
        runs[-1][1].append(op)
    assert [phase for phase, _ in runs] == ["forward", "backward", "forward", "backward", "optimizer"]
    assert [op.name for op in runs[0][1]] == [op.name for op in runs[2][1]]
    assert [op.name for op in runs[0][1]] == [op.name for op in one.ops if op.phase == "forward"] + \
        ["aten.div.Tensor"]  # each micro-batch's loss is divided by their number
    gradients = [t for t in two.tensors if t.category == "parameter_gradient"]
    second = {op.index for op in runs[3][1]}
    for grad in gradients:  # made by the first backward; the second adds into it in place
        assert grad.producer in {op.index for op in runs[1][1]}
        assert any(i in second and two.ops[i].name == "aten.add_.Tensor" for i in grad.consumers)
    start = runs[3][1][0].index
    assert two.memory_curve()["parameter_gradient"][start] == sum(t.nbytes for t in gradients)
    assert two.peak_bytes >= one.peak_bytes
    assert not any("forward holders" in note for note in two.notes)
    held = [t for t in two.tensors if t.forward_release is not None]
    assert any(t.producer >= runs[2][1][0].index for t in held)  # the second forward's releases are known too
    for t in held:
        run = next(ops for phase, ops in runs if phase == "forward" and ops[0].index <= t.producer <= ops[-1].index)
        assert run[0].index <= t.forward_release <= run[-1].index


def test_accumulating_a_micro_batch_twice_gives_its_gradient():
    work = zoo.get("mlp3", batch=4)
    args, kwargs = split_input(work.example_input)
    grads = []
    for micro_batches in (1, 2):
        run_step(work.model, args, kwargs, loss_fn=work.loss_fn, target=work.target,
                 options=StepOptions(grad_accumulation=micro_batches))
        grads.append([p.grad.clone() for p in work.model.parameters()])
    assert all(torch.allclose(a, b, atol=1e-7) for a, b in zip(*grads))


def test_the_optimizer_runs_the_kernels_the_real_step_would():
    def optimizer_ops(name, device=None):
        return set(_names(ul.trace(zoo.get("mlp3", batch=4, device="meta", optimizer=name), device=device),
                          "optimizer"))

    assert not any(name.startswith("aten._foreach") for name in optimizer_ops("adamw"))  # PyTorch's choice on a CPU
    assert "aten._foreach_mul_.Scalar" in optimizer_ops("adamw", device="cuda")  # and for CUDA tensors
    assert "aten._foreach_mul_.Scalar" in optimizer_ops("adamw-foreach")
    assert "aten._fused_adamw_.default" in optimizer_ops("adamw-fused")
    graph = ul.trace(zoo.get("mlp3", batch=4, device="meta", optimizer="adafactor"))
    weight = graph.tensor("net.0.weight")  # 1024 x 784: Adafactor keeps a row and a column of statistics
    assert graph.tensor("net.0.weight.row_var").shape == (1024, 1)
    assert graph.tensor("net.0.weight.col_var").shape == (1, 784)
    assert weight.shape == (1024, 784)
    assert "aten._local_scalar_dense.default" in _names(graph, "optimizer")  # its norms, read on the host


def test_a_value_read_in_forward_still_stops_a_fake_trace():
    class ReadsItsInput(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            return self.fc(x) * x.abs().max().item()

    with pytest.raises(FakeTensorUnsupported):
        ul.trace(ReadsItsInput(), torch.randn(2, 4), precision="bf16-mixed")


def test_16_mixed_needs_its_scaler_and_the_scaler_is_made_ready():
    work = zoo.get("mlp3", batch=4, precision="16-mixed")
    args, kwargs = split_input(work.example_input)
    with pytest.raises(ValueError, match="GradScaler"):
        run_step(work.model, args, kwargs, loss_fn=work.loss_fn, target=work.target, options=work.step_options)
    scaler = grad_scaler(work.step_options, torch.device("cpu"))
    assert scaler is not None and scaler.get_scale() == 2.0 ** 16
    assert grad_scaler(StepOptions("bf16-mixed"), torch.device("cpu")) is None
