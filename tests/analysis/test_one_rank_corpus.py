"""One rank of DDP and FSDP2, traced for every model of the corpus of architectures nobody designed for."""

import pytest

import udnn_lab as ul
from tests.corpus.models import CORPUS
from udnn_lab.errors import ModelInputError

AVAILABLE = [name for name, entry in CORPUS.items() if entry.available]
EAGER_BUG = "modifies_saved_output"  # a bug eager autograd catches (a saved output scaled in place)
TIED_ACROSS_UNITS = "tied_weights"  # the root reads the encoder's weight: FSDP2 needs them in one unit


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n in AVAILABLE if n not in (EAGER_BUG, TIED_ACROSS_UNITS)])
def test_every_rank_of_ddp_and_fsdp2_traces_and_simulates(name):
    for spec in (ul.DDP(4), ul.FSDP(4, rank=3)):
        graph = ul.trace(CORPUS[name].workload(), parallel=spec)
        assert any(op.ranks == 4 for op in graph.ops), "no collective of the 4 ranks was recorded"
        simulation = ul.simulate(graph, hardware="h100-sxm")
        assert simulation.communication_time_s > 0 and simulation.step_time_s >= simulation.compute_time_s


def test_weights_tied_across_fsdp2_units_are_explained_and_one_unit_traces():
    work = CORPUS[TIED_ACROSS_UNITS].workload()
    with pytest.raises(ModelInputError, match="reads a parameter of another FSDP2 unit"):
        ul.trace(work, parallel=ul.FSDP(2))
    graph = ul.trace(work, parallel=ul.FSDP(2, wrap=lambda model, shard: shard(model.shared)))
    assert graph.peak_bytes > 0
