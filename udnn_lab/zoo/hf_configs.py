"""Architecture numbers of well-known Hugging Face models, as their published configs give them.

Each spec names its source: the model's ``config.json`` on its Hugging Face hub page (or the paper).
Only the numbers are kept here; ``config(name)`` turns one into a ``transformers`` config, so that the
model is built with random weights and nothing is ever downloaded. ``small=True`` keeps the family
(its classes, activation, norm, head grouping) at 2 layers and hidden size 64, for exact checks on a CPU;
expert widths stay multiples of 8, as torch's grouped matmul wants 16-byte rows in bfloat16.
Keys are the config class's own argument names (GPT-2 says ``n_embd`` where Llama says ``hidden_size``).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any

from udnn_lab.errors import MissingDependency, UnknownModelError

PREFIX = "hf:"
SMALL_VOCABULARY = 1000
_SET_AT_BUILD = {"experts_implementation"}  # config arguments transformers keeps under another, private name


@dataclass(frozen=True)
class HFModelSpec:
    name: str  # after 'hf:', e.g. 'llama-3-8b'
    description: str
    source: str  # where the numbers come from
    task: str  # 'causal-lm', 'masked-lm' or 'image-classification'
    config_class: str  # a class of transformers, by name
    model_class: str
    numbers: dict[str, Any]
    small: dict[str, Any] = field(default_factory=dict)  # the 2-layer, hidden-64 version of the same family
    rope_theta: float | None = None  # for rotary models; transformers 5 spells it rope_parameters
    # LoRA's default target modules: PEFT's own for the architecture (peft.utils.constants,
    # TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING); for those it lacks, the same query and value projections
    lora_targets: tuple[str, ...] = ("q_proj", "v_proj")


_SMALL_DECODER = {"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
                  "vocab_size": SMALL_VOCABULARY}

SPECS: dict[str, HFModelSpec] = {s.name: s for s in (
    # https://huggingface.co/openai-community/gpt2/blob/main/config.json (124M parameters)
    HFModelSpec("gpt2", "GPT-2 (124M): 12 layers, 768 hidden, 12 heads, 1024 positions",
                "huggingface.co/openai-community/gpt2 config.json", "causal-lm", "GPT2Config", "GPT2LMHeadModel",
                {"n_layer": 12, "n_embd": 768, "n_head": 12, "n_inner": None, "n_positions": 1024,
                 "vocab_size": 50257, "activation_function": "gelu_new", "layer_norm_epsilon": 1e-5,
                 "resid_pdrop": 0.1, "embd_pdrop": 0.1, "attn_pdrop": 0.1},
                {"n_layer": 2, "n_embd": 64, "n_head": 4, "vocab_size": SMALL_VOCABULARY,
                 "bos_token_id": SMALL_VOCABULARY - 1, "eos_token_id": SMALL_VOCABULARY - 1},
                lora_targets=("c_attn",)),
    # https://huggingface.co/meta-llama/Meta-Llama-3-8B/blob/main/config.json
    HFModelSpec("llama-3-8b", "Llama-3-8B: 32 layers, 4096 hidden, 32 heads (8 KV), SwiGLU 14336",
                "huggingface.co/meta-llama/Meta-Llama-3-8B config.json", "causal-lm", "LlamaConfig",
                "LlamaForCausalLM",
                {"num_hidden_layers": 32, "hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8,
                 "intermediate_size": 14336, "vocab_size": 128256, "max_position_embeddings": 8192,
                 "rms_norm_eps": 1e-5, "hidden_act": "silu", "tie_word_embeddings": False},
                {**_SMALL_DECODER, "num_key_value_heads": 1, "intermediate_size": 224}, rope_theta=500000.0),
    # https://huggingface.co/meta-llama/Meta-Llama-3-70B/blob/main/config.json
    HFModelSpec("llama-3-70b", "Llama-3-70B: 80 layers, 8192 hidden, 64 heads (8 KV), SwiGLU 28672",
                "huggingface.co/meta-llama/Meta-Llama-3-70B config.json", "causal-lm", "LlamaConfig",
                "LlamaForCausalLM",
                {"num_hidden_layers": 80, "hidden_size": 8192, "num_attention_heads": 64, "num_key_value_heads": 8,
                 "intermediate_size": 28672, "vocab_size": 128256, "max_position_embeddings": 8192,
                 "rms_norm_eps": 1e-5, "hidden_act": "silu", "tie_word_embeddings": False},
                {**_SMALL_DECODER, "num_key_value_heads": 1, "intermediate_size": 224}, rope_theta=500000.0),
    # https://huggingface.co/mistralai/Mistral-7B-v0.1/blob/main/config.json
    HFModelSpec("mistral-7b", "Mistral-7B-v0.1: 32 layers, 4096 hidden, 32 heads (8 KV), sliding window 4096",
                "huggingface.co/mistralai/Mistral-7B-v0.1 config.json", "causal-lm", "MistralConfig",
                "MistralForCausalLM",
                {"num_hidden_layers": 32, "hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8,
                 "intermediate_size": 14336, "vocab_size": 32000, "max_position_embeddings": 32768,
                 "sliding_window": 4096, "rms_norm_eps": 1e-5, "hidden_act": "silu", "tie_word_embeddings": False},
                {**_SMALL_DECODER, "num_key_value_heads": 1, "intermediate_size": 224}, rope_theta=10000.0),
    # https://huggingface.co/Qwen/Qwen2.5-7B/blob/main/config.json
    HFModelSpec("qwen2.5-7b", "Qwen2.5-7B: 28 layers, 3584 hidden, 28 heads (4 KV), QKV bias",
                "huggingface.co/Qwen/Qwen2.5-7B config.json", "causal-lm", "Qwen2Config", "Qwen2ForCausalLM",
                {"num_hidden_layers": 28, "hidden_size": 3584, "num_attention_heads": 28, "num_key_value_heads": 4,
                 "intermediate_size": 18944, "vocab_size": 152064, "max_position_embeddings": 131072,
                 "use_sliding_window": False, "rms_norm_eps": 1e-6, "hidden_act": "silu",
                 "tie_word_embeddings": False},
                {**_SMALL_DECODER, "num_key_value_heads": 2, "intermediate_size": 336}, rope_theta=1000000.0),
    # https://huggingface.co/Qwen/Qwen1.5-MoE-A2.7B/blob/main/config.json (14.3B parameters, 2.7B active)
    HFModelSpec("qwen1.5-moe-a2.7b", "Qwen1.5-MoE-A2.7B: 24 layers, 2048 hidden, 60 experts (top 4) + shared",
                "huggingface.co/Qwen/Qwen1.5-MoE-A2.7B config.json", "causal-lm", "Qwen2MoeConfig",
                "Qwen2MoeForCausalLM",
                {"num_hidden_layers": 24, "hidden_size": 2048, "num_attention_heads": 16, "num_key_value_heads": 16,
                 "intermediate_size": 5632, "moe_intermediate_size": 1408, "shared_expert_intermediate_size": 5632,
                 "num_experts": 60, "num_experts_per_tok": 4, "decoder_sparse_step": 1, "norm_topk_prob": False,
                 "vocab_size": 151936, "max_position_embeddings": 8192, "rms_norm_eps": 1e-6, "hidden_act": "silu",
                 "use_sliding_window": False, "tie_word_embeddings": False},
                {**_SMALL_DECODER, "num_key_value_heads": 4, "intermediate_size": 176, "moe_intermediate_size": 48,
                 "shared_expert_intermediate_size": 176, "num_experts": 4, "num_experts_per_tok": 2},
                rope_theta=1000000.0),
    # https://huggingface.co/mistralai/Mixtral-8x7B-v0.1/blob/main/config.json
    HFModelSpec("mixtral-8x7b", "Mixtral-8x7B: 32 layers, 4096 hidden, 8 experts (top 2), 32 heads (8 KV)",
                "huggingface.co/mistralai/Mixtral-8x7B-v0.1 config.json", "causal-lm", "MixtralConfig",
                "MixtralForCausalLM",
                {"num_hidden_layers": 32, "hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8,
                 "intermediate_size": 14336, "num_local_experts": 8, "num_experts_per_tok": 2,
                 "vocab_size": 32000, "max_position_embeddings": 32768, "rms_norm_eps": 1e-5, "hidden_act": "silu",
                 "sliding_window": None, "tie_word_embeddings": False},
                {**_SMALL_DECODER, "num_key_value_heads": 1, "intermediate_size": 224, "num_local_experts": 4},
                rope_theta=1000000.0),
    # https://huggingface.co/google-bert/bert-base-uncased/blob/main/config.json
    HFModelSpec("bert-base", "BERT-base (uncased), masked LM: 12 layers, 768 hidden, 12 heads, 512 positions",
                "huggingface.co/google-bert/bert-base-uncased config.json", "masked-lm", "BertConfig",
                "BertForMaskedLM",
                {"num_hidden_layers": 12, "hidden_size": 768, "num_attention_heads": 12, "intermediate_size": 3072,
                 "vocab_size": 30522, "max_position_embeddings": 512, "type_vocab_size": 2, "hidden_act": "gelu",
                 "hidden_dropout_prob": 0.1, "attention_probs_dropout_prob": 0.1, "layer_norm_eps": 1e-12},
                {"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "intermediate_size": 256,
                 "vocab_size": SMALL_VOCABULARY}, lora_targets=("query", "value")),
    # https://huggingface.co/google/vit-base-patch16-224/blob/main/config.json (Dosovitskiy et al., 2021)
    HFModelSpec("vit-b-16", "ViT-B/16, image classification: 12 layers, 768 hidden, 12 heads, 224 px, patch 16",
                "huggingface.co/google/vit-base-patch16-224 config.json", "image-classification", "ViTConfig",
                "ViTForImageClassification",
                {"num_hidden_layers": 12, "hidden_size": 768, "num_attention_heads": 12, "intermediate_size": 3072,
                 "image_size": 224, "patch_size": 16, "num_channels": 3, "hidden_act": "gelu", "qkv_bias": True,
                 "layer_norm_eps": 1e-12, "num_labels": 1000},
                {"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "intermediate_size": 256,
                 "image_size": 32, "patch_size": 8, "num_labels": 10},
                # PEFT's image-classification guide targets query and value; transformers 5 names them q_proj, v_proj
                lora_targets=("query", "value", "q_proj", "v_proj")),
)}


def names() -> list[str]:
    """Every known model, with its 'hf:' prefix."""
    return [PREFIX + name for name in SPECS]


def spec(name: str) -> HFModelSpec:
    """The spec for 'hf:<name>' or '<name>' (case, '_' and '-' are ignored)."""
    key = name.lower().removeprefix(PREFIX).replace("_", "-")
    for known, found in SPECS.items():
        if known.replace("-", "") == key.replace("-", ""):
            return found
    raise UnknownModelError(f"unknown Hugging Face model {name!r}; the zoo knows: {', '.join(names())} "
                            "(or build your own transformers model and pass it with its input dict)")


def config(name: str, *, small: bool = False, attn_implementation: str | None = "sdpa", **overrides: Any) -> Any:
    """A transformers config of ``name``'s architecture; ``small``: 2 layers, hidden 64; ``overrides`` go last.

    Overrides use the config class's own names (``num_hidden_layers=4``; GPT-2's ``n_layer=4``).
    """
    try:
        import transformers  # optional dependency: udnn_lab[hf]
    except ImportError as error:
        raise MissingDependency(f"{name} is a Hugging Face model and transformers is not installed: "
                                "pip install 'udnn_lab[hf]' (or pip install transformers)") from error
    found = spec(name)
    config_class = getattr(transformers, found.config_class)
    unknown = sorted(key for key in overrides if key not in _SET_AT_BUILD and not hasattr(config_class(), key))
    if unknown:
        raise ValueError(f"{found.config_class} has no field {', '.join(unknown)}: config_overrides takes the "
                         f"config's own names, e.g. {', '.join(list(found.numbers)[:3])}")
    numbers = {**found.numbers, **(found.small if small else {}), **overrides}
    if found.rope_theta is not None and "rope_theta" not in numbers and "rope_parameters" not in numbers:
        numbers.update(_rope(config_class, found.rope_theta))
    made = config_class(**numbers)
    if attn_implementation is not None:
        made._attn_implementation = attn_implementation  # what from_config(attn_implementation=...) sets
    return made


def _rope(config_class: type, theta: float) -> dict[str, Any]:
    # transformers 5 takes rope_parameters; 4.x takes rope_theta
    if "rope_parameters" in inspect.signature(config_class).parameters:
        return {"rope_parameters": {"rope_type": "default", "rope_theta": theta}}
    return {"rope_theta": theta}
