"""Searches never exhaust the host: a budget past the device is refused, and each size is checked before it is built."""

import time

import pytest
import torch

import udnn_lab as ul
from udnn_lab.errors import BudgetOverDevice, HostMemoryTooSmall
from udnn_lab.planning import host
from udnn_lab.planning.host import HostMemory

H100 = "h100-sxm"


def test_a_huge_budget_ends_at_once_with_one_clear_error():
    began = time.perf_counter()
    with pytest.raises(BudgetOverDevice, match=r"more than the 80\.00 GiB of device memory h100-sxm has") as error:
        ul.max_batch("resnet18", 1e30, hardware=H100, progress=False)
    assert time.perf_counter() - began < 5 and "\n" not in str(error.value)
    with pytest.raises(BudgetOverDevice, match="give a budget up to 24.00 GiB"):
        ul.max_seq_len("hf:gpt2", "1 TiB", hardware="l4", small=True, progress=False)
    with pytest.raises(BudgetOverDevice):
        ul.min_world_size("mlp3", "1 TiB", setup="DDP", hardware=H100, candidates=[1], progress=False)


def test_a_small_host_stops_the_search_before_a_size_is_built(monkeypatch):
    built: list[int] = []

    def step(batch: int) -> ul.Workload:  # the model on meta, the batch real: 4 KiB of host memory a sample
        built.append(batch)
        with torch.device("meta"):
            model = torch.nn.Sequential(torch.nn.Linear(1024, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
        return ul.Workload(model, torch.zeros(batch, 1024))

    monkeypatch.setattr(host, "host_memory", lambda: HostMemory(total_bytes=8 << 20, available_bytes=1 << 20))
    message = r"building the step at batch \d+ needs [\d.]+ [KM]iB of host memory, and this machine has 921\.60 KiB"
    with pytest.raises(HostMemoryTooSmall, match=message + r" for it .*\(limit=\)") as error:
        ul.max_batch(step, "1 GiB", hardware=H100, progress=False)
    refused = int(error.value.args[0].split("batch ")[1].split(" ")[0])
    assert refused not in built and max(built) * 4096 <= 1 << 20  # every size built fitted the host
    assert error.value.needed_bytes > error.value.available_bytes and "\n" not in str(error.value)


def test_auto_s_largest_batch_keeps_its_offloads_within_the_host_budget():
    def fit(host_budget):
        return ul.max_batch("resnet18", "300 MiB", policy="auto", hardware=H100, image_size=64, start=64,
                            multiple_of=32, host_budget=host_budget, progress=False)

    free, held = fit(None), fit(0)
    assert any(p.host_bytes > 0 for p in free.probes if p.fits)  # unhindered, auto offloads
    assert held.fits and all(p.host_bytes == 0 for p in held.probes if p.fits)
    assert held.host_budget_bytes == 0 and held.size <= free.size
