"""The plan promise (tests/corpus/promise.py) on small modules hypothesis makes up.

A model is a stem (a Conv2d on an image, a Linear on a vector) and 3 to 8 blocks drawn from a
small grammar: Conv2d or Linear (with or without bias), BatchNorm2d/1d, in-place activations
(ReLU, ReLU6, Hardswish) and out-of-place ones (GELU, Tanh), views (flatten, reshape and view
back, transpose with or without contiguous), a concatenation of a block's input with its output,
a residual add, Dropout (in place or not, in training mode), one Conv2d or Linear applied twice,
and optionally an intermediate returned beside the logits (the loss reads the logits only, or
both). The draws are plain values (``Arch``); the weights come from a drawn seed, so a shrunk
``Arch`` rebuilds the same model: ``Entry("generated", functools.partial(build, arch))``.

The generator tracks shapes, so every model runs, and tracks which tensors their maker saved for
backward (the output of an in-place ReLU, of Tanh, and views of them), so that nothing is written
in place where eager would reject it. Feature maps are at least 64 KiB, the size below which the
vDNN policies never move a tensor, and at most a few hundred KiB, so a check takes well under a
second.

CI runs a fixed (derandomized) sample; ``PROMISE_EXAMPLES=150`` looks further.
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass, replace

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from tests.corpus.models import Entry
from tests.corpus.promise import BUDGET_KINDS, PLANNED_POLICIES, SIM_TOLERANCE, check

EXAMPLES = int(os.environ.get("PROMISE_EXAMPLES", "25"))
FLOOR = 64 << 10  # udnn_lab.planning.vdnn.SIZE_FLOOR: smaller feature maps are never offloaded
CLASSES = 10
VECTOR_BATCHES = (32, 64, 128)  # a vector input needs rows for its activations to reach FLOOR
FLAT_WIDTH = 64  # the Linear after a flatten: small, its input has thousands of features
MAX_FEATURES = 1024  # square Linears (residual, twice) only up to this width


# -- the modules a block becomes -----------------------------------------------------------------
class Reshape(nn.Module):
    """A reshape to (batch, -1, last) and a view back: a view of a view (a copy first if not contiguous)."""

    def forward(self, x):
        return x.reshape(x.shape[0], -1, x.shape[-1]).view(x.shape)


class Transpose(nn.Module):
    """An image's two spatial dims swapped (square, so the shape holds); a vector's (2, n/2) halves interleaved."""

    def __init__(self, contiguous: bool) -> None:
        super().__init__()
        self.contiguous = contiguous

    def forward(self, x):
        y = x.transpose(2, 3) if x.dim() == 4 else x.reshape(x.shape[0], 2, -1).transpose(1, 2)
        if self.contiguous:
            y = y.contiguous()
        return y if x.dim() == 4 else y.reshape(x.shape)

    def extra_repr(self) -> str:
        return f"contiguous={self.contiguous}"


class Concat(nn.Module):
    """torch.cat([x, inner(x)], 1): the block's input beside its output."""

    def __init__(self, *inner: nn.Module) -> None:
        super().__init__()
        self.inner = nn.Sequential(*inner)

    def forward(self, x):
        return torch.cat([x, self.inner(x)], 1)


class Residual(nn.Module):
    """x + inner(x)."""

    def __init__(self, *inner: nn.Module) -> None:
        super().__init__()
        self.inner = nn.Sequential(*inner)

    def forward(self, x):
        return x + self.inner(x)


class Twice(nn.Module):
    """One layer (its parameters too) applied twice: layer(layer(x))."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, x):
        return self.layer(self.layer(x))


class Generated(nn.Module):
    """The blocks in order, then a head on the (spatially averaged) result; with ``features_at`` it returns
    (logits, the output of that block)."""

    def __init__(self, blocks: list[nn.Module], classes_in: int, features_at: int | None) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(blocks)
        self.head = nn.Linear(classes_in, CLASSES)
        self.features_at = features_at

    def forward(self, x):
        features = None
        for index, block in enumerate(self.blocks):
            x = block(x)
            if index == self.features_at:
                features = x
        logits = self.head(x.mean((2, 3)) if x.dim() == 4 else x)
        return logits if self.features_at is None else (logits, features)

    def extra_repr(self) -> str:
        return f"features_at={self.features_at}"


ACTIVATIONS = {"relu_": lambda: nn.ReLU(inplace=True), "relu6_": lambda: nn.ReLU6(inplace=True),
               "hardswish_": lambda: nn.Hardswish(inplace=True), "gelu": nn.GELU, "tanh": nn.Tanh}
IN_PLACE = ("relu_", "relu6_", "hardswish_")
SAVES_OUTPUT = ("relu_", "tanh")  # their backward reads their output: writing it in place is what eager rejects

LAYERS = {
    "conv": lambda cin, cout, kernel, bias: nn.Conv2d(cin, cout, kernel, padding=kernel // 2, bias=bias),
    "linear": lambda fin, fout, bias: nn.Linear(fin, fout, bias=bias),
    "bn2d": nn.BatchNorm2d,
    "bn1d": nn.BatchNorm1d,
    "act": lambda name: ACTIVATIONS[name](),
    "dropout": lambda p, inplace: nn.Dropout(p, inplace=inplace),
    "flatten": nn.Flatten,
    "reshape": Reshape,
    "transpose": Transpose,
    "cat": lambda *inner: Concat(*map(layer, inner)),
    "residual": lambda *inner: Residual(*map(layer, inner)),
    "twice": lambda inner: Twice(layer(inner)),
}


def layer(block: tuple) -> nn.Module:
    return LAYERS[block[0]](*block[1:])


# -- what is drawn ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Arch:
    """A generated model, as plain values: ``build(arch)`` makes its training step."""

    image: bool
    batch: int
    channels: int  # of the image, or features of the vector
    side: int  # of the (square) image; 0 for a vector
    blocks: tuple[tuple, ...]  # (layer name, *its arguments), the stem first
    head_in: int  # channels or features of the last block's output
    features_at: int | None  # the block whose output the model returns beside the logits
    features_in_loss: bool  # the loss reads those features too
    optimizer: str  # "sgd" (momentum) or "adam"
    seed: int  # of the weights


@dataclass(frozen=True)
class State:
    """The tensor between two blocks, as the generator knows it."""

    image: bool
    c: int  # channels, or features
    width: int  # the working width: this many channels make a feature map of at least FLOOR bytes
    saved: bool  # its maker saved it (or the tensor it views) for backward: nothing may write it in place


def _weighted(draw, s: State, out: int) -> tuple:
    bias = draw(st.booleans())
    if s.image:
        return ("conv", s.c, out, draw(st.sampled_from([3, 1])), bias)
    return ("linear", s.c, out, bias)


def _activation(draw, saved: bool) -> tuple:
    return ("act", draw(st.sampled_from([name for name in ACTIVATIONS if not (saved and name in IN_PLACE)])))


def _draw_weighted(draw, s: State):
    out = draw(st.sampled_from(sorted({s.width, s.c}) if s.c <= 2 * s.width else [s.width]))
    return _weighted(draw, s, out), replace(s, c=out, saved=False)


def _draw_norm(draw, s: State):
    return ("bn2d" if s.image else "bn1d", s.c), replace(s, saved=False)


def _draw_activation(draw, s: State):
    block = _activation(draw, s.saved)
    return block, replace(s, saved=block[1] in SAVES_OUTPUT)


def _draw_dropout(draw, s: State):
    inplace = not s.saved and draw(st.booleans())
    return ("dropout", draw(st.sampled_from([0.1, 0.25, 0.5])), inplace), replace(s, saved=False)


def _draw_reshape(draw, s: State):
    return ("reshape",), s


def _draw_transpose(draw, s: State):
    contiguous = draw(st.booleans())
    copies = contiguous or not s.image  # a vector's transpose is reshaped back, which copies it
    return ("transpose", contiguous), replace(s, saved=s.saved and not copies)


def _draw_flatten(draw, s: State, side: int):
    return ("flatten",), State(image=False, c=s.c * side * side, width=FLAT_WIDTH, saved=s.saved)


def _draw_cat(draw, s: State):
    inner = [_weighted(draw, s, s.width)]
    if draw(st.booleans()):
        inner.append(_activation(draw, saved=False))
    return ("cat", *inner), replace(s, c=s.c + s.width, saved=False)


def _draw_residual(draw, s: State):
    inner = [_weighted(draw, s, s.c)]
    if draw(st.booleans()):
        inner.append(_draw_norm(draw, s)[0])
    if draw(st.booleans()):
        inner.append(_activation(draw, saved=False))
    return ("residual", *inner), replace(s, saved=False)


def _draw_twice(draw, s: State):
    return ("twice", _weighted(draw, s, s.c)), replace(s, saved=False)


BLOCKS = {"weighted": _draw_weighted, "norm": _draw_norm, "activation": _draw_activation, "dropout": _draw_dropout,
          "reshape": _draw_reshape, "transpose": _draw_transpose, "cat": _draw_cat, "residual": _draw_residual,
          "twice": _draw_twice}


def _choices(s: State) -> list[str]:
    names = ["weighted", "norm", "activation", "dropout", "reshape", "transpose"]
    if s.image:
        names.append("flatten")
    if not s.image and s.c % 2:
        names.remove("transpose")
    square = s.image or s.c <= MAX_FEATURES
    if square and s.c <= s.width:  # channels stay within twice the working width
        names.append("cat")
    if square and s.c <= 2 * s.width:
        names += ["residual", "twice"]
    return names


@st.composite
def archs(draw) -> Arch:
    image = draw(st.booleans())
    channels = draw(st.integers(4, 16))
    if image:
        batch, side = draw(st.integers(2, 4)), draw(st.integers(8, 16))
        width = 4 * math.ceil(FLOOR / (4 * batch * side * side) / 4)  # the stem's maps reach FLOOR
        stem = ("conv", channels, width, 3, draw(st.booleans()))
    else:
        batch, side = draw(st.sampled_from(VECTOR_BATCHES)), 0
        width = FLOOR // (4 * batch)
        stem = ("linear", channels, width, draw(st.booleans()))
    state = State(image=image, c=width, width=width, saved=False)
    blocks = [stem]
    for _ in range(draw(st.integers(3, 8))):
        name = draw(st.sampled_from(_choices(state)))
        block, state = _draw_flatten(draw, state, side) if name == "flatten" else BLOCKS[name](draw, state)
        blocks.append(block)
    features_at = draw(st.none() | st.integers(0, len(blocks) - 1))
    return Arch(image=image, batch=batch, channels=channels, side=side, blocks=tuple(blocks), head_in=state.c,
                features_at=features_at, features_in_loss=features_at is not None and draw(st.booleans()),
                optimizer=draw(st.sampled_from(["sgd", "adam"])), seed=draw(st.integers(0, 2**16)))


# -- the step it makes -----------------------------------------------------------------------------
def logits_only(output, target):
    return F.cross_entropy(output[0], target)


def logits_and_features(output, target):
    logits, features = output
    return F.cross_entropy(logits, target) + 1e-3 * features.pow(2).mean()


def model_of(arch: Arch) -> Generated:
    return Generated([layer(block) for block in arch.blocks], arch.head_in, arch.features_at)


def build(arch: Arch) -> tuple:
    """(model, example input, target, loss, optimizer), as a corpus entry's ``build`` returns them."""
    torch.manual_seed(arch.seed)
    model = model_of(arch)
    shape = (arch.batch, arch.channels, arch.side, arch.side) if arch.image else (arch.batch, arch.channels)
    example, target = torch.randn(shape), torch.randint(CLASSES, (arch.batch,))
    loss_fn = F.cross_entropy if arch.features_at is None else \
        logits_and_features if arch.features_in_loss else logits_only
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9) if arch.optimizer == "sgd" else \
        torch.optim.Adam(model.parameters(), lr=1e-3)
    return model, example, target, loss_fn, optimizer


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# -- the tests -------------------------------------------------------------------------------------
@settings(max_examples=max(EXAMPLES, 1) * 2, deadline=None, derandomize=True, database=None)
@given(arch=archs())
def test_every_generated_model_steps_eagerly_with_maps_past_the_floor(arch):
    """The generator's own promise: shapes fit, eager accepts the step, and some saved tensor is one the
    vDNN policies would move (and none is large)."""
    model, example, target, loss_fn, _ = build(arch)
    saved: list[int] = []
    params = {p.data_ptr() for p in model.parameters()}

    def pack(tensor):
        if tensor.untyped_storage().data_ptr() not in params:
            saved.append(tensor.untyped_storage().nbytes())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = loss_fn(model(example), target)
    loss.backward()
    assert torch.isfinite(loss), f"{model!r}"
    assert FLOOR <= max(saved) <= 1 << 20, f"saved tensors of {sorted(set(saved))} bytes\n{model!r}"


@settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None, print_blob=True)
@given(arch=archs(), policy=st.sampled_from(PLANNED_POLICIES), budget_kind=st.sampled_from(BUDGET_KINDS))
def test_a_plan_keeps_the_promise_on_a_generated_model(arch, policy, budget_kind):
    row = check(Entry("generated", functools.partial(build, arch)), policy, budget_kind)
    about = f"\n{model_of(arch)!r}\n{row}"
    if row.get("refused_like_eager"):  # eager rejects the step, and the runtime refused it too: as promised
        assert row["status"] == "ok", about
        return
    assert not row["error"], row["error"] + about
    assert row["exact"], row["status"] + about
    assert max(row["measured_peak_bytes"], row["second_peak_bytes"]) <= row["budget_bytes"], \
        f"measured {row['measured_peak_bytes']}, {row['second_peak_bytes']} over the budget {row['budget_bytes']}" \
        + about
    assert row["sim_error"] <= SIM_TOLERANCE, \
        f"simulated {row['simulated_peak_bytes']}, measured {row['measured_peak_bytes']}" + about
    assert row["measured_peak_bytes"] == row["second_peak_bytes"], "unequal peaks" + about
    assert row["status"] == "ok", row["status"] + about  # and everything else the checker holds it to (RNG state)


# Found by this test with PROMISE_EXAMPLES=150, shrunk, and fixed: kept here as regressions.
FOUND = {
    # the CPU's batch norm returns a contiguous output for a transposed image; the fake kernel kept the strides
    "strided batch norm": Arch(image=True, batch=2, channels=4, side=8, blocks=(
        ("conv", 4, 128, 3, False), ("transpose", False), ("bn2d", 128), ("reshape",)), head_in=128,
        features_at=None, features_in_loss=False, optimizer="sgd", seed=0),
    # a returned intermediate written in place later: a recompute reading it cannot replay forward
    "written after it is read": Arch(image=False, batch=32, channels=4, side=0, blocks=(
        ("linear", 4, 512, False), ("dropout", 0.1, True), ("bn1d", 512), ("linear", 512, 512, False)),
        head_in=512, features_at=0, features_in_loss=False, optimizer="sgd", seed=0),
}


@pytest.mark.parametrize("found", FOUND, ids=list(FOUND))
@pytest.mark.parametrize("policy", ["vdnn-all", "auto"])
def test_models_the_property_test_found_keep_the_promise(found, policy):
    arch = FOUND[found]
    for budget_kind in ("min", "midway"):
        row = check(Entry(found, functools.partial(build, arch)), policy, budget_kind)
        assert row["status"] == "ok", (row["status"], row.get("error"))
