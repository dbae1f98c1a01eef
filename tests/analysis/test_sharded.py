"""The storages FSDP2 resizes in place, and the note of which were resized (NOTE [resized storages])."""

from contextlib import contextmanager

import pytest
import torch

import udnn_lab as ul
from udnn_lab.analysis import _recording
from udnn_lab.analysis._sharded import resizes_seen


def test_resizes_are_noted_inside_and_the_method_is_given_back_after_nested_uses():
    original = torch.UntypedStorage.resize_
    storage = torch.zeros(4).untyped_storage()
    with resizes_seen() as outer:
        with resizes_seen() as inner:
            storage.resize_(0)
        storage.resize_(16)
    assert inner == {id(storage)} and outer == {id(storage)} and storage.nbytes() == 16
    assert torch.UntypedStorage.resize_ is original
    with pytest.raises(RuntimeError), resizes_seen():
        raise RuntimeError("a step that fails")
    assert torch.UntypedStorage.resize_ is original


@pytest.mark.parametrize("reshard", [True, False])
def test_a_step_polled_only_where_a_resize_was_noted_is_the_step_polled_before_every_op(monkeypatch, reshard):
    work = ul.zoo.get("mlp3", batch=2, optimizer="adam")
    noted = ul.trace(work, parallel=ul.FSDP(4, reshard_after_forward=reshard))

    @contextmanager
    def not_known():
        yield None  # the recorder then polls every watched storage before every op

    monkeypatch.setattr(_recording, "resizes_seen", not_known)
    every = ul.trace(work, parallel=ul.FSDP(4, reshard_after_forward=reshard))
    assert noted.ops == every.ops and noted.tensors == every.tensors
    gathered = sum(t.name.endswith("(unsharded)") for t in noted.tensors)  # 3 layers' weights and biases
    assert gathered > 6 if reshard else gathered == 6  # resharded after forward: gathered again for backward
