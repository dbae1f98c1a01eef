"""MemoryLab's controls for Hugging Face networks: sequence length, LoRA rank and attention.

They apply to hf: networks alone, and are disabled for the others (the sequence length for
ViT too, which takes images); a disabled control adds nothing to the step, so changing it
traces nothing again.
"""

from __future__ import annotations

from typing import Any

import ipywidgets as widgets

from udnn_lab.vocabulary import ATTENTION_IMPLEMENTATIONS
from udnn_lab.widgets._networks import is_hf, takes_tokens


class HFControls:
    """The three boxes; ``follow(network)`` enables what applies, ``options(network)`` is what the step gets."""

    def __init__(self, seq_len: int, lora_rank: int, attention: str, width: str) -> None:
        if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
            raise ValueError(f"seq_len is the tokens per example of an hf: network: a positive int, got {seq_len!r}")
        if isinstance(lora_rank, bool) or not isinstance(lora_rank, int) or lora_rank < 0:
            raise ValueError(f"lora_rank is the rank of the LoRA adapters, 0 for a full fine-tune: an int of 0 or "
                             f"more, got {lora_rank!r}")
        if attention not in ATTENTION_IMPLEMENTATIONS:
            raise ValueError(f"unknown attn_implementation {attention!r}: use one of "
                             f"{', '.join(ATTENTION_IMPLEMENTATIONS)}")
        layout = widgets.Layout(width=width)
        self.seq_len = widgets.BoundedIntText(value=seq_len, min=1, max=1 << 20, description="seq len",
                                              tooltip="tokens per example (hf: networks that take tokens)",
                                              layout=layout)
        self.lora_rank = widgets.BoundedIntText(value=lora_rank, min=0, max=1 << 16, description="LoRA rank",
                                                tooltip="0: full fine-tune; r: train LoRA adapters of rank r (PEFT) "
                                                        "on the frozen model (hf: networks)", layout=layout)
        self.attention = widgets.Dropdown(options=list(ATTENTION_IMPLEMENTATIONS), value=attention,
                                          description="attention", layout=layout,
                                          tooltip="sdpa: torch's fused attention; eager: matmul, softmax, matmul, "
                                                  "which keeps the seq x seq scores (hf: networks)")

    @property
    def controls(self) -> tuple[widgets.Widget, ...]:
        return self.seq_len, self.lora_rank, self.attention

    def follow(self, network: str) -> None:
        """Enable the controls that apply to ``network``, disable the others."""
        self.lora_rank.disabled = self.attention.disabled = not is_hf(network)
        self.seq_len.disabled = not takes_tokens(network)

    def options(self, network: str) -> dict[str, Any]:
        """The step's seq_len, lora_rank and attn_implementation for ``network``: None where they do not apply."""
        hf = is_hf(network)
        return {"seq_len": int(self.seq_len.value) if takes_tokens(network) else None,
                "lora_rank": (int(self.lora_rank.value) or None) if hf else None,
                "attn_implementation": self.attention.value if hf else None}
