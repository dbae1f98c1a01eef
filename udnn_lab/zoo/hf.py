"""Hugging Face transformers models from their config, with random weights, and a batch in their own input dict."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from udnn_lab.zoo import hf_configs

DEFAULT_SEQ_LEN = 512


def build(name: str, batch: int, *, seq_len: int | None, small: bool, config_overrides: dict[str, Any] | None,
          device: torch.device, dtype: torch.dtype | None, seed: int) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """The model (training mode) on ``device`` and its input dict: ``input_ids`` and ``labels``, or pixels."""
    found = hf_configs.spec(name)
    config = hf_configs.config(name, small=small, **(config_overrides or {}))  # says so when transformers is missing
    import transformers  # optional dependency: udnn_lab[hf], there once config() is made
    with torch.device(device):
        torch.manual_seed(seed)
        model = getattr(transformers, found.model_class)(config)
    if dtype is not None:
        model = model.to(dtype)
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


def output_loss(output: Any) -> torch.Tensor:
    """The loss a transformers model computes itself when given ``labels``."""
    loss = getattr(output, "loss", None)
    if loss is None:
        raise ValueError(f"the model's output ({type(output).__name__}) has no loss: give the input dict 'labels'")
    return loss
