import pytest
import torch

import udnn_lab as ul
from udnn_lab import zoo
from udnn_lab.workload import StepOptions, Workload, as_workload, optimizer_like


def test_a_workload_reads_as_a_short_summary_not_its_tensors():
    work = zoo.get("resnet18", batch=16)
    text = repr(work)
    assert text == ("Workload('resnet18': ResNet, input=float32[16, 3, 224, 224], target=int64[16], "
                    "loss=classification_loss, optimizer=SGD)")
    assert "tensor(" not in text and len(text) < 200


def test_the_summary_names_devices_and_what_holds_the_inputs():
    own = zoo.get(torch.nn.Linear(4, 2), batch=2, input_shape=(4,), optimizer=None)
    assert repr(own) == "Workload('Linear': Linear, input=float32[2, 4], loss=sum of outputs, optimizer=none)"
    on_meta = zoo.get("transformer", batch=2, device="meta")
    assert "input=int64[2, 128] on meta" in repr(on_meta)
    paired = zoo.get(torch.nn.Linear(4, 2), batch=2, input_shape=(4,))
    both = type(paired)(paired.model, {"x": torch.zeros(2, 4), "mask": (torch.ones(2, dtype=torch.bool),)})
    assert "input={x: float32[2, 4], mask: (bool[2])}" in repr(both)


def test_the_summary_shows_the_step_options_that_are_not_the_default():
    work = zoo.get("mlp3", batch=2, precision="bf16-mixed")
    assert repr(work).endswith("optimizer=SGD, precision=bf16-mixed)")
    accumulated = as_workload(work, grad_accumulation=4, clip_grad_norm=1.0)
    assert repr(accumulated).endswith("precision=bf16-mixed, grad_accumulation=4, clip_grad_norm=1.0)")
    assert accumulated.step_options == StepOptions("bf16-mixed", 4, 1.0)


def test_a_workload_carries_how_its_step_is_spread_over_ranks_and_shows_it():
    work = zoo.get("mlp3", batch=2, parallel=ul.FSDP(8))
    assert work.parallel == ul.FSDP(8)
    assert repr(work).endswith("optimizer=SGD, parallel=FSDP(world_size=8))")
    ranked = as_workload(work, parallel=ul.DDP(4, rank=3, bucket_cap_mb=1.0))
    assert repr(ranked).endswith("parallel=DDP(world_size=4, bucket_cap_mb=1.0, rank=3))")
    assert as_workload(torch.nn.Linear(4, 2), torch.zeros(2, 4), parallel=ul.DDP(2)).parallel == ul.DDP(2)
    with pytest.raises(TypeError, match=r"parallel is ul\.DDP\(world_size, \.\.\.\) or ul\.FSDP.*got int"):
        Workload(torch.nn.Linear(4, 2), torch.zeros(2, 4), parallel=8)


@pytest.mark.parametrize("run", [ul.measure, ul.profile])
def test_a_rank_of_a_parallel_step_is_not_run_for_real_in_one_process(run):
    work = zoo.get("mlp3", batch=2, parallel=ul.DDP(2))
    with pytest.raises(ValueError, match=r"one rank of DDP\(world_size=2\).*replace\(work, parallel=None\)"):
        run(work)


def test_a_model_is_taken_in_its_own_dtype_unless_a_precision_is_asked_for():
    model = torch.nn.Linear(4, 2).to(torch.bfloat16)
    assert Workload(model, torch.zeros(2, 4, dtype=torch.bfloat16)).precision == "bf16-true"
    assert as_workload(torch.nn.Linear(4, 2).double(), torch.zeros(2, 4, dtype=torch.float64)).precision == "64-true"
    assert as_workload(torch.nn.Linear(4, 2), torch.zeros(2, 4)).precision == "32-true"


@pytest.mark.parametrize("model, precision, message", [
    (torch.nn.Linear(4, 2), "bf16-true", r"convert the model yourself, model\.to\(torch\.bfloat16\)"),
    (torch.nn.Linear(4, 2).half(), "16-mixed", r"autocast over float32 weights.*model\.float\(\).*'16-true'"),
    (torch.nn.Linear(4, 2), "fp16", "unknown precision 'fp16'"),
])
def test_a_precision_the_model_is_not_in_is_refused_and_the_model_left_alone(model, precision, message):
    dtype = model.weight.dtype
    with pytest.raises(ValueError, match=message):
        Workload(model, torch.zeros(2, 4), precision=precision)
    assert model.weight.dtype == dtype


@pytest.mark.parametrize("options, message", [
    ({"grad_accumulation": 0}, "positive int"), ({"grad_accumulation": 1.5}, "positive int"),
    ({"clip_grad_norm": -1.0}, "positive number"), ({"clip_grad_norm": True}, "positive number"),
])
def test_bad_step_options_say_what_they_take(options, message):
    with pytest.raises(ValueError, match=message):
        StepOptions(**options)


@pytest.mark.parametrize("make", [lambda p: torch.optim.AdamW(p, lr=3e-4, weight_decay=0.1),
                                  lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
                                  lambda p: torch.optim.Adafactor(p, lr=1e-2)])
def test_an_optimizer_like_another_has_its_class_and_settings_and_no_state(make):
    model, other = torch.nn.Linear(3, 3), torch.nn.Linear(3, 3)
    original = make(model.parameters())
    model(torch.randn(2, 3)).sum().backward()
    original.step()
    fresh = optimizer_like(original, other.parameters())
    assert type(fresh) is type(original) and not fresh.state
    shared = set(fresh.defaults) & set(original.defaults)
    assert {key: fresh.defaults[key] for key in shared} == {key: original.defaults[key] for key in shared}
    assert [p for group in fresh.param_groups for p in group["params"]] == list(other.parameters())
