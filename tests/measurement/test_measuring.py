
import re

import pytest
import torch

import udnn_lab as ul
from udnn_lab import zoo
from udnn_lab.errors import LargeMeasurementWarning, TraceMismatch
from udnn_lab.measurement._cost_estimate import LARGE_SECONDS, estimate

# Every zoo model at a small batch; image sides as small as each architecture takes.
ZOO_CASES = [
    ("alexnet", {"image_size": 64}), ("vgg11", {"image_size": 32}), ("vgg16", {"image_size": 32}),
    ("vgg19", {"image_size": 32}), ("googlenet", {"image_size": 64}), ("inception_v3", {}),
    ("inception_v4", {}), ("resnet18", {"image_size": 32}), ("resnet34", {"image_size": 32}),
    ("resnet50", {"image_size": 32}), ("resnet101", {"image_size": 32}), ("resnet152", {"image_size": 32}),
    ("densenet121", {"image_size": 32}), ("densenet201", {"image_size": 32}), ("resnet164", {}),
    ("resnet1001", {}), ("mlp5", {}), ("lstm", {}), ("transformer", {"input_shape": (32,)}),
]


@pytest.mark.parametrize("name, options", ZOO_CASES, ids=[case[0] for case in ZOO_CASES])
def test_predicted_curve_matches_measured_on_cpu(name, options):
    if name == "inception_v4":
        pytest.importorskip("timm")
    graph = ul.trace(zoo.get(name, batch=2, device="meta", **options))
    measured = ul.measure(zoo.get(name, batch=2, **options), repeats=0, graph=graph)
    summary = measured.summary(graph)
    assert summary["ops"] == len(graph.ops)
    assert summary["peak_relative_error"] <= 0.01, summary
    assert summary["max_step_relative_error"] <= 0.01, summary


def test_measurement_is_a_real_run_of_the_same_step():
    work = zoo.get("mlp3", batch=4)
    measured = ul.measure(work, repeats=2)
    assert measured.device == "cpu" and measured.device_name and measured.measured_at
    assert measured.step_time_s > 0 and len(measured.step_times_s) == 2
    assert measured.cuda is None and measured.nvml_before is None
    curve = measured.curve()
    assert len(curve) == len(measured.ops) and curve["live_bytes"].max() == measured.peak_bytes
    assert "mlp3" in repr(measured)


class _CountingMLP(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 2)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return self.layer(x)


def test_by_default_one_warm_up_step_and_one_recorded_step_run():
    model = _CountingMLP()
    work = zoo.get(model, batch=2, input_shape=(4,))
    graph = ul.trace(work)
    model.calls = 0
    measured = ul.measure(work, graph=graph)
    assert model.calls == 2 and measured.step_time_s is None and "untimed" in repr(measured)
    ul.measure(work, graph=graph, warmup=0, repeats=2)
    assert model.calls == 2 + 3
    with pytest.raises(ValueError, match="repeats"):
        ul.measure(work, graph=graph, repeats=-1)


def test_a_small_step_is_measured_without_a_warning_or_a_bar(capsys, recwarn):
    ul.measure(zoo.get("mlp3", batch=4))
    assert not [w for w in recwarn if issubclass(w.category, LargeMeasurementWarning)]
    assert "measuring" not in capsys.readouterr().err


def test_progress_can_be_asked_for(capsys):
    ul.measure(zoo.get("mlp3", batch=4), progress=True, repeats=1)
    assert "measuring mlp3" in capsys.readouterr().err


def test_a_large_cpu_step_is_announced_with_its_time_and_memory():
    graph = ul.trace(zoo.get("resnet50", batch=256, device="meta"))
    cost = estimate(graph, plain_steps=1, device=torch.device("cpu"))
    assert cost.step_flops > 1e12  # ResNet-50 at batch 256: about 3 x 4 GFLOP x 256 a step, minutes on any CPU
    assert cost.seconds > LARGE_SECONDS and cost.large
    assert cost.peak_bytes == graph.peak_bytes > 4 << 30
    message = cost.message()
    assert "2 real steps" in message and "GFLOP" in message and ul.format_bytes(graph.peak_bytes) in message
    small = estimate(ul.trace(zoo.get("mlp3", batch=4)), plain_steps=1, device=torch.device("cpu"))
    assert not small.large and small.seconds < 0.1


def test_measure_warns_before_a_large_step_runs():
    work = zoo.get("mlp3", batch=4)
    calls = []
    big = ul.trace(zoo.get("resnet50", batch=256, device="meta"))

    def loss_fn(output, target):
        calls.append(1)
        return torch.nn.functional.cross_entropy(output, target)

    # the estimate comes from the graph given (ResNet-50 at batch 256), before any step of mlp3 runs
    with pytest.warns(LargeMeasurementWarning, match="resnet50"):
        ul.measure(work, loss_fn=loss_fn, graph=big, warmup=0, progress=False)
    assert calls  # the step still ran after the warning


def test_measure_restores_the_model_and_optimizer():
    work = zoo.get("mlp3", batch=4)
    before = {k: v.clone() for k, v in work.model.state_dict().items()}
    ul.measure(work, repeats=1)
    for key, value in work.model.state_dict().items():
        assert torch.equal(value, before[key])
    assert all(p.grad is None for p in work.model.parameters())
    assert len(work.optimizer.state) == 0
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in work.model.modules())


def test_measure_restores_even_when_the_step_fails():
    work = zoo.get("mlp3", batch=4)
    before = {k: v.clone() for k, v in work.model.state_dict().items()}
    calls = []

    def failing_loss(output, target):
        calls.append(1)
        if len(calls) > 1:  # the warm-up step succeeds and changes the weights; the next one fails
            raise RuntimeError("boom")
        return torch.nn.functional.cross_entropy(output, target)

    with pytest.raises(RuntimeError, match="boom"):
        ul.measure(work, loss_fn=failing_loss, repeats=1)
    for key, value in work.model.state_dict().items():
        assert torch.equal(value, before[key])
    assert len(work.optimizer.state) == 0


def test_a_different_step_is_reported_as_a_mismatch():
    graph = ul.trace(zoo.get("mlp3", batch=4))
    other = ul.measure(zoo.get("mlp4", batch=4), repeats=0)
    with pytest.raises(TraceMismatch, match="differ at op|ops"):
        other.compare(graph)


def test_meta_models_cannot_be_measured():
    with pytest.raises(ValueError, match="meta"):
        ul.measure(zoo.get("mlp3", batch=2, device="meta"))


def test_nvml_is_unavailable_without_a_driver_and_says_why():
    from udnn_lab.measurement import nvml

    reading = nvml.read()
    if reading.available:
        pytest.skip("this machine has an NVIDIA driver")
    assert reading.reason and reading.used_bytes is None


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["resnet50", "densenet121", "vgg16", "inception_v3"])
def test_cuda_prediction_matches_allocated_memory(name):
    options = {} if name == "inception_v3" else {"image_size": 224}
    graph = ul.trace(zoo.get(name, batch=8, device="meta", **options), device="cuda")
    measured = ul.measure(zoo.get(name, batch=8, device="cuda", **options), repeats=1)
    summary = measured.summary(graph)
    assert measured.nvml_before is not None
    assert summary["peak_relative_error"] <= 0.03, summary


def test_a_loss_that_keeps_its_elementwise_buffer_is_traced_at_its_real_size():
    """The CPU's mse_loss returns a 0-dim view into the full elementwise buffer: the trace sizes it by a probe."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(128, 256), torch.nn.Tanh(), torch.nn.Linear(256, 128))
    x = torch.randn(256, 128)
    work = ul.Workload(model, x, target=x.clone(), loss_fn=torch.nn.functional.mse_loss)
    graph = ul.trace(work)
    assert any(t.nbytes == 256 * 128 * 4 and not t.shape for t in graph.tensors)  # the 0-dim loss, at full size
    summary = ul.measure(work, repeats=0).summary(graph)
    assert summary["peak_relative_error"] == 0 and summary["max_step_relative_error"] == 0, summary


def test_the_progress_bar_counts_whole_steps_and_names_the_recorded_step_s_ops(capsys):
    ul.measure(zoo.get("mlp3", batch=2), warmup=1, progress=True)
    err = capsys.readouterr().err
    assert re.search(r"\b\d+/2 \[", err) and not re.search(r"\d\.\d+/2\b", err), err  # 1/2, never 1.0185/2
    assert re.search(r"recording op \d+/\d+", err), err


class _UnusedHead(torch.nn.Module):
    """A head the loss never reaches (GoogLeNet's aux heads in training, a branch left unused): it gets no
    gradient, so a PyTorch optimizer keeps no state for it."""

    def __init__(self) -> None:
        super().__init__()
        self.body, self.unused = torch.nn.Linear(16, 16), torch.nn.Linear(16, 256)

    def forward(self, x):
        return self.body(x)


def test_a_step_measured_without_a_warm_up_gives_state_only_to_parameters_with_a_gradient():
    model = _UnusedHead()
    work = ul.Workload(model, torch.randn(4, 16), optimizer=torch.optim.AdamW(model.parameters()))
    graph = ul.trace(work)
    assert graph.graded_parameters == {"body.weight", "body.bias"}
    for warmup in (0, 1):  # state made from the trace's graded parameters, or by a real step
        measured = ul.measure(work, graph=graph, warmup=warmup)
        assert max(measured.live_bytes) == graph.peak_bytes
