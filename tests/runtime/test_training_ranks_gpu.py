"""``ul.train(..., parallel=spec)`` on CUDA: NCCL ranks, one GPU each (as many ranks as this machine has GPUs).

Each rank's measured peak (``torch.cuda.max_memory_allocated``) against the trace of that rank for CUDA, and the
trained parameters against one process on the whole batches.
"""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch

import udnn_lab as ul
from udnn_lab import zoo

pytestmark = pytest.mark.gpu


def _world() -> int:
    return max(1, min(2, torch.cuda.device_count()))


@pytest.mark.parametrize("make_spec", [ul.DDP, ul.FSDP], ids=["DDP", "FSDP"])
def test_nccl_ranks_train_and_peak_as_predicted(make_spec):
    world = _world()
    spec = make_spec(world)
    work = zoo.get("mlp3", batch=8 * world, seed=0, device="cuda")
    generator = torch.Generator().manual_seed(0)
    batches = [(torch.randn(8 * world, 784, generator=generator), torch.randint(0, 10, (8 * world,),
                                                                               generator=generator))
               for _ in range(3)]
    model = copy.deepcopy(work.model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    run = ul.train(model, batches, optimizer, loss_fn=work.loss_fn, parallel=spec, progress=False)
    assert len(run.steps) == 3 and "nccl" in run.notes[0]
    reference = copy.deepcopy(work.model)
    ul.train(reference, [(x.cuda(), y.cuda()) for x, y in batches], torch.optim.SGD(reference.parameters(), lr=0.1),
             loss_fn=work.loss_fn, progress=False)
    for trained, expected in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(trained, expected, rtol=1e-4, atol=1e-5)
    rank_work = zoo.get("mlp3", batch=8, seed=0, device="meta")
    rank_work = replace(rank_work, optimizer=torch.optim.SGD(rank_work.model.parameters(), lr=0.1))
    for rank in range(world):
        traced = ul.trace(rank_work, device="cuda", parallel=replace(spec, rank=rank))
        measured = int(run.steps[f"peak_bytes_rank{rank}"].iloc[-1])
        print(f"{make_spec.__name__} rank {rank}: measured {measured}, predicted {traced.cuda_peak_bytes}")
        assert abs(measured - traced.cuda_peak_bytes) <= 0.01 * traced.cuda_peak_bytes
