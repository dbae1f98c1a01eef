"""FSDP2 ranks that offload their parameters, traced for the corpus of architectures nobody designed for: what left
the device is what the host holds (NOTE [host storages])."""

import pytest

import udnn_lab as ul
from tests.corpus.models import CORPUS

AVAILABLE = [name for name, entry in CORPUS.items() if entry.available]
SKIPPED = ("modifies_saved_output", "tied_weights")  # see test_one_rank_corpus.py


def _check(name: str) -> None:
    work = CORPUS[name].workload()
    kept = ul.trace(work, device="cuda", parallel=ul.FSDP(4, rank=3))
    offloaded = ul.trace(work, device="cuda", parallel=ul.FSDP(4, rank=3, offload_params=True))
    shards = sum(t.nbytes for t in kept.tensors if t.category == "parameter" and t.alloc_step < 0)
    state = sum(t.nbytes for t in kept.tensors
                if t.category == "optimizer_state" and t.alloc_step < 0 and kept.on_device(t))
    assert offloaded.breakdown()["host_bytes"]["parameter"] == shards
    assert kept.baseline_bytes - offloaded.baseline_bytes == shards + state
    assert not any("second forward" in note for note in offloaded.notes)
    simulation = ul.simulate(offloaded, hardware="h100-sxm")
    assert simulation.h2d_bytes > 0 and simulation.d2h_bytes > 0


def test_a_model_with_batch_norm_whose_counter_adds_a_number():
    _check("batchnorm1d_mlp")


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n in AVAILABLE if n not in SKIPPED])
def test_every_offloading_rank_moves_its_shards_and_state_to_the_host(name):
    _check(name)
