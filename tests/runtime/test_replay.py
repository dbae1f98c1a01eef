"""Recompute by replay (runtime/_replay.py, NOTE [offload runtime] 6)."""

import pytest
import torch

from udnn_lab.errors import ReplayError
from udnn_lab.graph import Recompute
from udnn_lab.runtime._made_bytes import MadeBytes
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


def test_a_replay_counts_the_peak_of_the_storages_it_makes_beside_those_it_reads():
    """A step's count of live bytes sees none of a replay's ops; the replay tells it the peak of what it made."""
    aten = torch.ops.aten
    x = torch.randn(64, 64)  # 16 KiB; read from before the replay: not counted
    replay = Replay(Recompute(tensors=(0,), ops=(0, 1, 2), at_op=9))
    made = _record(replay, aten.relu.default, x)
    grown = _record(replay, aten.exp.default, made)
    out = _record(replay, aten.mul.Tensor, grown, 2.0)
    replay.restores[0] = replay.outputs[id(out)][1]
    counted = MadeBytes()
    restored = replay.run(counted)[0]
    assert torch.equal(restored, out)
    assert counted.peak == 2 * x.nbytes  # two of the three outputs at once: each goes once the next has read it
    assert counted.live == x.nbytes  # the restored one, which the step then holds


def test_a_count_of_live_bytes_peaks_with_what_was_made_out_of_its_sight():
    from udnn_lab.runtime.live_bytes import LiveBytes

    kept = torch.zeros(1024)
    counter = LiveBytes([kept])
    with counter:
        made = torch.ones(256) * 2
    counter.during(10_000)
    assert counter.peak == kept.nbytes + made.nbytes + 10_000


def test_a_replay_s_peak_counts_the_inputs_it_lets_go_as_it_ends():
    """A tensor forward let go that only the recording holds (a source the runtime keeps for the recomputation) is
    alive while the replay runs and goes as it ends: a count taken after it is below the replay's peak by it."""
    aten = torch.ops.aten
    source = torch.randn(64, 64)
    replay = Replay(Recompute(tensors=(0,), ops=(0,), at_op=9))
    out = _record(replay, aten.exp.default, source)
    replay.restores[0] = replay.outputs[id(out)][1]
    nbytes = source.nbytes
    del source  # the recording holds it now
    counted = MadeBytes()
    replay.run(counted)
    assert counted.peak == nbytes and counted.gone_from_before == nbytes
    assert counted.above_now() == 2 * nbytes  # the source and the restored tensor were alive at once
    counted.close()
