"""LoRA adapters on a Hugging Face zoo model, through PEFT: the base weights frozen, only the adapters trained.

``with_lora(model, spec, rank=16)`` wraps the model with ``peft.get_peft_model``; the adapters get PEFT's own
random initial weights on the model's device, nothing is downloaded. The target modules default to what
PEFT picks for the architecture (``HFModelSpec.lora_targets``, which repeats PEFT's table and fills it where
PEFT has no entry). In a half-precision model PEFT keeps the adapters in float32, as it does by default.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from udnn_lab.errors import MissingDependency
from udnn_lab.zoo.hf_configs import HFModelSpec

TASK_TYPES = {"causal-lm": "CAUSAL_LM"}  # PEFT's wrapper for the task; the others take the plain PeftModel


def check_lora(rank: int | None, alpha: float | None, target_modules: str | Sequence[str] | None) -> None:
    """Raise ValueError, saying what to give instead, for settings PEFT would refuse or that mean nothing."""
    if rank is None:
        if alpha is not None or target_modules is not None:
            raise ValueError("lora_alpha and lora_target_modules set up LoRA adapters: give lora_rank too, "
                             "e.g. lora_rank=16")
        return
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ValueError(f"lora_rank must be a positive int (the adapters' inner size, e.g. 8 or 16), got {rank!r}")
    if alpha is not None and (isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or alpha <= 0):
        raise ValueError(f"lora_alpha must be a positive number (the adapters' scale is alpha / rank), got {alpha!r}")
    if target_modules is None or isinstance(target_modules, str):
        return
    if not target_modules or not all(isinstance(name, str) and name for name in target_modules):
        raise ValueError("lora_target_modules must be module names, e.g. ('q_proj', 'v_proj'), or 'all-linear'; "
                         f"got {target_modules!r}")


def with_lora(model: nn.Module, spec: HFModelSpec, *, rank: int, alpha: float | None = None,
              target_modules: str | Sequence[str] | None = None, device: torch.device) -> nn.Module:
    """``model`` inside a PEFT model whose only trainable parameters are LoRA adapters of ``rank``."""
    check_lora(rank, alpha, target_modules)
    try:
        import peft  # optional dependency: udnn_lab[hf]
    except ImportError as error:
        raise MissingDependency("LoRA adapters come from peft, which is not installed: "
                                "pip install 'udnn_lab[hf]' (or pip install peft)") from error
    targets = spec.lora_targets if target_modules is None else target_modules
    options: dict[str, Any] = {} if alpha is None else {"lora_alpha": alpha}
    config = peft.LoraConfig(r=rank, target_modules=targets if isinstance(targets, str) else list(targets),
                             task_type=TASK_TYPES.get(spec.task), fan_in_fan_out=_stores_transposed(spec),
                             **options)
    try:
        with torch.device(device):  # the adapters are made where the model is: on 'meta' they take no memory
            return peft.get_peft_model(model, config)
    except ValueError as error:
        if "not found in the base model" not in str(error):
            raise
        raise ValueError(f"lora_target_modules {targets!r} names no module of {spec.name}; its linear layers are "
                         f"named {', '.join(linear_names(model))} (or use 'all-linear')") from None


def linear_names(model: nn.Module) -> list[str]:
    """The last part of the names of the model's linear layers (PEFT matches target modules against them)."""
    named = {name.rsplit(".", 1)[-1] for name, module in model.named_modules()
             if isinstance(module, nn.Linear) or type(module).__name__ == "Conv1D"}
    return sorted(named)


def _stores_transposed(spec: HFModelSpec) -> bool:
    # GPT-2's projections are transformers' Conv1D, whose weight is (in, out): PEFT wants fan_in_fan_out for them
    return spec.config_class == "GPT2Config"


def lora_rank(model: nn.Module) -> int | None:
    """The rank of a PEFT model's LoRA adapters (the active adapter's), None for a model without them."""
    configs = getattr(model, "peft_config", None)
    if not isinstance(configs, dict) or not configs:
        return None
    active = getattr(model, "active_adapter", None)
    config = configs.get(active) if isinstance(active, str) else None
    return getattr(config or next(iter(configs.values())), "r", None)
