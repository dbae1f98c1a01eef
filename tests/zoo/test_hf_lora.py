"""LoRA through PEFT: frozen weights counted as weights, gradients and optimizer state for the adapters alone."""

import copy
import sys

import pytest
import torch
from torch import nn

import udnn_lab as ul
from udnn_lab import zoo
from udnn_lab.analysis.step import run_step, split_input
from udnn_lab.errors import MissingDependency
from udnn_lab.runtime import OffloadRuntime
from udnn_lab.zoo import hf_configs, hf_lora

transformers = pytest.importorskip("transformers", reason="Hugging Face models need udnn_lab[hf] (transformers)")
peft = pytest.importorskip("peft", reason="LoRA needs udnn_lab[hf] (peft)")

CPU = ul.Hardware.load("cpu-amd-epyc-2cpu")
MOE = {"hf:qwen1.5-moe-a2.7b", "hf:mixtral-8x7b"}  # their experts trace in bfloat16 only (see test_zoo_hf.py)
FAMILIES = list({hf_configs.spec(name).model_class: name for name in reversed(hf_configs.names())}.values())[::-1]


def _small(name, **options):
    """Small configs, with feature maps over vdnn-all's size floor (64 KiB): 128 tokens, or 64x64 images."""
    length = {"config_overrides": {"image_size": 64}} if "vit" in name else {"seq_len": 128}
    dtype = {"dtype": torch.bfloat16} if name in MOE else {}
    return {"batch": 2, "small": True, "lora_rank": 4, **length, **dtype, **options}


def _trainable(model):
    return {name for name, p in model.named_parameters() if p.requires_grad}


def _with_random_adapters(work):
    """PEFT starts lora_B at zero, so lora_A's gradient is zero: random values make the comparison bite."""
    with torch.no_grad():
        for name, p in work.model.named_parameters():
            if "lora_B" in name:
                p.normal_(generator=torch.Generator().manual_seed(len(name)))
    return work


def _step(model, work, trainable, runtime=None):
    args, kwargs = split_input(work.example_input)
    optimizer = torch.optim.AdamW([p for n, p in model.named_parameters() if n in trainable], lr=1e-3)  # the zoo's
    torch.manual_seed(0)
    with runtime if runtime is not None else OffloadRuntime(None):
        _, loss = run_step(model, args, kwargs, loss_fn=work.loss_fn, optimizer=optimizer)
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("name", FAMILIES)
def test_lora_on_each_family_is_predicted_exactly_and_trains_the_adapters_alone(name):
    graph = ul.trace(zoo.get(name, device="meta", **_small(name)))
    work = _with_random_adapters(zoo.get(name, **_small(name)))
    summary = ul.measure(work, repeats=0, graph=graph).summary(graph)
    assert summary["peak_relative_error"] == 0 and summary["max_step_relative_error"] == 0, summary

    trainable = _trainable(work.model)
    assert trainable and all("lora_A" in n or "lora_B" in n for n in trainable)
    in_optimizer = {id(p) for group in work.optimizer.param_groups for p in group["params"]}
    assert in_optimizer == {id(p) for p in work.model.parameters() if p.requires_grad}
    by_category = {}
    for tensor in graph.tensors:
        by_category.setdefault(tensor.category, []).append(tensor)
    assert {t.name for t in by_category["parameter_gradient"]} == {f"grad:{n}" for n in trainable}
    assert {t.name.rsplit(".", 1)[0] for t in by_category["optimizer_state"]} == trainable  # AdamW: step, moments
    weights = {id(p): p.numel() * p.element_size() for p in work.model.parameters()}  # tied weights once
    assert sum(t.nbytes for t in by_category["parameter"]) == sum(weights.values())  # frozen ones included

    plan = ul.plan(graph, None, "vdnn-all", hardware=CPU)
    assert plan.offloads, "vdnn-all offloads nothing: the comparison would not test the runtime"
    loss, grads = _step(copy.deepcopy(work.model), work, trainable)
    loss_b, grads_b = _step(copy.deepcopy(work.model), work, trainable, OffloadRuntime(plan))
    assert torch.equal(loss, loss_b)
    assert {n for n, g in grads.items() if g is not None} == trainable
    assert all(grads[n].abs().sum() > 0 and torch.equal(grads[n], grads_b[n]) for n in trainable)
    assert all(grads_b[n] is None for n in grads if n not in trainable)


def test_lora_keeps_the_optimizer_state_and_gradients_of_full_size_llama_to_its_adapters():
    # one layer of the published Llama-3-8B shape: PEFT's default targets, q_proj (4096 -> 4096) and v_proj
    # (4096 -> 1024 with 8 KV heads), so rank 16 trains 16 * (4096 + 4096) + 16 * (4096 + 1024) per layer
    work = zoo.get("hf:llama-3-8b", batch=1, seq_len=64, device="meta", lora_rank=16,
                   config_overrides={"num_hidden_layers": 1})
    trainable = sum(p.numel() for p in work.model.parameters() if p.requires_grad)
    assert trainable == 16 * (4096 + 4096) + 16 * (4096 + 1024) == 212_992  # x 32 layers: PEFT's 6,815,744
    graph = ul.trace(work)
    breakdown = graph.breakdown()
    assert breakdown.loc["parameter_gradient", "max_bytes"] == 4 * trainable
    optimizer_state = sum(t.nbytes for t in graph.tensors if t.category == "optimizer_state")
    assert optimizer_state == 2 * 4 * trainable + 4 * 4  # AdamW's two moments, and a step count per adapter weight
    assert breakdown.loc["parameter", "max_bytes"] == 4 * sum(p.numel() for p in work.model.parameters())
    assert work.name == "hf:llama-3-8b (sdpa attention, LoRA r=16)" and "LoRA r=16" in repr(work)


def test_the_default_targets_are_peft_s_own_for_each_architecture():
    from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as PEFT_TARGETS

    for name in hf_configs.names():
        spec = hf_configs.spec(name)
        model_type = hf_configs.config(name, small=True).model_type
        if model_type in PEFT_TARGETS:
            assert list(spec.lora_targets) == list(PEFT_TARGETS[model_type]), name
        wrapped = zoo.get(name, device="meta", optimizer=None, **_small(name)).model
        adapted = {n.split(".")[-4] for n in _trainable(wrapped)}  # '...attn.c_attn.lora_A.default.weight'
        assert adapted and adapted <= set(spec.lora_targets), name


def test_lora_settings_reach_peft():
    work = zoo.get("hf:llama-3-8b", device="meta", optimizer=None, lora_alpha=32,
                   lora_target_modules=("q_proj", "k_proj", "v_proj", "o_proj"), **_small("hf:llama-3-8b"))
    config = work.model.peft_config["default"]
    assert (config.r, config.lora_alpha, set(config.target_modules)) == (4, 32, {"q_proj", "k_proj", "v_proj",
                                                                                "o_proj"})
    assert len(_trainable(work.model)) == 2 * 4 * 2  # 2 layers, 4 projections, A and B
    everything = zoo.get("hf:gpt2", device="meta", optimizer=None, lora_target_modules="all-linear",
                         **_small("hf:gpt2")).model
    assert {n.split(".")[-4] for n in _trainable(everything)} == {"c_attn", "c_proj", "c_fc"}


@pytest.mark.parametrize("options, message", [
    ({"lora_rank": 0}, "lora_rank must be a positive int"),
    ({"lora_rank": 2.5}, "lora_rank must be a positive int"),
    ({"lora_rank": None, "lora_alpha": 16}, "give lora_rank too"),
    ({"lora_alpha": -1}, "lora_alpha must be a positive number"),
    ({"lora_target_modules": []}, "must be module names"),
    ({"lora_target_modules": ["qproj"]}, "names no module of llama-3-8b; its linear layers are named"),
])
def test_bad_lora_settings_say_what_to_give(options, message):
    with pytest.raises(ValueError, match=message):
        zoo.get("hf:llama-3-8b", device="meta", **_small("hf:llama-3-8b", **options))


def test_lora_is_for_hf_models_and_a_missing_peft_says_how_to_install_it(monkeypatch):
    with pytest.raises(ValueError, match="lora_rank is for Hugging Face models"):
        zoo.get("mlp2", batch=1, lora_rank=8)
    monkeypatch.setitem(sys.modules, "peft", None)
    with pytest.raises(MissingDependency, match="pip install 'udnn_lab\\[hf\\]'"):
        zoo.get("hf:gpt2", device="meta", **_small("hf:gpt2"))


def test_your_own_peft_model_with_an_optimizer_over_every_parameter_traces_exactly():
    config = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=100, n_positions=64)
    torch.manual_seed(0)
    model = peft.get_peft_model(transformers.GPT2LMHeadModel(config), peft.LoraConfig(
        r=4, target_modules=["c_attn", "c_proj"], fan_in_fan_out=True)).train()
    ids = torch.randint(100, (2, 16))
    # every parameter given to AdamW, as many scripts do: it skips those whose gradient stays None
    work = ul.Workload(model, {"input_ids": ids, "labels": ids.clone()}, loss_fn=zoo.hf.output_loss,
                       optimizer=torch.optim.AdamW(model.parameters()))
    graph = ul.trace(work)
    summary = ul.measure(work, repeats=0, graph=graph).summary(graph)
    assert summary["peak_relative_error"] == 0 and summary["max_step_relative_error"] == 0, summary
    trainable = _trainable(model)
    assert {t.name for t in graph.tensors if t.category == "parameter_gradient"} == {f"grad:{n}" for n in trainable}
    assert {t.name.rsplit(".", 1)[0] for t in graph.tensors if t.category == "optimizer_state"} == trainable
    assert hf_lora.lora_rank(model) == 4


def test_any_module_with_frozen_parameters_has_no_gradient_or_state_for_them():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))
    model[0].requires_grad_(False)
    model[2].weight.requires_grad_(False)
    work = ul.Workload(model, torch.randn(8, 64), optimizer=torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    graph = ul.trace(work)
    summary = ul.measure(work, repeats=0, graph=graph).summary(graph)
    assert summary["peak_relative_error"] == 0, summary
    assert {t.name for t in graph.tensors if t.category == "parameter_gradient"} == \
        {"grad:2.bias", "grad:4.weight", "grad:4.bias"}
    assert {t.name for t in graph.tensors if t.category == "optimizer_state"} == \
        {"2.bias.momentum_buffer", "4.weight.momentum_buffer", "4.bias.momentum_buffer"}
    assert sum(t.nbytes for t in graph.tensors if t.category == "parameter") == \
        4 * sum(p.numel() for p in model.parameters())
