"""Recompute by replay (runtime/_replay.py, NOTE [offload runtime] 6)."""

import pytest
import torch

from udnn_lab.errors import ReplayError
from udnn_lab.graph import Recompute
from udnn_lab.runtime._replay import Replay


def _record(replay: Replay, func, *args):
    out = func(*args)
    replay.record(func, args, {}, out, None)
    return out


def test_a_view_no_recorded_op_made_is_rebuilt_over_the_replayed_storage():
    """An op outside the recording (here: the slicing) views a tensor the recomputation makes; the replay rebuilds
    that view over its own output, with the original's sizes, strides and offset."""
    aten = torch.ops.aten
    x = torch.randn(4, 6)
    replay = Replay(Recompute(tensors=(0,), ops=(0, 1), at_op=9))
    made = _record(replay, aten.relu.default, x)
    window = made.t()[1:4, ::2]  # not recorded: a view of the recomputation's storage, with an offset
    out = _record(replay, aten.mul.Tensor, window, 3.0)
    replay.restores[0] = replay.made[next(key for key in replay.made if key[1] == tuple(out.shape))][1]
    restored = replay.run()[0]
    assert torch.equal(restored, out) and restored.untyped_storage().data_ptr() != out.untyped_storage().data_ptr()


def test_a_view_of_another_dtype_is_refused_with_what_to_do():
    aten = torch.ops.aten
    replay = Replay(Recompute(tensors=(0,), ops=(0, 1), at_op=9))
    made = _record(replay, aten.relu.default, torch.randn(4, 6))
    with pytest.raises(ReplayError, match="view of a torch.float32 tensor.*plan this tensor as kept or offloaded"):
        _record(replay, aten.neg.default, made.view(torch.int32))
