"""Small models the project was not designed around, each a seeded training step.

``CORPUS`` maps a name to an :class:`Entry`; ``Entry.workload()`` builds the model (random
weights), its example input, target, loss and optimizer, all from seed 0, and leaves the
caller's RNG state as it found it. Every model steps in well under a second on one CPU
thread and holds a few MB of activations.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from udnn_lab.workload import Workload

SEED = 0


@dataclass(frozen=True)
class Entry:
    name: str
    build: Callable[[], tuple]  # -> (model, example_input, target, loss_fn, optimizer)
    requires: str | None = None  # an optional package the model comes from
    known_failure: str | None = None  # why it is expected to break the promise today
    precision: str | None = None  # how the step runs ('bf16-mixed'); None: the model's own dtype

    @property
    def available(self) -> bool:
        return self.requires is None or _imports(self.requires)

    def workload(self) -> Workload:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(SEED)
            model, example, target, loss_fn, optimizer = self.build()
        return Workload(model, example, target, loss_fn, optimizer, self.name, precision=self.precision)


CORPUS: dict[str, Entry] = {}


@functools.cache
def _imports(package: str) -> bool:
    try:
        importlib.import_module(package)
    except Exception:  # an optional package that is missing or broken: its models are skipped
        return False
    return True


def entry(name: str, **options):
    def register(build):
        CORPUS[name] = Entry(name, build, **options)
        return build
    return register


def sgd(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)


def adam(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.Adam(model.parameters(), lr=1e-3)


def step(model: nn.Module, example, target, loss_fn=F.cross_entropy, optimizer=sgd) -> tuple:
    return model, example, target, loss_fn, optimizer(model)


def classify(model: nn.Module, example, optimizer=sgd, loss_fn=F.cross_entropy) -> tuple:
    """Ten classes, one label per example."""
    first = example if isinstance(example, torch.Tensor) else next(iter(example.values()))
    return step(model, example, torch.randint(10, (first.shape[0],)), loss_fn, optimizer)


def images(side: int, channels: int = 3, batch: int = 2, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(batch, channels, side, side, dtype=dtype)


# -- torchvision --------------------------------------------------------------------------------
def _torchvision(name: str, side: int, **kwargs) -> tuple:
    import torchvision  # heavy (hundreds of ms): only when a torchvision model is built

    return classify(getattr(torchvision.models, name)(weights=None, num_classes=10, **kwargs), images(side))


for _name, _side in (("mobilenet_v2", 32), ("mobilenet_v3_small", 32), ("efficientnet_b0", 32),
                     ("regnet_y_400mf", 32), ("squeezenet1_0", 64), ("shufflenet_v2_x0_5", 32)):
    entry(_name, requires="torchvision")(lambda name=_name, side=_side: _torchvision(name, side))


# -- timm -----------------------------------------------------------------------------------------
def _timm(name: str, side: int, **kwargs) -> tuple:
    import timm  # optional: the corpus lists these models only as available when timm imports

    return classify(timm.create_model(name, pretrained=False, num_classes=10, **kwargs), images(side))


for _name, _side, _options in (("resnet10t", 32, {}), ("convnext_atto", 32, {}),
                               ("vit_tiny_patch16_224", 32, {"img_size": 32}),
                               ("mobilevitv2_050", 64, {})):
    entry(f"timm_{_name}", requires="timm")(lambda name=_name, side=_side, options=_options:
                                             _timm(name, side, **options))


# -- transformers, as people fine-tune them -------------------------------------------------------
@entry("hf_llama_bf16_mixed", requires="transformers", precision="bf16-mixed")
def _hf_llama():
    """A small Llama-style decoder in bf16-mixed with AdamW: autocast's casts in the step the plan follows."""
    from udnn_lab.zoo import get

    work = get("hf:llama-3-8b", batch=2, small=True, seq_len=32, optimizer="adamw")
    return work.model, work.example_input, work.target, work.loss_fn, work.optimizer


@entry("hf_beit", requires="transformers")
def _hf_beit():
    """BEiT caches its relative position index in an lru_cache its forward fills (NOTE [what a traced model
    keeps]): the fake trace's entry would have trained every later step on fake tensors."""
    import transformers

    config = transformers.BeitConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                                     intermediate_size=128, image_size=64, patch_size=8, num_labels=10,
                                     use_relative_position_bias=True)
    model = transformers.BeitForImageClassification(config)
    batch = {"pixel_values": images(64), "labels": torch.tensor([1, 7])}
    return model, batch, None, lambda output: output.loss, adam(model)


# -- sequence models ------------------------------------------------------------------------------
class CausalSelfAttention(nn.Module):
    def __init__(self, width: int, heads: int, length: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.register_buffer("mask", torch.tril(torch.ones(length, length, dtype=torch.bool)), persistent=False)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        scores = (q @ k.transpose(-2, -1)) / (c // self.heads) ** 0.5
        scores = scores.masked_fill(~self.mask[:t, :t], float("-inf"))
        y = F.dropout(scores.softmax(-1), 0.1, self.training) @ v
        return self.proj(y.transpose(1, 2).contiguous().view(b, t, c))


class GPTBlock(nn.Module):
    def __init__(self, width: int, heads: int, length: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.attn = CausalSelfAttention(width, heads, length)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(approximate="tanh"),
                                 nn.Linear(4 * width, width), nn.Dropout(0.1))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """GPT-2 style: token and position embeddings, pre-norm blocks, output head tied to the embedding."""

    def __init__(self, vocabulary: int = 128, width: int = 64, heads: int = 4, layers: int = 2, length: int = 64):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocabulary, width), nn.Embedding(length, width)
        self.blocks = nn.ModuleList(GPTBlock(width, heads, length) for _ in range(layers))
        self.ln_f = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocabulary, bias=False)
        self.head.weight = self.wte.weight

    def forward(self, tokens):
        x = self.wte(tokens) + self.wpe(torch.arange(tokens.shape[1], device=tokens.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def next_token_loss(logits, target):
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


@entry("gpt2_tied")
def _gpt():
    model = GPT()
    tokens = torch.randint(128, (8, 65))
    return step(model, tokens[:, :-1], tokens[:, 1:], next_token_loss, adam)


class EncoderClassifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        layer = nn.TransformerEncoderLayer(64, 4, 128, dropout=0.1, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(64, 10)

    def forward(self, x):
        return self.head(self.encoder(x).mean(1))


@entry("transformer_encoder")
def _encoder():
    return classify(EncoderClassifier(), torch.randn(8, 32, 64), optimizer=adam)


class GRUClassifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gru = nn.GRU(16, 64, num_layers=2, batch_first=True)
        self.head = nn.Linear(64, 10)

    def forward(self, x):
        out, _ = self.gru(x)
        return self.head(out[:, -1])


@entry("gru")
def _gru():
    return classify(GRUClassifier(), torch.randn(16, 32, 16))


class CellLoop(nn.Module):
    """A recurrent cell unrolled by hand in Python."""

    def __init__(self, cell: type[nn.Module]) -> None:
        super().__init__()
        self.cell = cell(16, 256)
        self.head = nn.Linear(256, 10)

    def forward(self, x):
        h = x.new_zeros(x.shape[0], 256)
        c = x.new_zeros(x.shape[0], 256)
        for t in range(x.shape[1]):
            if isinstance(self.cell, nn.LSTMCell):
                h, c = self.cell(x[:, t], (h, c))
            else:
                h = self.cell(x[:, t], h)
        return self.head(h)


@entry("lstm_cell_loop")
def _lstm_cells():
    return classify(CellLoop(nn.LSTMCell), torch.randn(64, 12, 16))


@entry("rnn_cell_loop")
def _rnn_cells():
    return classify(CellLoop(nn.RNNCell), torch.randn(64, 12, 16))


class PaddedAttention(nn.Module):
    """Self-attention over a padded batch: padded keys are masked, the pooling skips padded positions."""

    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(64, 4, dropout=0.1, batch_first=True)
        self.norm = nn.LayerNorm(64)
        self.head = nn.Linear(64, 10)

    def forward(self, x, padding_mask):
        y, _ = self.attn(x, x, x, key_padding_mask=padding_mask, need_weights=False)
        y = self.norm(x + y)
        keep = (~padding_mask).unsqueeze(-1).to(y.dtype)
        return self.head((y * keep).sum(1) / keep.sum(1))


@entry("padded_attention")
def _padded():
    lengths = torch.randint(8, 33, (8, 1))
    padding = torch.arange(32) >= lengths
    return classify(PaddedAttention(), {"x": torch.randn(8, 32, 64), "padding_mask": padding})


class Top1MoE(nn.Module):
    """Switch-style top-1 routing with a fixed expert capacity: scatter, index_add dispatch, index_select combine."""

    def __init__(self, width: int = 64, experts: int = 4, capacity: int = 80) -> None:
        super().__init__()
        self.experts_n, self.capacity = experts, capacity
        self.embed = nn.Linear(16, width)
        self.router = nn.Linear(width, experts)
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(width, 128), nn.ReLU(), nn.Linear(128, width))
                                     for _ in range(experts))
        self.head = nn.Linear(width, 10)

    def forward(self, x):
        b, t, _ = x.shape
        tokens = self.embed(x).flatten(0, 1)
        gates = self.router(tokens).softmax(-1)
        choice = gates.argmax(-1)
        chosen = torch.zeros_like(gates).scatter(1, choice.unsqueeze(1), 1.0)
        position = (chosen.cumsum(0) * chosen).sum(1).long() - 1
        overflow = self.experts_n * self.capacity
        slot = torch.where(position < self.capacity, choice * self.capacity + position,
                           torch.full_like(position, overflow))
        buffer = tokens.new_zeros(overflow + 1, tokens.shape[1]).index_add(0, slot, tokens)
        per_expert = buffer[:-1].view(self.experts_n, self.capacity, -1)
        done = torch.cat([torch.cat([e(per_expert[i]) for i, e in enumerate(self.experts)]),
                          tokens.new_zeros(1, tokens.shape[1])])
        mixed = done.index_select(0, slot) * gates.gather(1, choice.unsqueeze(1))
        return self.head((tokens + mixed).view(b, t, -1).mean(1))


@entry("moe_top1")
def _moe():
    return classify(Top1MoE(), torch.randn(8, 32, 16), optimizer=adam)


# -- image models with something unusual -----------------------------------------------------------
def conv_block(cin: int, cout: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1), nn.BatchNorm2d(cout), nn.ReLU(inplace=True))


class UNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.down1, self.down2, self.bottom = conv_block(3, 8), conv_block(8, 16), conv_block(16, 32)
        self.up2, self.up1 = nn.ConvTranspose2d(32, 16, 2, stride=2), nn.ConvTranspose2d(16, 8, 2, stride=2)
        self.dec2, self.dec1 = conv_block(32, 16), conv_block(16, 8)
        self.out = nn.Conv2d(8, 1, 1)

    def forward(self, x):
        d1 = self.down1(x)
        d2 = self.down2(F.max_pool2d(d1, 2))
        b = self.bottom(F.max_pool2d(d2, 2))
        u2 = self.dec2(torch.cat([self.up2(b), d2], 1))
        u1 = self.dec1(torch.cat([self.up1(u2), d1], 1))
        return self.out(u1)


@entry("unet")
def _unet():
    mask = (torch.rand(2, 1, 64, 64) > 0.5).float()
    return step(UNet(), images(64), mask, F.binary_cross_entropy_with_logits)


class Checkpointed(nn.Module):
    """torch.utils.checkpoint (non-reentrant) around each block, inside the model's own forward."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = conv_block(3, 16)
        self.blocks = nn.ModuleList(nn.Sequential(conv_block(16, 16), nn.Conv2d(16, 16, 3, padding=1))
                                    for _ in range(3))
        self.head = nn.Linear(16, 10)

    def forward(self, x):
        x = self.stem(x)
        for block in self.blocks:
            x = x + checkpoint(block, x, use_reentrant=False)
        return self.head(x.mean((2, 3)))


@entry("checkpointed")
def _checkpointed():
    return classify(Checkpointed(), images(32, batch=4))


class InplaceActivations(nn.Module):
    """ReLU6(inplace), Hardswish(inplace), and Dropout(inplace) on the view a flatten makes."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU6(inplace=True),
                                      nn.Conv2d(16, 16, 3, stride=2, padding=1), nn.BatchNorm2d(16),
                                      nn.Hardswish(inplace=True), nn.AdaptiveAvgPool2d(4))
        self.drop = nn.Dropout(0.2, inplace=True)
        self.fc = nn.Linear(16 * 16, 64)
        self.act = nn.ReLU6(inplace=True)
        self.head = nn.Linear(64, 10)

    def forward(self, x):
        x = self.drop(torch.flatten(self.features(x), 1))
        x = self.act(self.fc(x)).view(x.shape[0], 8, 8)
        return self.head(self.drop(x).view(x.shape[0], -1))


@entry("inplace_activations")
def _inplace():
    return classify(InplaceActivations(), images(32, batch=4))


class TiedAutoencoder(nn.Module):
    """One layer applied twice, and a decoder that reads the encoder's weight transposed."""

    def __init__(self) -> None:
        super().__init__()
        self.encode = nn.Linear(128, 256)
        self.shared = nn.Linear(256, 256)
        self.decode_bias = nn.Parameter(torch.zeros(128))

    def forward(self, x):
        h = torch.tanh(self.encode(x))
        h = torch.tanh(self.shared(torch.tanh(self.shared(h))))
        return F.linear(h, self.encode.weight.t(), self.decode_bias)


@entry("tied_weights")
def _tied():
    x = torch.randn(256, 128)
    return step(TiedAutoencoder(), x, x.clone(), F.mse_loss)


class SmallConvNet(nn.Module):
    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        self.features = nn.Sequential(conv_block(3, 16), nn.MaxPool2d(2), conv_block(16, 32), nn.AdaptiveAvgPool2d(1),
                                      nn.Flatten())
        self.head = nn.Linear(32, classes)

    def forward(self, x):
        return self.head(self.features(x))


class DictOutput(SmallConvNet):
    def forward(self, x):
        features = self.features(x)
        return {"logits": self.head(features), "features": features}


@entry("dict_output")
def _dict_output():
    return classify(DictOutput(), images(32), loss_fn=lambda out, target: F.cross_entropy(out["logits"], target))


class WithFeatures(SmallConvNet):
    def forward(self, x):
        features = self.features(x)
        return self.head(features), features


def logits_and_feature_penalty(output, target):
    logits, features = output
    return F.cross_entropy(logits, target) + 1e-3 * features.pow(2).mean()


@entry("features_in_loss")
def _features_in_loss():
    return classify(WithFeatures(), images(32), loss_fn=logits_and_feature_penalty)


@entry("features_returned")
def _features_returned():
    return classify(WithFeatures(), images(32), loss_fn=lambda output, target: F.cross_entropy(output[0], target))


@entry("float64_convnet")
def _float64():
    return classify(SmallConvNet().double(), images(32, dtype=torch.float64))


class BFloat16Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.GELU(), nn.AdaptiveAvgPool2d(4), nn.Flatten())
        self.mlp = nn.Sequential(nn.Linear(128, 64), nn.LayerNorm(64), nn.SiLU(), nn.Linear(64, 10))

    def forward(self, x):
        return self.mlp(self.conv(x))


@entry("bfloat16_net")
def _bfloat16():
    return classify(BFloat16Net().to(torch.bfloat16), images(32, batch=8, dtype=torch.bfloat16))


@entry("batchnorm1d_mlp")
def _bn_mlp():
    layers = []
    for width_in, width_out in ((32, 256), (256, 256), (256, 32)):
        layers += [nn.Linear(width_in, width_out), nn.BatchNorm1d(width_out), nn.ReLU()]
    return classify(nn.Sequential(*layers, nn.Linear(32, 10)), torch.randn(128, 32))


class RunningStats(nn.Module):
    """Buffers written in forward: an exponential running mean used to centre the input, and a step counter."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("running_mean", torch.zeros(32))
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))
        self.fc1, self.fc2 = nn.Linear(32, 256), nn.Linear(256, 10)

    def forward(self, x):
        if self.training:
            with torch.no_grad():
                self.running_mean.mul_(0.9).add_(x.mean(0), alpha=0.1)
                self.steps += 1
        return self.fc2(torch.relu(self.fc1(x - self.running_mean)))


@entry("buffers_in_forward")
def _running_stats():
    return classify(RunningStats(), torch.randn(128, 32))


class GeneratorNoise(nn.Module):
    """Dropout-like noise drawn from the model's own torch.Generator, not the global one."""

    def __init__(self) -> None:
        super().__init__()
        self.generator = torch.Generator().manual_seed(1234)
        self.fc1, self.fc2 = nn.Linear(32, 256), nn.Linear(256, 10)

    def forward(self, x):
        h = torch.relu(self.fc1(x))
        keep = torch.rand(h.shape, generator=self.generator) > 0.25
        return self.fc2(h * keep / 0.75)


@entry("user_generator")
def _generator():
    return classify(GeneratorNoise(), torch.randn(128, 32))


class ModifiesSavedOutput(nn.Module):
    """A bug eager catches: sigmoid saves its output for backward, which is then scaled in place."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2, self.head = nn.Linear(32, 256), nn.Linear(256, 256), nn.Linear(256, 10)

    def forward(self, x):
        h = torch.sigmoid(self.fc2(torch.relu(self.fc1(x))))
        out = self.head(h)
        h.mul_(2)
        return out


@entry("modifies_saved_output")
def _modifies_saved():
    return classify(ModifiesSavedOutput(), torch.randn(128, 32))
