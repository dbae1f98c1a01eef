"""A model traced under fake tensors keeps none of them (NOTE [what a traced model keeps])."""

import functools

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor

import udnn_lab as ul


@functools.lru_cache(maxsize=4)
def _offsets(length: int) -> torch.Tensor:
    return torch.arange(length).float()


def _cached_method(method):  # a wrapper over its own cache, as transformers' compile_compatible_method_lru_cache
    cached = functools.lru_cache(maxsize=4)(method)

    @functools.wraps(method)
    def call(*args):
        return cached(*args)

    return call


class _Cached(nn.Module):
    """Caches what it makes in each way a model's Python can: a table set on first use, a list filled in place, an
    lru_cache of a module function and one of a static method behind a wrapper."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.filled: list[torch.Tensor] = []
        self.kept = "a plain attribute"

    @staticmethod
    @_cached_method
    def scale(length: int) -> torch.Tensor:
        return torch.ones(length) * 2

    def forward(self, x):
        if not hasattr(self, "table"):
            self.table = torch.ones(8)
        self.filled.append(torch.zeros(1))
        return self.linear(x) * self.table + _offsets(8) + self.scale(8)


def _fakes_left(model: nn.Module) -> list[str]:
    held = [f"{name}.{key}" for name, module in model.named_modules() for key, value in vars(module).items()
            if isinstance(value, FakeTensor) or (isinstance(value, list) and any(isinstance(v, FakeTensor)
                                                                                  for v in value))]
    return held + [f"cache {c.__name__}" for c in (_offsets, _Cached.scale)
                   if c(8).__class__ is FakeTensor]


def _clear():
    _offsets.cache_clear()
    for cell in _Cached.scale.__closure__:  # the wrapper's own cache
        cell.cell_contents.cache_clear()


def _names(graph) -> list[str]:
    return [op.name for op in graph.ops]


def test_a_traced_model_keeps_no_fake_tensor_and_trains_on_real_ones_afterwards():
    model = _Cached()
    before = model.kept
    _clear()
    ul.trace(model, torch.randn(4, 8), loss_fn=lambda out: out.sum(),
             optimizer=torch.optim.SGD(model.parameters(), lr=0.1), device="cuda")  # a CPU standing in for CUDA
    assert _offsets.cache_info().currsize == 0  # traced for another device: the first real step fills it
    assert _fakes_left(model) == []
    assert not hasattr(model, "table") and model.filled == [] and model.kept is before
    loss = model(torch.randn(4, 8)).sum()
    loss.backward()
    assert type(loss) is torch.Tensor and type(model.linear.weight.grad) is torch.Tensor


def test_the_trace_is_the_steady_step_and_the_caches_hold_its_entries_made_for_real():
    """NOTE [what a traced model keeps] 3: a first step fills the caches; the trace records the next one, and the
    caches are filled again on the real model, so the first real step is the steady one too."""
    model, x = _Cached(), torch.randn(4, 8)
    _clear()
    graph = ul.trace(model, x, loss_fn=lambda out: out.sum())
    assert "aten.arange.default" not in _names(graph)  # the cache's op, made once
    assert type(_offsets(8)) is torch.Tensor and _offsets.cache_info().currsize == 1
    assert type(_Cached.scale(8)) is torch.Tensor
    model.table = torch.ones(8)  # as the first real step leaves it
    assert _names(graph) == _names(ul.trace(model, x, loss_fn=lambda out: out.sum(), fake=False))


def test_a_cache_the_trace_only_read_keeps_its_entries():
    _clear()
    made = _offsets(8)  # real, before the trace: the trace hits it and makes no entry
    model = _Cached()
    model.table = torch.ones(8)
    ul.trace(model, torch.randn(4, 8), loss_fn=lambda out: out.sum())
    assert _offsets(8) is made and _offsets.cache_info().currsize == 1
    assert type(model.table) is torch.Tensor


def test_a_huggingface_model_that_caches_its_position_index_trains_on_real_tensors_after_a_trace():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.BeitConfig(num_hidden_layers=1, hidden_size=32, num_attention_heads=2,
                                     intermediate_size=64, image_size=16, patch_size=8, num_labels=3,
                                     use_relative_position_bias=True)
    model = transformers.BeitForImageClassification(config)
    pixels, labels = torch.randn(2, 3, 16, 16), torch.tensor([0, 2])
    ul.trace(model, {"pixel_values": pixels, "labels": labels}, loss_fn=lambda out: out.loss)
    loss = model(pixel_values=pixels, labels=labels).loss
    assert type(loss) is torch.Tensor and torch.isfinite(loss)


def test_a_watched_cache_answers_for_the_cache_while_the_trace_runs():
    """Code that asks a cache about itself mid-step (cache_info, cache_clear) is answered by the cache it watches."""
    asked = []

    class _Asks(nn.Linear):
        def forward(self, x):
            asked.append(_offsets.cache_info().maxsize)
            return super().forward(x) * _offsets(4)

    _clear()
    ul.trace(_Asks(4, 4), torch.randn(2, 4))
    assert asked and set(asked) == {4}
