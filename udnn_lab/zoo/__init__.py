"""Named models with an example batch: torchvision, timm (optional), Hugging Face (optional), synthetic nets.

Random weights, never a download. ``get(name, batch=...)`` returns a Workload
(model, example input, target, loss, optimizer) ready for ``trace`` and ``measure``;
anywhere a name is accepted an ``nn.Module`` may be passed instead, with ``input_shape``, or
'package.module:factory', a callable there that returns one.
Build on ``device='meta'`` to analyze without allocating the weights.

Hugging Face models (``pip install 'udnn_lab[hf]'``) are named 'hf:<model>', e.g.
``get("hf:llama-3-8b", batch=1, seq_len=4096, device="meta")``: the published architecture
(``hf_configs``, each with its source) built from its config. The input is the model's own dict,
``{"input_ids", "labels"}`` (``{"pixel_values", "labels"}`` for ViT), the loss is the one the model
returns, the optimizer AdamW unless you ask for another. ``small=True`` keeps the family at
2 layers, hidden size 64 and a 1000-token vocabulary; ``config_overrides`` sets any config field
(``{"num_hidden_layers": 4}``). ``attn_implementation="eager"`` (or ``"sdpa"``) picks the attention;
``lora_rank=16`` trains LoRA adapters (PEFT) on the frozen model.
Your own transformers model works as any module: ``ul.Workload(model, {"input_ids": ..., "labels": ...},
loss_fn=hf.output_loss, optimizer=...)``.

``published_fine_tune_peaks()`` (``zoo.published``) gives published peak-memory figures of fine-tuning runs
(Hugging Face docs, LitGPT, torchtune, PEFT), each with its setup and source, to set against predictions.
"""

from __future__ import annotations

import importlib
import importlib.util
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from udnn_lab.errors import MissingDependency, ModelFactoryError, UnknownModelError
from udnn_lab.vocabulary import AttentionImplementation, Precision
from udnn_lab.workload import COMPUTE_DTYPES, StepOptions, Workload, precision_of
from udnn_lab.zoo import hf, hf_configs
from udnn_lab.zoo.seeding import seeded

if TYPE_CHECKING:
    from udnn_lab.parallel import Parallel
from udnn_lab.zoo.published import PublishedPeak as PublishedPeak
from udnn_lab.zoo.published import published_fine_tune_peaks as published_fine_tune_peaks

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}  # by the name users type
# What get(optimizer=...) builds. 'adamw' leaves the kernels to PyTorch (foreach on CUDA, one parameter at a time on
# a CPU), '-foreach' and '-fused' ask for those kernels; 'none': forward and backward only.
OPTIMIZERS = ("sgd", "adam", "adamw", "adamw-foreach", "adamw-fused", "adafactor", "none")


@dataclass(frozen=True)
class ZooEntry:
    name: str
    description: str
    build: Callable[[], nn.Module]
    sample_shape: tuple[int, ...]  # one example's input shape (image side and sequence length included)
    input_kind: str  # 'image', 'vector' or 'tokens'
    num_classes: int
    vocabulary: int = 0  # for token inputs


# -- synthetic ultra-deep models ------------------------------------------------------------
class PreActBottleneck(nn.Module):
    """Pre-activation bottleneck block (He et al., Identity Mappings, 2016)."""

    def __init__(self, in_planes: int, planes: int, stride: int) -> None:
        super().__init__()
        out_planes = planes * 4
        self.bn1, self.conv1 = nn.BatchNorm2d(in_planes), nn.Conv2d(in_planes, planes, 1, bias=False)
        self.bn2, self.conv2 = nn.BatchNorm2d(planes), nn.Conv2d(planes, planes, 3, stride, 1, bias=False)
        self.bn3, self.conv3 = nn.BatchNorm2d(planes), nn.Conv2d(planes, out_planes, 1, bias=False)
        self.shortcut = (nn.Conv2d(in_planes, out_planes, 1, stride, bias=False)
                         if stride != 1 or in_planes != out_planes else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(x))
        shortcut = self.shortcut(out) if self.shortcut is not None else x
        out = self.conv1(out)
        out = self.conv2(F.relu(self.bn2(out)))
        out = self.conv3(F.relu(self.bn3(out)))
        return out + shortcut


class DeepResNet(nn.Module):
    """CIFAR-style pre-activation ResNet of depth 9n+2 (ResNet-164, ResNet-1001, ...)."""

    def __init__(self, depth: int, num_classes: int = 10, width: int = 16) -> None:
        super().__init__()
        if depth < 11 or (depth - 2) % 9:
            raise ValueError(f"a bottleneck ResNet has depth 9n+2 (e.g. 164, 1001); {depth} is not. "
                             f"Nearest: {_nearest_depths(depth)}")
        blocks = (depth - 2) // 9
        self.conv1 = nn.Conv2d(3, width, 3, 1, 1, bias=False)
        stages, in_planes = [], width
        for i, planes in enumerate((width, width * 2, width * 4)):
            layers = []
            for j in range(blocks):
                layers.append(PreActBottleneck(in_planes, planes, 2 if (i > 0 and j == 0) else 1))
                in_planes = planes * 4
            stages.append(nn.Sequential(*layers))
        self.layer1, self.layer2, self.layer3 = stages
        self.bn = nn.BatchNorm2d(in_planes)
        self.fc = nn.Linear(in_planes, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.layer3(self.layer2(self.layer1(self.conv1(x))))
        out = F.adaptive_avg_pool2d(F.relu(self.bn(out)), 1).flatten(1)
        return self.fc(out)


def _nearest_depths(depth: int) -> list[int]:
    n = max(1, round((depth - 2) / 9))
    return sorted({9 * k + 2 for k in (max(1, n - 1), n, n + 1)})


class MLP(nn.Module):
    """A plain fully connected net of ``layers`` Linear layers (document 004's 5-layer FCN is ``mlp5``)."""

    def __init__(self, layers: int, in_features: int = 784, width: int = 1024, num_classes: int = 10) -> None:
        super().__init__()
        if layers < 1:
            raise ValueError(f"an MLP needs at least 1 layer, got {layers}")
        sizes = [in_features] + [width] * (layers - 1) + [num_classes]
        modules: list[nn.Module] = []
        for i in range(layers):
            modules.append(nn.Linear(sizes[i], sizes[i + 1]))
            if i < layers - 1:
                modules.append(nn.ReLU())
        self.net = nn.Sequential(*modules)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class LSTMClassifier(nn.Module):
    """Embedding -> LSTM -> Linear on the last step, for sequence classification."""

    def __init__(self, vocabulary: int = 10000, embed: int = 256, hidden: int = 512, layers: int = 2,
                 num_classes: int = 10) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocabulary, embed)
        self.lstm = nn.LSTM(embed, hidden, num_layers=layers, batch_first=True)
        self.fc = nn.Linear(hidden, num_classes)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        out, _ = self.lstm(self.embed(tokens))
        return self.fc(out[:, -1])


class TransformerClassifier(nn.Module):
    """A transformer encoder over token embeddings, mean-pooled into a classifier."""

    def __init__(self, vocabulary: int = 10000, d_model: int = 512, heads: int = 8, layers: int = 6,
                 num_classes: int = 10) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocabulary, d_model)
        layer = nn.TransformerEncoderLayer(d_model, heads, 4 * d_model, dropout=0.1, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.fc = nn.Linear(d_model, num_classes)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.fc(self.encoder(self.embed(tokens)).mean(dim=1))


# -- the catalogue ----------------------------------------------------------------------------
def _torchvision(name: str, **kwargs: Any) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        import torchvision  # heavy (hundreds of ms): only when a torchvision model is built

        return getattr(torchvision.models, name)(weights=None, **kwargs)

    return build


def _timm(name: str) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        try:
            import timm  # optional dependency: udnn_lab[timm]
        except ImportError as err:
            raise MissingDependency(f"{name} comes from timm, which is not installed: "
                                    "pip install 'udnn_lab[timm]' (or pip install timm)") from err
        return timm.create_model(name, pretrained=False)

    return build


def _image(name: str, description: str, build: Callable[[], nn.Module], side: int = 224,
           classes: int = 1000) -> ZooEntry:
    return ZooEntry(name, description, build, (3, side, side), "image", classes)


_FIXED = {
    e.name: e for e in (
        _image("alexnet", "AlexNet (torchvision)", _torchvision("alexnet")),
        _image("vgg11", "VGG-11 (torchvision)", _torchvision("vgg11")),
        _image("vgg16", "VGG-16 (torchvision)", _torchvision("vgg16")),
        _image("vgg19", "VGG-19 (torchvision)", _torchvision("vgg19")),
        _image("googlenet", "GoogLeNet / Inception v1 with aux heads (torchvision)",
               _torchvision("googlenet", aux_logits=True, init_weights=True)),
        _image("inception_v3", "Inception v3 with aux head (torchvision)",
               _torchvision("inception_v3", aux_logits=True, init_weights=True), side=299),
        _image("inception_v4", "Inception v4 (timm, optional)", _timm("inception_v4"), side=299),
        _image("resnet18", "ResNet-18 (torchvision)", _torchvision("resnet18")),
        _image("resnet34", "ResNet-34 (torchvision)", _torchvision("resnet34")),
        _image("resnet50", "ResNet-50 (torchvision)", _torchvision("resnet50")),
        _image("resnet101", "ResNet-101 (torchvision)", _torchvision("resnet101")),
        _image("resnet152", "ResNet-152 (torchvision)", _torchvision("resnet152")),
        _image("densenet121", "DenseNet-121 (torchvision)", _torchvision("densenet121")),
        _image("densenet201", "DenseNet-201 (torchvision)", _torchvision("densenet201")),
        ZooEntry("lstm", "LSTM classifier: embedding 256, 2 x LSTM 512, 64 tokens", LSTMClassifier,
                 (64,), "tokens", 10, vocabulary=10000),
        ZooEntry("transformer", "Transformer encoder: 6 layers, d_model 512, 8 heads, 128 tokens",
                 TransformerClassifier, (128,), "tokens", 10, vocabulary=10000),
    )
}
_PATTERNS = {
    "resnet<depth>": "pre-activation bottleneck ResNet of depth 9n+2 on 32x32 images, e.g. resnet164, resnet1001",
    "mlp<layers>": "plain MLP of N Linear layers (784 -> 1024 ... -> 10), e.g. mlp5 (the 5-layer FCN of the "
                   "shared-GPU study, notebook 06), mlp50",
}


def names() -> list[str]:
    """Every fixed zoo name, the parametric families (``resnet1001``, ``mlp50``), then 'hf:' ones with transformers."""
    huggingface = hf_configs.names() if importlib.util.find_spec("transformers") is not None else []
    return list(_FIXED) + ["resnet1001", "mlp5"] + list(_PATTERNS) + huggingface


def describe() -> dict[str, str]:
    """Name -> one-line description, families included."""
    huggingface = {hf_configs.PREFIX + name: spec.description for name, spec in hf_configs.SPECS.items()}
    return {**{name: entry.description for name, entry in _FIXED.items()}, **_PATTERNS, **huggingface}


def entry(name: str) -> ZooEntry:
    """The catalogue entry for ``name`` (case, '-' and '_' are ignored)."""
    if not isinstance(name, str):
        raise TypeError(f"a zoo name is a string, got {type(name).__name__}")
    key = re.sub(r"[-_\s]", "", name.lower())
    for fixed, found in _FIXED.items():
        if fixed.replace("_", "") == key:
            return found
    if match := re.fullmatch(r"resnet(\d+)", key):
        depth = int(match.group(1))
        return ZooEntry(f"resnet{depth}", f"pre-activation bottleneck ResNet-{depth} (CIFAR, 32x32)",
                        lambda: DeepResNet(depth), (3, 32, 32), "image", 10)
    if match := re.fullmatch(r"(?:mlp|fcn)(\d+)", key):
        layers = int(match.group(1))
        return ZooEntry(f"mlp{layers}", f"{layers}-layer MLP (784 -> 1024 ... -> 10)",
                        lambda: MLP(layers), (784,), "vector", 10)
    raise UnknownModelError(f"unknown model {name!r}; the zoo knows: {', '.join(names())}")


def get(name_or_model: str | nn.Module, batch: int = 8, *, image_size: int | None = None,
        input_shape: tuple[int, ...] | None = None, device: str | torch.device = "cpu",
        dtype: torch.dtype | None = None, optimizer: str | None = "default", seed: int = 0,
        seq_len: int | None = None, small: bool = False, config_overrides: dict[str, Any] | None = None,
        attn_implementation: AttentionImplementation | None = None, lora_rank: int | None = None,
        lora_alpha: float | None = None, lora_target_modules: str | Sequence[str] | None = None,
        precision: Precision | None = None, parallel: Parallel | None = None) -> Workload:
    """A Workload: the model (random weights) on ``device``, a random batch, cross-entropy, an optimizer.

    ``name_or_model``: a zoo name, or your own ``nn.Module`` or 'package.module:factory' (then
    give ``input_shape``, one example's shape, and it gets the sum of its outputs as loss; a
    factory's module is built on the CPU, or on ``device`` when that is not 'meta'). ``image_size``
    overrides the side of image inputs. ``optimizer``: one of OPTIMIZERS: 'sgd' (momentum 0.9),
    'adam', 'adamw' (PyTorch picks the kernels), 'adamw-foreach', 'adamw-fused', 'adafactor', or
    None for forward and backward only; by default 'sgd', and 'adamw' for 'hf:' models.
    ``precision`` (PyTorch Lightning's names): '32-true' (the default), 'bf16-mixed' and '16-mixed'
    build the model in float32 and run autocast; 'bf16-true' and '16-true' build it, and its
    floating inputs, in that dtype. ``dtype`` is the older way to say a '-true' precision
    (torch.bfloat16 is 'bf16-true'). A module of your own is not converted: it must already be in
    the precision's dtype, which by default is its own.
    ``seq_len`` (default 512), ``small`` and ``config_overrides`` are for 'hf:' models (see the module's doc),
    and so are ``attn_implementation`` ('sdpa' or 'eager'; by default what transformers picks) and LoRA:
    ``lora_rank`` wraps the model in PEFT adapters, ``lora_alpha`` and ``lora_target_modules`` (default: PEFT's
    choice for the architecture) go to ``peft.LoraConfig``; the optimizer then holds the adapters alone.
    The name says which attention runs and the LoRA rank: 'hf:llama-3-8b (sdpa attention, LoRA r=16)'.
    ``parallel`` (``ul.DDP(n)``, ``ul.FSDP(n)``): the step is one rank of n; ``ul.trace`` traces that rank, and
    ``batch`` is each rank's.
    """
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise ValueError(f"batch must be a positive int, got {batch!r}")
    device = torch.device(device)
    options = _step_options(name_or_model, precision, dtype)
    weights = None if options.weights_dtype == torch.float32 else options.weights_dtype
    if isinstance(name_or_model, str) and name_or_model.lower().startswith(hf_configs.PREFIX):
        model, inputs = hf.build(name_or_model, batch, seq_len=seq_len, small=small,
                                 config_overrides=config_overrides, device=device, dtype=weights, seed=seed,
                                 attn_implementation=attn_implementation, lora_rank=lora_rank, lora_alpha=lora_alpha,
                                 lora_target_modules=lora_target_modules)
        return _hf_workload(model, inputs, name_or_model, small, batch, optimizer, options, parallel)
    _refuse_hf_options(seq_len is not None or small or config_overrides is not None,
                       {"attn_implementation": attn_implementation, "lora_rank": lora_rank, "lora_alpha": lora_alpha,
                        "lora_target_modules": lora_target_modules})
    optimizer = "sgd" if optimizer == "default" else optimizer
    generator_seed = torch.Generator().manual_seed(seed)
    if isinstance(name_or_model, str) and ":" in name_or_model:
        name_or_model = from_factory(name_or_model).to(device="cpu" if device.type == "meta" else device,
                                                        dtype=options.weights_dtype)
    if isinstance(name_or_model, nn.Module):
        return _own_module(name_or_model, (batch, *_own_shape(input_shape)), options, device, generator_seed,
                           optimizer, parallel)
    found = entry(name_or_model)
    with torch.device(device), seeded(seed, device):
        model = found.build()
    if weights is not None:
        model = model.to(weights)
    example, target = _batch_for(found, (batch, *_sample_shape(found, image_size, input_shape)), options, device,
                                 generator_seed)
    return Workload(model, example, target, classification_loss, _optimizer(optimizer, model), found.name, batch,
                    precision=options.precision, parallel=parallel)


def _hf_workload(model: nn.Module, inputs: dict, name: str, small: bool, batch: int, optimizer: str | None,
                 options: StepOptions, parallel: Parallel | None) -> Workload:
    """An 'hf:' model's Workload: the loss the model returns, AdamW by default, named with its variant."""
    label = hf_configs.PREFIX + hf_configs.spec(name).name + ("-small" if small else "") + hf.variant(model)
    kind = "adamw" if optimizer == "default" else optimizer
    return Workload(model, inputs, None, hf.output_loss, _optimizer(kind, model), label, batch,
                    precision=options.precision, parallel=parallel)


def _own_shape(input_shape: tuple[int, ...] | None) -> tuple[int, ...]:
    if input_shape is None:
        raise ValueError("for your own module, give input_shape: the shape of one example, e.g. (3, 224, 224)")
    return input_shape


def _own_module(model: nn.Module, shape: tuple[int, ...], options: StepOptions, device: torch.device,
                generator: torch.Generator, optimizer: str | None, parallel: Parallel | None) -> Workload:
    """Your own module's Workload: a random batch of ``shape``, the sum of its outputs as loss."""
    example = _random(shape, options.weights_dtype, device, generator)
    return Workload(model, example, None, None, _optimizer(optimizer, model), type(model).__name__, shape[0],
                    precision=options.precision, parallel=parallel)


def _refuse_hf_options(hf_sizes: bool, hf_only: dict[str, Any]) -> None:
    """Options for 'hf:' models given with another model: say which, and what to do instead."""
    if hf_sizes:
        raise ValueError("seq_len, small and config_overrides are for Hugging Face models ('hf:<name>'); "
                         "for the others use input_shape")
    if given := [key for key, value in hf_only.items() if value is not None]:
        raise ValueError(f"{', '.join(given)} {'is' if len(given) == 1 else 'are'} for Hugging Face models "
                         "('hf:<name>'); for your own module, wrap it with peft.get_peft_model(...) and pass that")


def _batch_for(found: ZooEntry, shape: tuple[int, ...], options: StepOptions, device: torch.device,
               generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """A random batch of ``shape`` for a zoo model (token ids or floats) and its class targets."""
    if found.input_kind == "tokens":
        example = torch.randint(found.vocabulary, shape, generator=generator).to(device)
    else:
        example = _random(shape, options.weights_dtype, device, generator)
    return example, torch.randint(found.num_classes, (shape[0],), generator=generator).to(device)


def _step_options(name_or_model: str | nn.Module, precision: Precision | None,
                  dtype: torch.dtype | None) -> StepOptions:
    if isinstance(name_or_model, nn.Module) and precision is None and dtype is None:
        return StepOptions(precision_of(name_or_model))  # your own module, in its own dtype
    return StepOptions(_precision(precision, dtype))


def _precision(precision: Precision | None, dtype: torch.dtype | None) -> Precision:
    """The precision asked for, by name or (the older way) by the weights' dtype; '32-true' by default."""
    trained_as: tuple[Precision, ...] = ("32-true", "bf16-true", "16-true", "64-true")
    by_dtype = {COMPUTE_DTYPES[name]: name for name in trained_as}
    if dtype is not None and dtype not in by_dtype:
        raise ValueError(f"dtype {dtype} is not one the zoo builds in: use one of {', '.join(map(str, by_dtype))}")
    implied = by_dtype[dtype] if dtype is not None else None
    if precision is not None and implied is not None and precision != implied:
        raise ValueError(f"dtype={dtype} means precision={implied!r}, but precision={precision!r} was asked for: "
                         "give one of them (precision is the newer way)")
    return precision or implied or "32-true"


def from_factory(spec: str) -> nn.Module:
    """The module that 'package.module:factory' returns (or the module found there); ModelFactoryError if not."""
    module_name, _, attribute = spec.partition(":")
    if not module_name or not attribute:
        raise ModelFactoryError(f"cannot read {spec!r} as a model factory: give package.module:callable")
    try:
        factory = getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError) as error:
        raise ModelFactoryError(f"cannot load the model factory {spec}: {error}") from error
    if isinstance(factory, nn.Module) or not callable(factory):
        model = factory
    else:
        try:
            model = factory()
        except Exception as error:  # whatever the user's code raises is reported as the factory's failure
            raise ModelFactoryError(f"the model factory {spec} raised {type(error).__name__}: {error}") from error
    if not isinstance(model, nn.Module):
        raise ModelFactoryError(f"the model factory {spec} gave a {type(model).__name__}, not an nn.Module")
    return model


def _sample_shape(found: ZooEntry, image_size: int | None, input_shape: tuple[int, ...] | None) -> tuple[int, ...]:
    if input_shape is not None:
        return tuple(input_shape)
    if image_size is not None:
        if found.input_kind != "image":
            raise ValueError(f"{found.name} takes {found.input_kind}, not images: use input_shape instead")
        return (found.sample_shape[0], image_size, image_size)
    return found.sample_shape


def _random(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, generator) -> torch.Tensor:
    if device.type == "meta":
        return torch.empty(shape, dtype=dtype, device=device)
    return torch.randn(shape, generator=generator).to(device=device, dtype=dtype)


def _optimizer(kind: str | None, model: nn.Module) -> torch.optim.Optimizer | None:
    params = [p for p in model.parameters() if p.requires_grad]
    if kind is None or kind == "none":
        return None
    if not params:
        raise ValueError(f"{type(model).__name__} has no parameter that requires grad, so there is nothing "
                         "to train: give it trainable parameters, or use optimizer=None")
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.01, momentum=0.9)
    if kind == "adam":
        return torch.optim.Adam(params, lr=1e-3)
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=1e-3)
    if kind == "adamw-foreach":
        return torch.optim.AdamW(params, lr=1e-3, foreach=True)
    if kind == "adamw-fused":
        return torch.optim.AdamW(params, lr=1e-3, fused=True)
    if kind == "adafactor":
        return torch.optim.Adafactor(params, lr=1e-2)
    raise ValueError(f"unknown optimizer {kind!r}: use one of {OPTIMIZERS} (or None)")


def classification_loss(output: Any, target: torch.Tensor) -> torch.Tensor:
    """Cross-entropy; auxiliary heads (GoogLeNet, Inception) add 0.3 x theirs, as in training them."""
    if isinstance(output, torch.Tensor):
        return F.cross_entropy(output, target)
    main, *aux = [t for t in output if isinstance(t, torch.Tensor)]
    loss = F.cross_entropy(main, target)
    for head in aux:
        loss = loss + 0.3 * F.cross_entropy(head, target)
    return loss
