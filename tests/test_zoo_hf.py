"""Hugging Face models in the zoo: the published numbers, and small configs of each family predicted exactly."""

import sys

import pytest
import torch

import udnn_lab as ul
from udnn_lab import zoo
from udnn_lab.errors import MissingDependency, UnknownModelError
from udnn_lab.zoo import hf_configs

transformers = pytest.importorskip("transformers", reason="Hugging Face models need udnn_lab[hf] (transformers)")

DENSE = ["hf:gpt2", "hf:llama-3-8b", "hf:llama-3-70b", "hf:mistral-7b", "hf:qwen2.5-7b", "hf:bert-base",
         "hf:vit-b-16"]
MOE = ["hf:qwen1.5-moe-a2.7b", "hf:mixtral-8x7b"]


def _small(name, **options):
    length = {} if "vit" in name else {"seq_len": 32}
    return {"batch": 2, "small": True, **length, **options}


def _predicted_against_measured(name, **options):
    graph = ul.trace(zoo.get(name, device="meta", **_small(name, **options)))
    summary = ul.measure(zoo.get(name, **_small(name, **options)), repeats=0, graph=graph).summary(graph)
    assert summary["ops"] == len(graph.ops)
    return summary


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.compat if n == "hf:llama-3-8b" else ())
                                  for n in DENSE])  # Llama in the compatibility subset (make test-compat)
def test_small_config_of_each_family_is_predicted_exactly_on_cpu(name):
    summary = _predicted_against_measured(name)
    assert summary["peak_relative_error"] == 0 and summary["max_step_relative_error"] == 0, summary


@pytest.mark.parametrize("name", MOE)
def test_small_moe_in_bfloat16_is_predicted_exactly_on_cpu(name):
    summary = _predicted_against_measured(name, dtype=torch.bfloat16)
    assert summary["peak_relative_error"] == 0 and summary["max_step_relative_error"] == 0, summary


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
@pytest.mark.parametrize("name", MOE)
def test_small_moe_in_float32_weights_is_predicted_exactly_on_cpu(name, precision):
    # torch's meta kernel of the grouped matmul takes bfloat16/float16 only; the trace makes its output by the real
    # kernels' rule (NOTE [grouped matmul stand-in])
    summary = _predicted_against_measured(name, precision=precision)
    assert summary["peak_relative_error"] == 0 and summary["max_step_relative_error"] == 0, summary


def test_eager_attention_is_predicted_exactly_too():
    summary = _predicted_against_measured("hf:llama-3-8b", config_overrides={"attn_implementation": "eager"})
    assert summary["peak_relative_error"] == 0, summary


def test_the_published_numbers_reach_the_built_model():
    work = zoo.get("hf:llama-3-8b", batch=1, seq_len=4096, device="meta")
    config = work.model.config
    assert (config.num_hidden_layers, config.hidden_size, config.num_attention_heads,
            config.num_key_value_heads, config.intermediate_size, config.vocab_size) == (32, 4096, 32, 8, 14336, 128256)
    rope = getattr(config, "rope_parameters", None) or {"rope_theta": config.rope_theta}
    assert rope["rope_theta"] == 500000.0
    assert sum(p.numel() for p in work.model.parameters()) == 8_030_261_248  # Llama-3-8B's published count
    assert work.example_input["input_ids"].shape == (1, 4096) and work.example_input["labels"].shape == (1, 4096)
    assert isinstance(work.optimizer, torch.optim.AdamW) and work.name == "hf:llama-3-8b (sdpa attention)"
    gpt2 = zoo.get("hf:gpt2", batch=1, seq_len=8, device="meta").model
    assert sum(p.numel() for p in gpt2.parameters()) == 124_439_808


# parameter counts as the model cards give them (Mixtral's paper: 46.7B; Qwen1.5-MoE's card: 14.3B)
PUBLISHED_PARAMETERS = {"hf:llama-3-70b": 70.6e9, "hf:mistral-7b": 7.24e9, "hf:qwen2.5-7b": 7.61e9,
                        "hf:qwen1.5-moe-a2.7b": 14.3e9, "hf:mixtral-8x7b": 46.7e9, "hf:bert-base": 110e6,
                        "hf:vit-b-16": 86.6e6}


@pytest.mark.parametrize("name", PUBLISHED_PARAMETERS)
def test_full_size_models_have_their_published_parameter_count(name):
    length = {} if "vit" in name else {"seq_len": 8}
    model = zoo.get(name, batch=1, device="meta", optimizer=None, **length).model
    assert sum(p.numel() for p in model.parameters()) == pytest.approx(PUBLISHED_PARAMETERS[name], rel=0.005)


def test_every_model_builds_on_meta_with_its_input_dict():
    for name in hf_configs.names():
        work = zoo.get(name, batch=2, small=True, device="meta")
        assert set(work.example_input) in ({"input_ids", "labels"}, {"pixel_values", "labels"}), name
        assert all(p.device.type == "meta" for p in work.model.parameters()) and work.model.training
        assert hf_configs.spec(name).source.startswith("huggingface.co/")


def test_small_keeps_the_family_and_shrinks_it():
    config = zoo.get("hf:qwen2.5-7b", batch=1, seq_len=8, small=True, device="meta").model.config
    assert (config.num_hidden_layers, config.hidden_size, config.vocab_size) == (2, 64, hf_configs.SMALL_VOCABULARY)
    assert config.num_attention_heads % config.num_key_value_heads == 0 and config.num_key_value_heads > 1
    assert type(zoo.get("hf:qwen2.5-7b", batch=1, seq_len=8, small=True, device="meta").model).__name__ == \
        "Qwen2ForCausalLM"


def test_precision_builds_the_model_and_its_pixels_in_its_dtype():
    vit = zoo.get("hf:vit-b-16", batch=2, small=True, device="meta", precision="bf16-true")
    assert vit.example_input["pixel_values"].dtype == torch.bfloat16 and vit.precision == "bf16-true"
    assert all(p.dtype == torch.bfloat16 for p in vit.model.parameters())
    gpt2 = zoo.get("hf:gpt2", batch=2, seq_len=8, small=True, device="meta", precision="16-mixed")
    assert gpt2.precision == "16-mixed" and all(p.dtype == torch.float32 for p in gpt2.model.parameters())
    assert gpt2.example_input["input_ids"].dtype == torch.int64


def test_vit_takes_pixels_and_class_labels():
    work = zoo.get("hf:vit-b-16", batch=3, device="meta")
    assert work.example_input["pixel_values"].shape == (3, 3, 224, 224) and work.example_input["labels"].shape == (3,)
    with pytest.raises(ValueError, match="takes images"):
        zoo.get("hf:vit-b-16", batch=1, seq_len=16, device="meta")


def test_names_list_the_hf_models_and_bad_requests_say_what_to_do():
    assert set(hf_configs.names()) <= set(zoo.names()) and "hf:mistral-7b" in zoo.describe()
    assert zoo.get("HF:Llama_3_8B", batch=1, seq_len=4, small=True, device="meta").name == \
        "hf:llama-3-8b-small (sdpa attention)"
    with pytest.raises(UnknownModelError, match="hf:gpt2"):
        zoo.get("hf:gpt-5", batch=1)
    with pytest.raises(ValueError, match="between 1 and 1024"):
        zoo.get("hf:gpt2", batch=1, seq_len=2048, device="meta")
    with pytest.raises(ValueError, match="LlamaConfig has no field num_hiden_layers"):
        zoo.get("hf:llama-3-8b", batch=1, config_overrides={"num_hiden_layers": 2}, device="meta")
    with pytest.raises(ValueError, match="seq_len must be between 1 and 1024"):
        zoo.get("hf:gpt2", batch=1, seq_len=0, device="meta")
    with pytest.raises(ValueError, match="Hugging Face"):
        zoo.get("mlp2", batch=1, seq_len=8)


def test_missing_transformers_is_reported_clearly(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(MissingDependency, match="pip install 'udnn_lab\\[hf\\]'"):
        zoo.get("hf:gpt2", batch=1, seq_len=8, device="meta")


def test_your_own_transformers_model_works_through_its_input_dict():
    config = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=100, n_positions=64)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).train()
    ids = torch.randint(100, (2, 16))
    work = ul.Workload(model, {"input_ids": ids, "labels": ids.clone()}, loss_fn=zoo.hf.output_loss,
                       optimizer=torch.optim.AdamW(model.parameters()))
    graph = ul.trace(work)
    summary = ul.measure(work, repeats=0, graph=graph).summary(graph)
    assert summary["peak_relative_error"] == 0, summary
