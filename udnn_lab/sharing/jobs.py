"""The co-training study's jobs: document 004's four models behind a size knob, and user job specs.

A JobSpec is plain, picklable data (a name, a model, a batch, keyword options), because
each job is built again inside its own process. ``model`` is a zoo name
(``ul.zoo.get(model, batch=..., **options)``) or ``"package.module:factory"``, a function
``factory(batch: int, device: str, **options) -> Workload``.

Document 004's models come from the factories below. At ``size="full"`` they are the
models themselves (FCN 784-1024x4-10, VGG-19 and ResNet-50 at 224 px, a 2-layer LSTM);
smaller sizes shrink widths, images and batches so the same study runs on a CPU.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import nn

from udnn_lab import zoo
from udnn_lab.workload import Workload

SIZES = ("tiny", "small", "full")
DOCUMENT_004_MODELS = ("mlp5", "vgg19", "resnet50", "lstm")
# VGG-19's conv widths, times width (64 at full size); "M": a max pool
_VGG19: tuple[int | Literal["M"], ...] = (1, 1, "M", 2, 2, "M", 4, 4, 4, 4, "M", 8, 8, 8, 8, "M", 8, 8, 8, 8, "M")

# model -> size -> (batch, factory options)
_PRESETS: dict[str, dict[str, tuple[int, dict[str, Any]]]] = {
    "mlp5": {"tiny": (16, {"width": 32}), "small": (128, {"width": 512}), "full": (128, {"width": 1024})},
    "vgg19": {"tiny": (2, {"width": 4, "image_size": 32, "hidden": 32}),
              "small": (8, {"width": 16, "image_size": 32, "hidden": 256}),
              "full": (32, {"width": 64, "image_size": 224, "hidden": 4096})},
    "resnet50": {"tiny": (2, {"width": 4, "image_size": 32}), "small": (8, {"width": 16, "image_size": 32}),
                 "full": (32, {"width": 64, "image_size": 224})},
    "lstm": {"tiny": (4, {"vocabulary": 100, "embed": 16, "hidden": 32, "tokens": 8}),
             "small": (16, {"vocabulary": 1000, "embed": 64, "hidden": 128, "tokens": 32}),
             "full": (64, {"vocabulary": 10000, "embed": 256, "hidden": 512, "tokens": 64})},
}


@dataclass(frozen=True)
class JobSpec:
    """One training job of the study: what to build, at which batch size."""

    name: str  # its label in every table
    model: str  # a zoo name, or "package.module:factory"
    batch: int = 8
    options: tuple[tuple[str, Any], ...] = field(default=())  # keyword arguments for the factory or zoo.get

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name.strip():
            raise ValueError(f"a job needs a non-empty name, got {self.name!r}")
        if not isinstance(self.model, str) or not self.model:
            raise TypeError(f"JobSpec.model is a zoo name or 'package.module:factory' (a string, so the job can be "
                            f"rebuilt in its own process), got {type(self.model).__name__}")
        if isinstance(self.batch, bool) or not isinstance(self.batch, int) or self.batch < 1:
            raise ValueError(f"job {self.name!r}: batch must be a positive int, got {self.batch!r}")
        options = self.options.items() if isinstance(self.options, Mapping) else self.options
        object.__setattr__(self, "options", tuple(sorted((str(k), v) for k, v in options)))

    def build(self, device: str | torch.device = "cpu") -> Workload:
        """The job's Workload on ``device`` ('meta' analyzes without allocating)."""
        kwargs = dict(self.options)
        if ":" not in self.model:
            work = zoo.get(self.model, batch=self.batch, device=device, **kwargs)
        else:
            work = resolve_factory(self.model)(batch=self.batch, device=str(device), **kwargs)
        if not isinstance(work, Workload):
            raise TypeError(f"job {self.name!r}: factory {self.model!r} returned {type(work).__name__}; it must return "
                            "a ul.Workload, e.g. ul.zoo.get(my_module, batch=batch, input_shape=..., device=device)")
        return work


def resolve_factory(path: str):
    """The function named by ``"package.module:factory"``."""
    module_name, _, attribute = path.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ImportError(f"cannot import {module_name!r} for job factory {path!r}: {err}. The module must be "
                          "importable in a fresh process (installed, or on PYTHONPATH)") from err
    factory = getattr(module, attribute, None)
    if not callable(factory):
        raise AttributeError(f"{module_name!r} has no function {attribute!r} (from job factory {path!r})")
    return factory


def document_004_jobs(size: str = "small", models: tuple[str, ...] = DOCUMENT_004_MODELS) -> list[JobSpec]:
    """Document 004's jobs (FCN, VGG-19, ResNet-50, LSTM) at ``size``: 'tiny', 'small' or 'full'."""
    return [document_004_job(model, size) for model in models]


def document_004_job(model: str, size: str = "small", **overrides: Any) -> JobSpec:
    """One of document 004's jobs; ``overrides`` replace the size's options (and ``batch``)."""
    if model not in _PRESETS:
        raise ValueError(f"document 004's models are {', '.join(DOCUMENT_004_MODELS)}; got {model!r}")
    if size not in SIZES:
        raise ValueError(f"size must be one of {', '.join(SIZES)}, got {size!r}")
    batch, options = _PRESETS[model][size]
    batch = overrides.pop("batch", batch)
    return JobSpec(model, f"udnn_lab.sharing.jobs:{model}", batch, tuple({**options, **overrides}.items()))


# -- the factories ------------------------------------------------------------------------------
def mlp5(batch: int, device: str, width: int = 1024, in_features: int = 784, classes: int = 10) -> Workload:
    """Document 004's 5-layer fully connected net."""
    return _classifier(lambda: zoo.MLP(5, in_features, width, classes), (batch, in_features), classes, device, "mlp5")


def vgg19(batch: int, device: str, width: int = 64, image_size: int = 224, hidden: int = 4096,
          classes: int = 1000) -> Workload:
    """VGG-19 (16 conv + 3 linear layers); ``width`` 64 and ``hidden`` 4096 are torchvision's."""
    return _classifier(lambda: VGG19(width, hidden, classes, image_size), (batch, 3, image_size, image_size),
                       classes, device, "vgg19")


def resnet50(batch: int, device: str, width: int = 64, image_size: int = 224, classes: int = 1000) -> Workload:
    """ResNet-50 (bottlenecks 3-4-6-3); ``width`` 64 is torchvision's."""
    return _classifier(lambda: ResNet50(width, classes), (batch, 3, image_size, image_size), classes, device,
                       "resnet50")


def lstm(batch: int, device: str, vocabulary: int = 10000, embed: int = 256, hidden: int = 512, layers: int = 2,
         tokens: int = 64, classes: int = 10) -> Workload:
    """The zoo's LSTM classifier: embedding, stacked LSTM, a linear head on the last step."""
    def build() -> nn.Module:
        return zoo.LSTMClassifier(vocabulary, embed, hidden, layers, classes)
    return _classifier(build, (batch, tokens), classes, device, "lstm", vocabulary=vocabulary)


def _classifier(build, shape: tuple[int, ...], classes: int, device: str | torch.device, name: str,
                vocabulary: int = 0) -> Workload:
    device = torch.device(device)
    generator = torch.Generator().manual_seed(0)
    with torch.device(device):
        torch.manual_seed(0)
        model = build()
    if device.type == "meta":
        example = torch.empty(shape, dtype=torch.long if vocabulary else torch.float32, device=device)
    elif vocabulary:
        example = torch.randint(vocabulary, shape, generator=generator).to(device)
    else:
        example = torch.randn(shape, generator=generator).to(device)
    target = torch.randint(classes, (shape[0],), generator=generator).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    return Workload(model, example, target, zoo.classification_loss, optimizer, name, shape[0])


class VGG19(nn.Module):
    """VGG-19 with every conv width times ``width / 64``; the head pools to a side of 7 (1 below 224 px)."""

    def __init__(self, width: int = 64, hidden: int = 4096, classes: int = 1000, image_size: int = 224) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        channels = 3
        for item in _VGG19:
            if item == "M":
                layers.append(nn.MaxPool2d(2))
            else:
                layers += [nn.Conv2d(channels, item * width, 3, padding=1), nn.ReLU(inplace=True)]
                channels = item * width
        side = 7 if image_size >= 224 else 1
        self.features = nn.Sequential(*layers)
        self.pool = nn.AdaptiveAvgPool2d(side)
        self.classifier = nn.Sequential(
            nn.Linear(channels * side * side, hidden), nn.ReLU(inplace=True), nn.Dropout(),
            nn.Linear(hidden, hidden), nn.ReLU(inplace=True), nn.Dropout(), nn.Linear(hidden, classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.pool(self.features(x)).flatten(1))


class ResNet50(nn.Module):
    """torchvision's ResNet-50 layout with every width times ``width / 64``."""

    def __init__(self, width: int = 64, classes: int = 1000) -> None:
        super().__init__()
        from torchvision.models.resnet import Bottleneck  # heavy: only when this job is built

        self.stem = nn.Sequential(nn.Conv2d(3, width, 7, 2, 3, bias=False), nn.BatchNorm2d(width),
                                  nn.ReLU(inplace=True), nn.MaxPool2d(3, 2, 1))
        stages, inplanes = [], width
        for index, (planes, blocks) in enumerate(zip((width, 2 * width, 4 * width, 8 * width), (3, 4, 6, 3))):
            stride = 1 if index == 0 else 2
            down = nn.Sequential(nn.Conv2d(inplanes, planes * 4, 1, stride, bias=False), nn.BatchNorm2d(planes * 4))
            layers = [Bottleneck(inplanes, planes, stride, down)]
            layers += [Bottleneck(planes * 4, planes) for _ in range(blocks - 1)]
            stages.append(nn.Sequential(*layers))
            inplanes = planes * 4
        self.stages = nn.Sequential(*stages)
        self.fc = nn.Linear(inplanes, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.stages(self.stem(x))
        return self.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(out, 1), 1))
