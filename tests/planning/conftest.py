import pytest

import udnn_lab as ul
from udnn_lab.simulation.simulator import cost_model


@pytest.fixture(scope="session")
def transformer():
    """The zoo transformer at batch 32, its CUDA step (traced with CPU kernels standing in) on an H100's figures: at
    a third of its keep-all peak, every tensor at the greedy's estimated peak is chosen or kept as a replay's
    source; at 43%, the exact planner re-runs whole layers."""
    graph = ul.trace(ul.zoo.get("transformer", batch=32, device="meta"), device="cuda")
    return graph, cost_model(graph, ul.Hardware.load("h100-sxm"))
