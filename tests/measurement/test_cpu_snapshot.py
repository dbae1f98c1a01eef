"""A real CPU step's storages written as a memory snapshot (measurement/cpu_snapshot.py)."""

import gzip
import pickle
import re

import pytest
import torch

import udnn_lab as ul
from udnn_lab.measurement.snapshot import place


def small_step():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.ReLU(), torch.nn.Flatten(),
                                torch.nn.Linear(8 * 8 * 8, 10))
    optimizer = torch.optim.Adam(model.parameters())
    return model, torch.randn(4, 3, 8, 8), torch.nn.functional.cross_entropy, optimizer, torch.randint(0, 10, (4,))


@pytest.mark.parametrize("name", ["step.pickle", "step.pickle.gz"])
def test_a_cpu_step_is_written_as_a_snapshot_whose_peak_is_the_steps(tmp_path, name):
    model, x, loss_fn, optimizer, y = small_step()
    before = [p.detach().clone() for p in model.parameters()]
    path = ul.write_cpu_snapshot(tmp_path / name, model, x, loss_fn, optimizer, target=y)
    raw = path.read_bytes()
    assert (raw[:2] == b"\x1f\x8b") == name.endswith(".gz")
    plain = pickle.loads(gzip.decompress(raw) if name.endswith(".gz") else raw)
    events = plain["device_traces"][0]
    assert {e["action"] for e in events} == {"alloc", "free_requested", "free_completed"}
    assert all(set(f) == {"filename", "line", "name"} for e in events for f in e["frames"])

    graph = ul.trace(model, x, loss_fn, optimizer, target=y)
    replay = ul.load_snapshot(path).replay()
    assert replay.start_bytes == graph.baseline_bytes  # parameters, Adam's state, the batch: in the segments
    assert replay.peak.allocated_bytes == graph.peak_bytes
    assert replay.reserved_bytes is None  # a CPU has no segments to record
    allocations = sum(1 for t in graph.tensors if t.alloc_step >= 0 and t.nbytes > 0)
    assert sum(e["action"] == "alloc" for e in events) == allocations
    # the code that asked, in words (line numbers left out: they change with torch's version)
    places = {re.sub(r":\d+ ", " ", place(e["frames"])) for e in events if e["action"] == "alloc"}
    assert {"modules/conv.py _conv_forward", "nn/functional.py relu", "optim/adam.py _single_tensor_adam",
            "analysis/step.py run_step"} <= places  # the last: backward, which runs from the step's own loop
    assert "(held before the history began)" in set(replay.peak.by_place()["where"])
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))  # the model is as it was


def test_a_model_that_cannot_run_on_the_cpu_is_refused_in_one_line(tmp_path):
    model = torch.nn.Linear(4, 4, device="meta")
    with pytest.raises(ValueError, match="meta parameters .* build it on a device") as raised:
        ul.write_cpu_snapshot(tmp_path / "x.pickle", model, torch.randn(2, 4, device="meta"))
    assert "\n" not in str(raised.value) and not (tmp_path / "x.pickle").exists()


class UnusedHead(torch.nn.Module):
    """A head the loss never reaches: its parameters get no gradient, so real AdamW makes them no state."""

    def __init__(self) -> None:
        super().__init__()
        self.body, self.spare = torch.nn.Linear(32, 10), torch.nn.Linear(32, 1000)

    def forward(self, x):
        return self.body(x)


@pytest.mark.parametrize("warmup", [0, 1])
def test_a_snapshot_without_warm_up_gives_state_to_the_parameters_a_step_gives_a_gradient(tmp_path, warmup):
    """With no warm-up the recorded step's optimizer state is made as its first step would make it: none for the
    unused head (130 KB of AdamW state the snapshot once held), so its peak is the trace's either way."""
    torch.manual_seed(0)
    model = UnusedHead()
    optimizer = torch.optim.AdamW(model.parameters())
    x, y = torch.randn(8, 32), torch.randint(0, 10, (8,))
    path = ul.write_cpu_snapshot(tmp_path / "step.pickle", model, x, torch.nn.functional.cross_entropy, optimizer,
                                 target=y, warmup=warmup)
    graph = ul.trace(model, x, torch.nn.functional.cross_entropy, optimizer, target=y)
    assert ul.load_snapshot(path).replay().peak.allocated_bytes == graph.peak_bytes
    assert len(optimizer.state) == 0  # the optimizer is as it was
