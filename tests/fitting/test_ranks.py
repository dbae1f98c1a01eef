"""sweep_ranks / ul.sweep(world_sizes=...) and min_world_size: one rank's step at each world size, against a budget."""

import pandas as pd
import pytest

import udnn_lab as ul
from udnn_lab.fitting.ranks import COLUMNS

H100 = "h100-sxm"  # ranks of a GPU cluster, whatever this machine has

MLP = dict(batch=4, optimizer="adam")


@pytest.fixture(scope="module")
def table() -> pd.DataFrame:
    return ul.sweep("mlp3", ["16MiB", "40MiB"], world_sizes=[1, 2, 8], progress=False,
                    setups=["DDP", "FSDP2", "FSDP2+offload", "HSDP"], ranks_per_node=2, **MLP, hardware=H100)


def _peaks(table: pd.DataFrame, setup: str, budget: str = "16MiB") -> dict[int, int]:
    rows = table[(table.setup == setup) & (table.budget_bytes == ul.parse_bytes(budget))]
    return dict(zip(rows.world_size, rows.peak_bytes, strict=True))


def test_one_row_per_world_size_setup_and_budget(table):
    assert list(table.columns) == COLUMNS and len(table) == 3 * 4 * 2
    assert set(table.spec) >= {"DDP over 8 ranks (25 MiB buckets)",
                               "HSDP over 8 ranks (4 replicas x 2 shards, reshard after forward)"}


def test_ddp_ranks_hold_the_whole_model_at_every_world_size_and_fsdp_ranks_a_shrinking_share(table):
    ddp, fsdp = _peaks(table, "DDP"), _peaks(table, "FSDP2")
    assert len(set(ddp.values())) == 1
    assert fsdp[1] > fsdp[2] > fsdp[8]
    assert _peaks(table, "HSDP")[8] == fsdp[2]  # sharded within a node of 2, replicated over 4 nodes


def test_a_setup_fits_when_its_peak_is_within_the_budget_and_offload_fits_below_the_traced_peak(table):
    assert (table.fits == (table.peak_bytes <= table.budget_bytes)).all()
    kept = table[table.policy == "keep-all"]
    assert (kept.peak_bytes == kept.traced_peak_bytes).all()
    assert table[~table.fits & (table.policy != "keep-all")].step_time_s.isna().all()


def test_offload_and_recompute_make_a_rank_fit_below_its_traced_peak():
    found = ul.sweep("resnet20", "32MiB", world_sizes=[8], setups=["FSDP2", "FSDP2+offload"], progress=False,
                     batch=16, optimizer="adam", hardware=H100).set_index("setup")
    assert not found.fits["FSDP2"] and found.traced_peak_bytes["FSDP2"] > ul.parse_bytes("32MiB")
    with_plan = found.loc["FSDP2+offload"]
    # its offloads may hide entirely behind compute (auto's spaced copies out): never faster than keeping all
    assert with_plan.fits and with_plan.peak_bytes <= with_plan.budget_bytes and with_plan.offloads + \
        with_plan.recomputes > 0 and with_plan.step_time_s >= found.step_time_s["FSDP2"]


def test_the_smallest_world_size_that_fits_is_found_and_the_one_below_it_does_not_fit():
    found = ul.min_world_size("mlp3", "20MiB", setup="FSDP2", progress=False, **MLP, hardware=H100)
    assert found.world_size == 4 and list(found.probes.world_size) == [1, 2, 4]
    assert list(found.probes.fits) == [False, False, True]
    none = ul.min_world_size("mlp3", "1MiB", setup="DDP", candidates=[1, 2], progress=False, **MLP, hardware=H100)
    assert none.world_size is None and "not even 2 ranks fit" in none.notes[0]


def test_a_ranks_peak_can_grow_again_once_fsdp_pads_every_dimension_to_the_world():
    """Why min_world_size tries every candidate from the smallest up rather than bisecting."""
    padded = ul.sweep("mlp3", "1GiB", world_sizes=[64, 1024], setups=["FSDP2"], progress=False, **MLP, hardware=H100)
    assert padded.peak_bytes.iloc[1] > padded.peak_bytes.iloc[0]


def test_what_a_sweep_cannot_take_is_refused_naming_it():
    graph = ul.trace(ul.zoo.get("mlp3", **MLP))
    assert len(ul.sweep(graph, ["40MiB"], ["keep-all"])) == 1  # over budgets, as planning.sweep
    with pytest.raises(TypeError, match="give world_sizes"):
        ul.sweep("mlp3", ["1GiB"])
    with pytest.raises(TypeError, match="rather than a traced Graph"):
        ul.sweep(graph, ["1GiB"], world_sizes=[2], hardware=H100)
    with pytest.raises(ValueError, match="the setups are DDP, FSDP2"):
        ul.sweep("mlp3", "1GiB", world_sizes=[2], setups=["ZeRO-3"], **MLP, hardware=H100)
    with pytest.raises(ValueError, match="world sizes are positive ints"):
        ul.sweep("mlp3", "1GiB", world_sizes=[0], **MLP, hardware=H100)
    with pytest.raises(ValueError, match="not keep-all"):
        ul.sweep("mlp3", "1GiB", ["keep-all"], world_sizes=[2], **MLP, hardware=H100)
    with pytest.raises(ValueError, match="whole nodes"):
        ul.sweep("mlp3", "1GiB", world_sizes=[12], setups=["HSDP"], ranks_per_node=8, **MLP, hardware=H100)


def test_collectives_take_time_on_their_own_stream_beyond_one_rank(table):
    kept = table[table.policy == "keep-all"].set_index(["setup", "world_size"]).groupby(level=[0, 1]).first()
    assert kept.communication_s[("DDP", 1)] == 0 and kept.communication_s[("FSDP2", 1)] == 0
    assert kept.communication_s[("DDP", 8)] > 0 and kept.communication_s[("FSDP2", 8)] > 0
    assert (kept.exposed_communication_s <= kept.communication_s).all()
    assert (kept.exposed_communication_s <= kept.step_time_s).all()


def test_a_workload_made_with_a_spec_is_swept_over_the_specs_asked_for_in_place_of_its_own():
    def rows(**parallel):
        work = ul.zoo.get("mlp3", device="meta", parallel=parallel.get("parallel"), **MLP)
        found = ul.sweep(work, "16MiB", world_sizes=[2, 4], setups=["DDP", "FSDP2"], progress=False, hardware=H100)
        return found.drop(columns=["trace_s", "plan_s"])

    pd.testing.assert_frame_equal(rows(parallel=ul.FSDP(8, reshard_after_forward=False)), rows())


def test_a_ddp_rank_is_traced_once_for_every_world_of_two_or_more_as_its_own_trace_would_be():
    work = ul.zoo.get("hf:gpt2", small=True, batch=2, seq_len=32, device="meta", optimizer="adamw")
    rows = ul.sweep(work, "1GiB", world_sizes=[2, 64], setups=["DDP"], progress=False,
                    hardware=H100).set_index("world_size")
    assert rows.trace_s[2] > 0 and rows.trace_s[64] == 0  # the second comes from the first
    own = ul.trace(work, device="cuda", parallel=ul.DDP(64))
    simulated = ul.simulate(own, hardware="h100-sxm")
    assert rows.peak_bytes[64] == own.cuda_peak_bytes and rows.spec[64] == "DDP over 64 ranks (25 MiB buckets)"
    assert rows.step_time_s[64] == simulated.step_time_s
    assert rows.communication_s[64] == simulated.communication_time_s > rows.communication_s[2]
