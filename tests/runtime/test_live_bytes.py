"""LiveBytes: the bytes a CPU step holds, storage by storage."""

import torch

from udnn_lab.runtime.live_bytes import LiveBytes

FLOAT = 4


def test_a_storage_first_met_as_an_out_tensor_was_held_since_the_count_began():
    """DDP's gradient buckets live between steps and are first written in backward, after the step's peak."""
    held = torch.zeros(1000)
    view = held[:10]  # as a bucket's view for one gradient
    with LiveBytes() as counter:
        torch.ones(10_000).neg_()  # the step's largest moment, gone at once
        torch.mul(torch.ones(10), 2.0, out=view)
    assert counter.peak == (10_000 + 1000) * FLOAT


def test_a_storage_the_count_was_told_of_is_counted_once():
    held = torch.zeros(1000)
    with LiveBytes(existing=[held]) as counter:
        torch.ones(10_000).neg_()
        torch.mul(torch.ones(10), 2.0, out=held[:10])
    assert counter.peak == (10_000 + 1000) * FLOAT
