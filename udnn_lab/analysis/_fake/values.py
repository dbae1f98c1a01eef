"""Real values beside the fake tensors that a model's control flow reads (NOTE [known values]).

NOTE [known values]
  1. A fake tensor has no values, so code that decides on values cannot take the path eager
     takes. Hugging Face's models ask ``is_tracing(tensor)`` before such a decision (is the
     batch a packed sequence? is the attention mask all ones?) and, for a fake tensor, take the
     path a compiler needs: a materialised mask instead of the kernel's causal flag, tens of
     ops more than the real step runs, so a plan made from the trace stops the real step at
     its first differing op. Other code fails outright (a data-dependent ``item()``).
  2. Integer and bool tensors of at most ``KNOWN_NUMEL`` elements carry their real values
     beside them when the values follow from what the trace knows: the step's inputs, factories
     (``arange``, ``zeros``, ``full``, ...), ops whose values do not depend on their inputs'
     (``new_ones``, ``zeros_like``), and any op all of whose tensor inputs carry values (a real
     integer tensor made outside fake mode, ``torch.tensor([-1, 0])``, carries its own). Such an
     op runs again on the values, on the CPU, outside fake mode; a random op never does, and an
     op that writes into a tensor with values from one without them leaves it without.
  3. Reading a scalar out of a tensor with values (``item()``, ``bool()``) gives the real
     answer, and Hugging Face's ``is_fake_tensor`` says False for it during the trace, so its
     checks run on it as in eager. Float tensors never carry values: activations are what the
     trace is for, and no model decides on them.
  4. The recorder follows the values as it runs each op (``follow``, after its fake fast paths:
     views and all), and answers a scalar read of a tensor with values itself (``read``), so the
     read is in the trace as a real step's is. The trace enters ``KnownValues`` around the step
     (and the forward it runs again for its holders) for the duration of transformers' check.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.weak import WeakIdKeyDictionary

KNOWN_NUMEL = 1 << 20  # a position or mask tensor of a large batch; 8 MiB of int64 at most

aten = torch.ops.aten
_FACTORIES = {aten.arange, aten.zeros, aten.ones, aten.full, aten.scalar_tensor, aten.eye, aten.tril_indices,
              aten.triu_indices}
_VALUE_FREE = {aten.new_zeros, aten.new_ones, aten.new_full, aten.zeros_like, aten.ones_like, aten.full_like}


def _exact(tensor: Any) -> bool:
    return isinstance(tensor, torch.Tensor) and not (tensor.is_floating_point() or tensor.is_complex())


class KnownValues:
    """Carries real values beside small integer and bool fake tensors (NOTE [known values])."""

    def __init__(self) -> None:
        self.values: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self._patched: list[tuple[Any, str, Any]] = []

    def know(self, real: Any, fake: Any) -> None:
        """The values of the real tensors in ``real`` beside the fakes made of them (``fake``, the same structure)."""
        for value, made in zip(tree_flatten(real)[0], tree_flatten(fake)[0]):
            if _exact(value) and isinstance(made, FakeTensor) and value.numel() <= KNOWN_NUMEL \
                    and type(value) is torch.Tensor and not value.is_meta:  # a meta input has no values to know
                self.values[made] = value.detach().to("cpu", copy=True)

    def knows(self, tensor: Any) -> bool:
        return isinstance(tensor, torch.Tensor) and tensor in self.values

    def _given(self, tensor: torch.Tensor) -> bool:
        """Whether an op's input has values: known, or a real tensor the model made outside fake mode (a constant
        of ``torch.tensor([-1, 0])``, which fake mode lifts into a fake) (NOTE 2)."""
        return self.knows(tensor) or (type(tensor) is torch.Tensor and _exact(tensor) and not tensor.is_meta
                                      and tensor.numel() <= KNOWN_NUMEL)

    def read(self, tensor: torch.Tensor) -> Any:
        """``tensor.item()`` of a tensor with values (NOTE 4)."""
        with unset_fake_temporarily(), torch._C._DisableTorchDispatch():
            return self.values[tensor].item()

    def __enter__(self):
        transformers_utils = sys.modules.get("transformers.utils.import_utils")
        if transformers_utils is not None and hasattr(transformers_utils, "is_fake_tensor"):
            original = transformers_utils.is_fake_tensor
            self._patched.append((transformers_utils, "is_fake_tensor", original))
            transformers_utils.is_fake_tensor = lambda x: original(x) and not self.knows(x)  # NOTE 3
        return self

    def __exit__(self, *exc) -> None:
        while self._patched:
            module, name, original = self._patched.pop()
            setattr(module, name, original)

    def follow(self, func, args: tuple, kwargs: dict, out: Any) -> None:
        """After ``func`` ran on fakes: its outputs' values where they follow (NOTE 2)."""
        # most ops make float tensors: decided on the first output alone, before anything is flattened
        first = out if isinstance(out, torch.Tensor) else out[0] if isinstance(out, (tuple, list)) and out else None
        if isinstance(first, torch.Tensor) and _exact(first) and torch.Tag.nondeterministic_seeded not in func.tags:
            outputs = _tensors(out)
            if all(_exact(t) and t.numel() <= KNOWN_NUMEL for t in outputs):
                inputs = _tensors((args, kwargs))
                packet = func.overloadpacket
                if (inputs and all(self._given(t) for t in inputs)) or (not inputs and packet in _FACTORIES) \
                        or packet in _VALUE_FREE:
                    self._follow(func, args, kwargs, outputs)
                    return
        if self.values and func._schema.is_mutable:
            self._forget_written(func, args, kwargs)

    def _follow(self, func, args: tuple, kwargs: dict, outputs: list[torch.Tensor]) -> None:
        try:
            real = _tensors(self._run(func, args, kwargs))
        except Exception:  # noqa: BLE001 - a value not followed is only a value not known
            real = []
        if len(real) != len(outputs):
            for tensor in outputs:
                self.values.pop(tensor, None)
            return
        for tensor, value in zip(outputs, real):
            self.values[tensor] = value

    def _run(self, func, args: tuple, kwargs: dict):
        """``func`` on the values (on the CPU, outside fake mode); a tensor without values stands in by its shape
        (only value-free ops have one)."""
        def real(value):
            if not isinstance(value, torch.Tensor):
                return value
            known = self.values.get(value)
            if known is None and type(value) is torch.Tensor:  # a real tensor: its own values
                return value.to("cpu")
            return known if known is not None else torch.zeros(value.shape, dtype=value.dtype)

        with unset_fake_temporarily(), torch._C._DisableTorchDispatch():
            real_args, real_kwargs = tree_map(real, (args, kwargs))
            if "device" in real_kwargs:
                real_kwargs["device"] = torch.device("cpu")
            real_kwargs.pop("pin_memory", None)
            return func(*real_args, **real_kwargs)

    def _forget_written(self, func, args: tuple, kwargs: dict) -> None:
        """An op not followed that writes into a tensor with values leaves it, and its views, without (NOTE 2)."""
        named = dict(zip((a.name for a in func._schema.arguments), args)) | kwargs
        written = [tensor for argument in func._schema.arguments
                   if argument.alias_info is not None and argument.alias_info.is_write
                   for tensor in _tensors(named.get(argument.name))]
        storages = {id(tensor.untyped_storage()) for tensor in written if self.knows(tensor)}
        if storages:
            for tensor in [t for t in self.values.keys() if id(t.untyped_storage()) in storages]:
                self.values.pop(tensor, None)


def _tensors(value: Any) -> list[torch.Tensor]:
    return [leaf for leaf in tree_flatten(value)[0] if isinstance(leaf, torch.Tensor)]
