"""The networks MemoryLab offers, and how a network's name in the app becomes a zoo request.

The zoo's names as they are, and for each Hugging Face architecture (when transformers is
installed) its small version, named as the zoo labels a ``small=True`` build: 'hf:gpt2-small' is
``zoo.get("hf:gpt2", small=True)``, the family at 2 layers and hidden size 64, which traces in
a fraction of a second and runs for real on a CPU (Measure, Train).
"""

from __future__ import annotations

from udnn_lab import zoo
from udnn_lab.errors import UnknownModelError
from udnn_lab.zoo import hf_configs

SMALL_SUFFIX = "-small"


def offered(custom_name: str | None) -> list[str]:
    """The network box's list: your module, the zoo's models, the small hf: models, then the full-size ones.

    Families such as resnet<depth> are typed in, not listed.
    """
    names = [name for name in zoo.names() if "<" not in name]
    full_size = [name for name in names if is_hf(name)]
    others = [name for name in names if not is_hf(name)]
    return ([custom_name] if custom_name else []) + others + [name + SMALL_SUFFIX for name in full_size] + full_size


def is_hf(network: str) -> bool:
    return network.lower().startswith(hf_configs.PREFIX)


def zoo_request(network: str) -> tuple[str, bool]:
    """The zoo name to build and whether to build its small version: ('hf:gpt2', True) for 'hf:gpt2-small'."""
    if is_hf(network) and network.lower().endswith(SMALL_SUFFIX):
        return network[:-len(SMALL_SUFFIX)], True
    return network, False


def takes_tokens(network: str) -> bool:
    """An hf: network whose input is tokens, so that a sequence length applies (not ViT's images). A name the zoo
    does not know counts as one: building it says what is wrong."""
    if not is_hf(network):
        return False
    try:
        return hf_configs.spec(zoo_request(network)[0]).task != "image-classification"
    except UnknownModelError:
        return True
