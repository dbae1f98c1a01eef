import numpy as np
import pytest

import udnn_lab as ul
from udnn_lab import frames, zoo

TITAN = ul.Hardware.load("titan-x-maxwell")


@pytest.fixture(scope="module")
def graph():
    return ul.trace(zoo.get("alexnet", batch=16, device="meta"), device="cuda")


@pytest.fixture(scope="module")
def simulations(graph):
    return {policy: ul.simulate(graph, ul.plan(graph, None, policy, hardware=TITAN), hardware=TITAN)
            for policy in ("keep-all", "vdnn-all")}


def test_saving_is_the_time_average_against_the_network_wide_baseline(graph, simulations):
    sim = simulations["vdnn-all"]
    curve = sim.curve
    held = curve["end_s"].to_numpy() - np.concatenate([[0.0], curve["end_s"].to_numpy()[:-1]])
    live = (curve["live_bytes"] - curve["optimizer_state"]).to_numpy()  # momentum is not one of the paper's functions
    average = (live * held).sum() / held.sum()
    assert ul.network_wide_saving(graph, sim) == pytest.approx(1 - average / ul.network_wide(graph).total_bytes)


def test_offloading_saves_more_than_keeping_all(graph, simulations):
    kept, offloaded = (ul.network_wide_saving(graph, simulations[p]) for p in ("keep-all", "vdnn-all"))
    assert 0 < kept < offloaded < 1  # PyTorch's reuse alone already saves against the network-wide allocation


def test_the_papers_baseline_gives_a_larger_saving_than_pytorchs(graph, simulations):
    pytorch = frames.savings(frames.simulations([({}, sim) for sim in simulations.values()])).set_index("policy")
    assert ul.network_wide_saving(graph, simulations["vdnn-all"]) > pytorch.loc["vdnn-all", "average_saved"]


def test_a_simulation_of_another_step_is_refused(graph):
    smaller = ul.simulate(ul.trace(zoo.get("alexnet", batch=8, device="meta"), device="cuda"), hardware=TITAN)
    with pytest.raises(ValueError, match="another step"):
        ul.network_wide_saving(graph, smaller)
