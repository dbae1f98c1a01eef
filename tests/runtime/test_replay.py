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
    replay.restores[0] = replay.outputs[id(out)][1]
    restored = replay.run()[0]
    assert torch.equal(restored, out) and restored.untyped_storage().data_ptr() != out.untyped_storage().data_ptr()


def test_a_view_of_another_dtype_is_refused_with_what_to_do():
    aten = torch.ops.aten
    replay = Replay(Recompute(tensors=(0,), ops=(0, 1), at_op=9))
    made = _record(replay, aten.relu.default, torch.randn(4, 6))
    with pytest.raises(ReplayError, match="view of a torch.float32 tensor.*plan this tensor as kept or offloaded"):
        _record(replay, aten.neg.default, made.view(torch.int32))


def test_an_alias_no_recorded_op_made_reads_the_output_it_aliases():
    """Another tensor object with an output's very view (an op the trace does not count made it) is that output at
    replay, not a read of the storage from before; a recorded output that is gone no longer matches."""
    aten = torch.ops.aten
    x = torch.randn(4, 6)
    replay = Replay(Recompute(tensors=(0,), ops=(0, 1), at_op=9))
    made = _record(replay, aten.relu.default, x)
    alias = made.detach()
    assert alias is not made and id(alias) not in replay.outputs
    out = _record(replay, aten.mul.Tensor, alias, 2.0)
    assert replay.calls[1].args[0] == replay.outputs[id(made)][1]  # the first call's output, not a view of it
    replay.restores[0] = replay.outputs[id(out)][1]
    x.add_(1.0)  # the replay reads x: changed after forward used it, so forward cannot be reproduced
    with pytest.raises(ReplayError, match="modified by an inplace operation"):
        replay.run()


def test_a_replay_holds_its_outputs_weakly():
    aten = torch.ops.aten
    replay = Replay(Recompute(tensors=(0,), ops=(0,), at_op=9))
    out = _record(replay, aten.relu.default, torch.randn(4, 6))
    ref = replay.outputs[id(out)][0]
    del out
    assert ref() is None
