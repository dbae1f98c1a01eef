"""Hugging Face transformers models from their config, with random weights, and a batch in their own input dict."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from udnn_lab.vocabulary import ATTENTION_IMPLEMENTATIONS, AttentionImplementation
from udnn_lab.zoo import hf_configs, hf_lora
from udnn_lab.zoo.seeding import seeded

DEFAULT_SEQ_LEN = 512


def build(name: str, batch: int, *, seq_len: int | None, small: bool, config_overrides: dict[str, Any] | None,
          device: torch.device, dtype: torch.dtype | None, seed: int,
          attn_implementation: AttentionImplementation | None = None,
          lora_rank: int | None = None, lora_alpha: float | None = None,
          lora_target_modules: str | Sequence[str] | None = None) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """The model (training mode) on ``device`` and its input dict: ``input_ids`` and ``labels``, or pixels.

    ``attn_implementation``: 'sdpa' or 'eager'; None lets transformers pick. ``lora_rank``: wrap the model in
    PEFT LoRA adapters of that rank (``hf_lora``), ``lora_alpha`` and ``lora_target_modules`` as PEFT takes them.
    """
    found = hf_configs.spec(name)
    hf_lora.check_lora(lora_rank, lora_alpha, lora_target_modules)
    overrides = _with_attention(config_overrides, attn_implementation)
    config = hf_configs.config(name, small=small, **overrides)  # says so when transformers is missing
    import transformers  # optional dependency: udnn_lab[hf], there once config() is made
    with torch.device(device), seeded(seed, device):
        model = getattr(transformers, found.model_class)(config)
    if getattr(model, "loss_type", "") is None and found.task == "causal-lm":
        model.loss_type = "ForCausalLM"  # the loss transformers falls back to for GPT2LMHeadModel, without its warning
    if dtype is not None:
        model = model.to(dtype)
    if lora_rank is not None:
        model = hf_lora.with_lora(model, found, rank=lora_rank, alpha=lora_alpha, target_modules=lora_target_modules,
                                  device=device)
    model.train()
    generator = torch.Generator().manual_seed(seed)
    if found.task == "image-classification":
        if seq_len is not None:
            raise ValueError(f"{name} takes images, not tokens: leave seq_len out (image_size is set by the config, "
                             "e.g. config_overrides={'image_size': 384})")
        side, channels = config.image_size, config.num_channels
        pixels = torch.randn((batch, channels, side, side), generator=generator).to(device=device,
                                                                                    dtype=dtype or torch.float32)
        labels = torch.randint(config.num_labels, (batch,), generator=generator).to(device)
        return model, {"pixel_values": pixels, "labels": labels}
    length = DEFAULT_SEQ_LEN if seq_len is None else seq_len
    limit = positions(config)
    if length < 1 or (limit is not None and length > limit):
        raise ValueError(f"seq_len must be between 1 and {limit}, the positions {name} has; got {length}")
    input_ids = torch.randint(config.vocab_size, (batch, length), generator=generator).to(device)
    labels = input_ids.clone() if found.task == "causal-lm" else \
        torch.randint(config.vocab_size, (batch, length), generator=generator).to(device)
    return model, {"input_ids": input_ids, "labels": labels}


def max_positions(name: str, *, small: bool = False, config_overrides: dict[str, Any] | None = None) -> int | None:
    """The longest sequence 'hf:<name>' takes (its position embeddings); None for a config that sets no limit."""
    return positions(hf_configs.config(name, small=small, **(config_overrides or {})))


def positions(config: Any) -> int | None:
    """A transformers config's number of positions, whichever name it gives them (GPT-2: n_positions)."""
    return getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)


def _with_attention(config_overrides: dict[str, Any] | None,
                    attn_implementation: AttentionImplementation | None) -> dict[str, Any]:
    """The config overrides with the attention implementation asked for (None: transformers picks)."""
    overrides = dict(config_overrides or {})
    if attn_implementation is None:
        overrides.setdefault("attn_implementation", None)
        return overrides
    if attn_implementation not in ATTENTION_IMPLEMENTATIONS:
        raise ValueError(f"unknown attn_implementation {attn_implementation!r}: use one of "
                         f"{', '.join(ATTENTION_IMPLEMENTATIONS)}, or None for what transformers picks")
    if overrides.get("attn_implementation", attn_implementation) != attn_implementation:
        raise ValueError(f"attn_implementation={attn_implementation!r} and config_overrides' "
                         f"{overrides['attn_implementation']!r} disagree: give it once")
    overrides["attn_implementation"] = attn_implementation
    return overrides


def variant(model: nn.Module) -> str:
    """What a zoo name adds to the architecture's: ' (sdpa attention)', ' (eager attention, LoRA r=16)'."""
    attention = getattr(getattr(model, "config", None), "_attn_implementation", None)
    parts = [f"{attention} attention"] if attention else []
    rank = hf_lora.lora_rank(model)
    if rank is not None:
        parts.append(f"LoRA r={rank}")
    return f" ({', '.join(parts)})" if parts else ""


def output_loss(output: Any) -> torch.Tensor:
    """The loss a transformers model computes itself when given ``labels``."""
    loss = getattr(output, "loss", None)
    if loss is None:
        raise ValueError(f"the model's output ({type(output).__name__}) has no loss: give the input dict 'labels'")
    return loss
